"""Ollama request bodies become validated requests; a malformed part is a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.errors import InvalidRequest
from spillover.http.ollama import parse_ollama_chat, parse_ollama_generate

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
