"""Every OpenAI request field is honoured or refused, never silently dropped (real model)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pydantic
import pytest

from spillover.config import default_model_path
from spillover.engine.llama_engine import Tokenizer
from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9,"

# Every field of OpenAI's chat completion request (openai-python 3.x's
# CompletionCreateParams), written out here, not read from the code under test, with a value
# and what the server must do: "ok" (honoured, 200) or "400" (refused, param names it).
CHAT_FIELDS: list[tuple[str, Any, str]] = [
    ("audio", {"voice": "alloy", "format": "wav"}, "400"),
    ("frequency_penalty", 0.5, "ok"),
    ("function_call", "auto", "400"),
    ("functions", [{"name": "f", "parameters": {"type": "object"}}], "400"),
    ("logit_bias", {"42": 5}, "ok"),
    ("logprobs", True, "ok"),
    ("max_completion_tokens", 4, "ok"),
    ("max_tokens", 4, "ok"),
    ("metadata", {"k": "v"}, "400"),
    ("modalities", ["text", "audio"], "400"),
    ("moderation", {"mode": "on"}, "400"),
    ("modalities", ["text"], "ok"),
    ("n", 2, "400"),
    ("n", 1, "ok"),
    ("parallel_tool_calls", False, "ok"),
    ("prediction", {"type": "content", "content": "x"}, "400"),
    ("presence_penalty", 0.5, "ok"),
    ("prompt_cache_key", "session-1", "ok"),
    ("prompt_cache_options", {"ttl": "1h"}, "400"),
    ("prompt_cache_retention", "24h", "400"),
    ("reasoning_effort", "low", "400"),
    ("response_format", {"type": "json_object"}, "ok"),
    ("safety_identifier", "user-1", "ok"),
    ("seed", 3, "ok"),
    ("service_tier", "auto", "ok"),
    ("service_tier", "flex", "400"),
    ("stop", ["\n"], "ok"),
    ("store", True, "400"),
    ("store", False, "ok"),
    ("stream_options", {"include_usage": True}, "400"),  # with stream=false: as OpenAI answers it
    ("temperature", 0.0, "ok"),
    ("tool_choice", "none", "ok"),
    # auto (no tool_choice): SmolLM2's template leaves tools out, so they would be dropped
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "400"),
    ("top_logprobs", 2, "ok"),  # with logprobs below
    ("top_p", 0.5, "ok"),
    ("user", "user-1", "ok"),
    ("verbosity", "low", "400"),
    ("web_search_options", {}, "400"),
    ("made_up_field", 1, "400"),
]


def test_the_table_covers_every_field_the_sdk_can_send() -> None:
    """The table above is written by hand: it must still name every field of the SDK's type."""
    import typing

    from openai.types.chat import completion_create_params

    sdk = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))
    assert sdk - {f for f, _, _ in CHAT_FIELDS} == {"model", "messages"}  # sent with every row


@pytest.fixture(scope="module")
def gw() -> Any:
    with GatewayProcess(["--gpu", "sim:1024"]) as g:
        yield g


def chat(gw: GatewayProcess, **body: Any) -> httpx.Response:
    doc = {"model": MODEL, "messages": MSG, "max_tokens": 8, "temperature": 0, **body}
    if "max_completion_tokens" in body:  # the two disagreeing are a 400 of their own
        del doc["max_tokens"]
    return httpx.post(f"{gw.url}/v1/chat/completions", json=doc, timeout=120)


@pytest.mark.parametrize(("field", "value", "expect"), CHAT_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in CHAT_FIELDS])
def test_each_chat_field_is_honoured_or_refused_by_name(
    gw: GatewayProcess, field: str, value: Any, expect: str
) -> None:
    """A field the server takes answers 200; one it cannot honour is a 400 whose param names it."""
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    r = chat(gw, **{field: value}, **extra)
    if expect == "ok":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and r.headers["x-should-retry"] == "false", r.text


