"""The OpenAI-compatible API, driven by the official openai client, on the real model."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
MSG = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    """GET /v1/models lists exactly the served model."""
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_one_model_is_retrieved_by_id_or_alias(client: openai.OpenAI) -> None:
    """GET /v1/models/{id}: the SDK's models.retrieve, by id or alias; an unknown id is a 404."""
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve("smollm2").id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_non_stream_chat(client: openai.OpenAI) -> None:
    """A non-stream chat completion returns text, usage and the spillover object, on GPU."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=16, temperature=0)
    r = raw.parse()
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 5
    assert raw.headers["x-spillover-route"] == "gpu"
    assert raw.headers["x-spillover-degraded"] == "0"
    assert len(raw.headers["x-spillover-request-id"]) == 24
    extra = r.model_extra or {}
    assert (
        extra["spillover"]["route"] == "gpu"
        and extra["spillover"]["request_id"] == raw.headers["x-spillover-request-id"]
    )


def test_stream_chat_matches_non_stream_greedy(client: openai.OpenAI) -> None:
    """Greedy output is identical across two non-stream calls and one streamed call."""
    a = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    assert (chunks[0].model_extra or {})["spillover"]["route"] == "gpu"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == a.usage.completion_tokens


def test_text_completion_and_stop(client: openai.OpenAI) -> None:
    """/v1/completions honours stop sequences (never delivered) and max_tokens."""
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=40, temperature=0, stop=[" 9"])
    assert " 9" not in r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    """The same seed with temperature > 0 gives the same text."""
    kw = dict(model=MODEL, messages=MSG, max_tokens=20, temperature=0.9, top_p=0.95, seed=42)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}


def forced_weather(**changes: Any) -> dict[str, Any]:
    """A chat request whose ``tool_choice`` forces ``get_weather`` (``WEATHER``), greedy."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        "max_tokens": 80,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    } | changes


def test_named_tool_choice_gives_valid_tool_call(client: openai.OpenAI) -> None:
    """A named tool_choice yields a schema-valid tool call with a stable-format id."""
    r = client.chat.completions.create(**forced_weather())
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and isinstance(args["days"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_off_by_max_tokens_comes_as_openai_gives_it(client: openai.OpenAI, stream: bool) -> None:
    """A forced call that ``max_tokens`` cuts off is the call so far with finish_reason
    ``length`` (OpenAI's answer), never a retryable 503 (it was ``worker_failed`` with
    x-should-retry true: the SDK reran the whole generation, to fail the same way)."""
    kw = forced_weather(max_tokens=6)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or []) if ch.choices]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert len(calls) == 1 and finish == ["length"], chunks
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "length"
        name, arguments = (
            r.choices[0].message.tool_calls[0].function.name,
            r.choices[0].message.tool_calls[0].function.arguments,
        )
    assert name == "get_weather" and isinstance(arguments, str)
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)  # cut off: not whole


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": MODEL, "messages": MSG, "temperature": 5}, 400, "temperature", None),
        ({"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens", None),
        ({"model": MODEL, "messages": MSG, "top_p": "x"}, 400, "top_p", None),
        ({"model": MODEL, "messages": []}, 400, "messages", None),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
        ({"model": MODEL, "messages": MSG, "stop": [1]}, 400, "stop", None),
        ({"model": MODEL, "messages": MSG, "n": 2}, 400, "n", None),
        ({"model": MODEL, "messages": MSG, "tool_choice": "required"}, 400, "tool_choice", None),
        ({"model": "gpt-9", "messages": MSG}, 404, "model", "model_not_found"),
        ({"model": MODEL, "messages": MSG, "max_tokens": 5000}, 400, "messages", "context_length_exceeded"),
    ],
)
def test_bad_input_is_rejected_openai_shaped(
    gateway: GatewayProcess, body: dict, status: int, param: str | None, code: str | None
) -> None:
    """Invalid parameters, unknown models and over-long requests get OpenAI-shaped errors."""
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["param"] == param
    if code:
        assert err["code"] == code
    assert r.headers["x-spillover-request-id"] and r.headers["x-spillover-route"] == "none"


