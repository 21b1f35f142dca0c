"""Ollama request bodies become validated requests; a malformed part is a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.errors import ContextLengthExceeded, InvalidRequest
from spillover.http.ollama import (
    ollama_error_body,
    ollama_param,
    parse_ollama_chat,
    parse_ollama_generate,
    unloads,
)

ASK = {"role": "user", "content": "Weather in Oslo?"}


def chat(*turns: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [ASK, *turns, {"role": "tool", "content": "12 C", "tool_name": "weather"}]}


def test_an_earlier_tool_call_is_carried_as_openais() -> None:
    call = {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    req = parse_ollama_chat(chat({"role": "assistant", "content": "", "tool_calls": [call]}), "m")
    got = req.messages[1]["tool_calls"][0]
    assert got["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and got["type"] == "function"


@pytest.mark.parametrize(
    ("calls", "param"),
    [
        ([{"function": "x"}], "messages[1].tool_calls[0]"),  # a 500 (AttributeError) before
        (["x"], "messages[1].tool_calls[0]"),  # skipped silently before
        ([{"function": {"arguments": {}}}], "messages[1].tool_calls[0]"),  # no name
        ([{"function": {"name": "w", "arguments": [1]}}], "messages[1].tool_calls[0].function.arguments"),
        ({"function": {"name": "w"}}, "messages[1].tool_calls"),  # not an array
        ("call it", "messages[1].tool_calls"),
    ],
)
def test_a_malformed_tool_call_is_a_400_naming_it(calls: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_ollama_chat(chat({"role": "assistant", "content": "", "tool_calls": calls}), "m")
    assert e.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "raw": "yes"}, "raw"),  # was read as raw: true
        ({"prompt": "hi", "stream": 0}, "stream"),
        ({"prompt": "hi", "options": []}, "options"),  # was read as no options
        ({"prompt": "hi", "system": 5}, "system"),
    ],
)
def test_ollamas_flags_and_texts_of_another_type_are_a_400_naming_them(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_ollama_generate({"model": "m"} | body, "m")
    assert e.value.param == param


def test_ollamas_flags_of_their_own_type_pass() -> None:
    req = parse_ollama_generate({"model": "m", "prompt": "hi", "raw": True, "stream": False, "options": None}, "m")
    assert req.kind == "text" and req.prompt == "hi"


def test_raw_takes_no_system_as_ollamas_refuses_it() -> None:
    """Round 68: ``raw`` with ``system`` answered as if ``system`` were not there."""
    with pytest.raises(InvalidRequest) as e:
        parse_ollama_generate({"model": "m", "prompt": "The sky is", "raw": True, "system": "say banana"}, "m")
    assert e.value.param == "system"
    assert parse_ollama_generate({"model": "m", "prompt": "hi", "raw": True, "system": ""}, "m").kind == "text"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "hi", "foo": 1}, "messages[1].foo"),  # dropped before (round 68)
        ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "messages[1].tool_call_id"),  # a tool's
        ({"role": "tool", "content": "12 C", "tool_call_id": 7}, "messages[1].tool_call_id"),
        ({"role": "user", "content": "hi", "name": 5}, "messages[1].name"),  # OpenAI's check
        ({"role": "assistant", "content": "", "thinking": "hmm"}, "messages[1].thinking"),
        ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, "messages[1].content"),  # a string in Ollama's
        ({"role": "user", "content": 5}, "messages[1].content"),
    ],
)
def test_a_messages_key_ollama_does_not_serve_here_is_a_400_naming_it(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_ollama_chat({"model": "m", "messages": [ASK, message]}, "m")
    assert e.value.param == param


def test_openais_name_and_a_tool_messages_call_id_mean_the_same_here() -> None:
    """Round 69: code written for OpenAI sends them to /api/chat (ad2cb90 refused them)."""
    msgs = [
        ASK,
        {"role": "user", "content": "and Bergen?", "name": "ann"},
        {"role": "tool", "content": "9 C", "tool_call_id": "call_7"},
        {"role": "tool", "content": "8 C", "tool_call_id": "c", "tool_name": "w"},
    ]
    req = parse_ollama_chat({"model": "m", "messages": msgs}, "m")
    assert req.messages[1]["name"] == "ann"
    assert [m["tool_call_id"] for m in req.messages[2:]] == ["call_7", "w"]


def test_a_messages_null_or_absent_content_is_empty_as_ollama_reads_it() -> None:
    msgs = [ASK, {"role": "assistant", "content": None, "thinking": ""}, {"role": "user"}]
    req = parse_ollama_chat({"model": "m", "messages": msgs}, "m")
    assert [m["content"] for m in req.messages] == [ASK["content"], "", ""]


@pytest.mark.parametrize(
    "options",
    [
        {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1, "repeat_last_n": 64, "penalize_newline": True},
        {"num_keep": 4},
        {"num_keep": -1, "mirostat": None},
        {"num_gpu": None, "bogus": None, "mirostat_eta": None},  # null is not given, whatever its name (round 69)
        {"mirostat_tau": 5.0, "mirostat_eta": 0.1},  # Ollama's defaults: they tune mirostat, which is off
        {"mirostat": 0, "mirostat_tau": 3},
    ],
)
def test_options_at_what_spillover_does_anyway_pass(options: dict[str, Any]) -> None:
    """Round 68: Ollama's clients send these at their defaults; each was a 400."""
    req = parse_ollama_chat({"model": "m", "messages": [ASK], "options": options}, "m")
    assert req.temperature == 0.8  # Ollama's defaults still apply