def test_response_format_json_object_gives_a_json_object(gw: GatewayProcess) -> None:
    """json_object output parses as a JSON object, streamed or not."""
    ask = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    r = chat(gw, messages=ask, max_tokens=60, response_format={"type": "json_object"})
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict), content
    assert content.lstrip().startswith("{"), content


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


def test_parse_with_a_pydantic_model_returns_the_model(gw: GatewayProcess) -> None:
    """openai-python's .parse() with a pydantic model (json_schema, strict): a City comes back,
    streamed as well as not."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    r = client.chat.completions.parse(model=MODEL, messages=ask, response_format=City, max_tokens=80, temperature=0)  # type: ignore[arg-type]
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    with client.chat.completions.stream(
        model=MODEL,
        messages=ask,  # type: ignore[arg-type]
        response_format=City,
        max_tokens=80,
        temperature=0,
    ) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == city


def test_a_bad_json_schema_is_a_400_naming_the_schema_path(gw: GatewayProcess) -> None:
    """The grammar bounds of tool schemas apply to response_format too."""
    rf = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**6}}},
        },
    }
    r = chat(gw, response_format=rf)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("response_format.json_schema.schema"), r.text


def test_chat_logprobs_cover_every_token_with_sorted_alternatives(gw: GatewayProcess) -> None:
    """logprobs=true, top_logprobs=3: one entry per completion token, each a log-probability
    (<= 0) with 3 alternatives sorted high to low; greedy picks the likeliest."""
    r = chat(gw, logprobs=True, top_logprobs=3, max_tokens=10).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] > 0
    for e in entries:
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert e["token"] == e["top_logprobs"][0]["token"] and math.isclose(e["logprob"], tops[0])
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    assert "".join(e["token"] for e in entries) == r["choices"][0]["message"]["content"]


def test_streamed_and_completion_logprobs(gw: GatewayProcess) -> None:
    """Streamed chat chunks carry their token's logprobs; the completions API's logprobs=2
    gives its parallel arrays."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": True}
    lines = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    with_lp = [c for c in chunks if c.get("choices") and c["choices"][0].get("logprobs")]
    assert len(with_lp) == 6, chunks
    r = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": MODEL, "prompt": COUNT, "max_tokens": 5, "temperature": 0, "logprobs": 2},
        timeout=120,
    ).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]


def test_logit_bias_bans_and_forces_tokens(gw: GatewayProcess) -> None:
    """-100 on the greedy first token makes the model say something else; +100 on a token
    makes it say only that token."""
    tokenizer = Tokenizer(default_model_path())  # the served model's vocabulary
    first = chat(gw, logprobs=True, max_tokens=4).json()["choices"][0]["logprobs"]["content"][0]
    first_id = tokenizer.tokenize(first["token"], special=False, add_bos=False)[0]
    banned = chat(gw, logit_bias={str(first_id): -100}, logprobs=True, max_tokens=4).json()
    assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first["token"]
    forced_id = tokenizer.tokenize(" banana", special=False, add_bos=False)[0]
    forced = chat(gw, logit_bias={str(forced_id): 100}, max_tokens=3).json()
    assert forced["choices"][0]["message"]["content"].count("banana") == 3, forced
    unknown = chat(gw, logit_bias={str(tokenizer.n_vocab): 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "logit_bias", unknown.text


def test_penalties_change_a_repetitive_greedy_answer(gw: GatewayProcess) -> None:
    """frequency/presence penalties are applied: the same greedy request differs with them."""
    body = {"model": MODEL, "prompt": COUNT, "max_tokens": 24, "temperature": 0}
    plain = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    pen = httpx.post(
        f"{gw.url}/v1/completions",
        json={**body, "frequency_penalty": 2.0, "presence_penalty": 2.0},
        timeout=120,
    ).json()["choices"][0]["text"]
    assert plain != pen, plain