def test_bad_json_and_oversized_body(gateway: GatewayProcess) -> None:
    """Malformed JSON is 400; a body over the limit is 413 (refused from Content-Length)."""
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = b'{"messages": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    r = httpx.post(
        gateway.url + "/v1/chat/completions", content=big, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_oversized_chunked_body_is_cut_off(gateway: GatewayProcess) -> None:
    """Without Content-Length, the body is refused as soon as it passes the limit."""

    def gen():
        for _ in range(64):
            yield b"x" * 65536

    r = httpx.post(
        gateway.url + "/v1/chat/completions", content=gen(), headers={"Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == 413


def test_prompt_longer_than_context(client: openai.OpenAI) -> None:
    """A prompt longer than every lane's context is 400 context_length_exceeded."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 3000}])
    assert exc.value.code == "context_length_exceeded"


def test_health_ready_status_and_unknown_route(gateway: GatewayProcess) -> None:
    """/health, /ready and /v1/status answer; unknown routes are OpenAI-shaped 404s."""
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    assert httpx.get(gateway.url + "/ready").status_code == 200
    st = httpx.get(gateway.url + "/v1/status").json()
    assert st["mode"] == "normal" and st["device"]["simulated"] is True
    assert {w["lane"] for w in st["workers"]} == {"gpu", "cpu"}
    r = httpx.get(gateway.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_cancelled_request_is_not_resubmitted_by_the_sdk(gateway: GatewayProcess) -> None:
    """DELETE of a running request ends the SDK call (max_retries=2) with one 409 that says
    x-should-retry: false: the SDK does not send it again, so it ran exactly once."""
    import threading

    from tests.e2e.helpers import COUNT_PROMPT, wait_for

    def finished() -> float:
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("spillover_requests_total{")
        )

    before = finished()
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=2)
    out: dict[str, BaseException] = {}

    def call() -> None:
        try:
            sdk.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=400, temperature=0)
        except openai.APIStatusError as exc:
            out["exc"] = exc

    th = threading.Thread(target=call)
    th.start()
    rid = wait_for(lambda: next((x["rid"] for x in gateway.status()["running"]), None), 30, "running")
    httpx.delete(f"{gateway.url}/v1/requests/{rid}", timeout=30)
    th.join(60)
    exc = out["exc"]
    assert isinstance(exc, openai.ConflictError) and exc.response.headers["x-should-retry"] == "false"
    assert exc.body["code"] == "request_cancelled"  # type: ignore[index]
    # A resubmission would have run to completion before the call returned (no 409 then).
    assert gateway.status()["running"] == [] and finished() == before + 1


def test_without_a_seed_each_request_samples_afresh_and_reports_its_seed(client: openai.OpenAI) -> None:
    """Regenerating at temperature 1 without a seed gives different answers; each answer names
    the seed it used, and sending that seed reproduces it exactly."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=40, temperature=1.0)
    a, b = (client.chat.completions.create(**kw) for _ in range(2))  # type: ignore[call-overload]
    seed_a = (a.model_extra or {})["spillover"]["seed"]
    seed_b = (b.model_extra or {})["spillover"]["seed"]
    assert seed_a != seed_b and a.choices[0].message.content != b.choices[0].message.content
    again = client.chat.completions.create(**kw, seed=seed_a)  # type: ignore[call-overload]
    assert again.choices[0].message.content == a.choices[0].message.content


def test_responses_api_is_a_clear_404_naming_what_is_served(client: openai.OpenAI) -> None:
    """responses.create gets a 404 that says which endpoints to use, and is not retried."""
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi")
    assert e.value.response.headers["x-should-retry"] == "false"
    assert "/v1/chat/completions" in e.value.message and e.value.body["code"] == "endpoint_not_supported"  # type: ignore[index]


def test_stop_sequences_do_not_cut_a_forced_tool_call(client: openai.OpenAI) -> None:
    """A stop of ``","`` or ``'"'`` matched the hidden name/arguments wrapper: the call came
    back with empty arguments. Stops do not apply to a forced call."""
    r = client.chat.completions.create(**forced_weather(stop=[",", '"']))
    assert r.choices[0].finish_reason == "tool_calls"
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