@pytest.mark.parametrize(
    "options",
    [
        {"mirostat": 2},
        {"typical_p": 0.5},
        {"tfs_z": 0.9},
        {"repeat_last_n": 128},
        {"penalize_newline": False},
        {"penalize_newline": 1},  # true, not one
        {"mirostat": False},
        {"num_keep": "4"},
        {"num_keep": -2},
        {"mirostat_tau": "5"},
        {"mirostat_eta": float("nan")},
        {"mirostat": 1, "mirostat_tau": 5.0},
    ],
)
def test_options_that_ask_for_something_else_are_a_400_naming_them(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_ollama_chat({"model": "m", "messages": [ASK], "options": options}, "m")
    assert e.value.param == f"options.{next(iter(options))}"


def test_an_error_names_the_field_of_ollamas_body_and_ollamas_route() -> None:
    """Round 68: under /api/ the params were the translated OpenAI request's, and a model of
    another kind was sent to an OpenAI route."""
    assert ollama_param("temperature") == "options.temperature" and ollama_param("stop") == "options.stop"
    assert ollama_param("max_tokens") == "options.num_predict"
    assert ollama_param("response_format.json_schema.schema.properties.a") == "format.properties.a"
    assert ollama_param("messages", generate=True) == "prompt" and ollama_param("messages") == "messages"
    assert ollama_param("messages[0].content") == "messages[0].content" and ollama_param(None) is None
    assert ollama_param("options.num_ctx") == "options.num_ctx" and ollama_param("model") == "model"
    wrong_kind = InvalidRequest(
        "model 'bge' serves embeddings, not chat: send it to /v1/embeddings", param="model", code="model_not_supported"
    )
    assert ollama_error_body(wrong_kind)["error"].endswith("send it to /api/embed")
    no_template = InvalidRequest(
        "model 'm' has no chat template: it serves completions only; send a prompt to /v1/completions",
        code="model_not_supported",
    )
    assert ollama_error_body(no_template)["error"].endswith('send a prompt to /api/generate with "raw": true')
    long = ollama_error_body(ContextLengthExceeded("too long", param="messages"), generate=True)
    assert long["param"] == "prompt" and long["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("value", "unload"), [
    (0, True), (0.0, True), (0.5, True), (1e-9, True), (1, False), ("0", True), ("0s", True), ("0m0s", True),
    ("0.0h", True), ("0.5s", False),
    ("5m", False), (-1, False), ("-1s", False), (None, False), ("zero", False), (False, False), ("0m1s", False),
])  # fmt: skip
def test_a_keep_alive_of_zero_asks_to_unload(value: Any, unload: bool) -> None:
    assert unloads(value) is unload
