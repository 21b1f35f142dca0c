"""The field table covers every field of the OpenAI SDK's request types: a field the SDK
gains fails this test until it is decided (honoured, or refused by name)."""

from __future__ import annotations

import importlib
import json
import typing
from typing import Any

import pytest
from openai.types import completion_create_params as text_params
from openai.types import shared_params
from openai.types.chat import ChatCompletionFunctionToolParam
from openai.types.chat import completion_create_params as chat_params
from openai.types.shared_params import response_format_json_schema

from spillover.errors import InvalidRequest
from spillover.http.app import DuplicateKey, _one_value_a_key
from spillover.http.fields import CHAT, COMPLETION, NO_OP, check_fields
from spillover.http.schemas import (
    FUNCTION_FIELDS,
    JSON_SCHEMA_FIELDS,
    MESSAGE_FIELDS,
    RESPONSE_FORMAT_FIELDS,
    TOOL_FIELDS,
    parse_chat,
)


@pytest.mark.parametrize(
    ("endpoint", "sdk", "honoured"),
    [
        ("chat", chat_params.CompletionCreateParamsBase, CHAT),
        ("text", text_params.CompletionCreateParamsBase, COMPLETION),
    ],
)
def test_every_sdk_field_is_decided(endpoint: str, sdk: type, honoured: frozenset[str]) -> None:
    """Each field openai-python can send is honoured or accepted only with a no-op value."""
    fields = set(typing.get_type_hints(sdk)) | {"stream"}
    undecided = sorted(fields - honoured - set(NO_OP[endpoint]))
    assert undecided == []


def test_a_no_op_field_with_another_value_is_refused_by_name() -> None:
    """n=1 passes, n=2 is a 400 naming n; True is not 1 (types are compared too)."""
    check_fields({"n": 1}, "chat")
    for bad in (2, True, "1"):
        with pytest.raises(InvalidRequest) as e:
            check_fields({"n": bad}, "chat")
        assert e.value.param == "n"


def test_unknown_fields_are_refused_unless_the_operator_tolerates_them() -> None:
    """An unknown field is a 400 naming it; listed in ignored_fields it passes."""
    with pytest.raises(InvalidRequest) as e:
        check_fields({"model": "m", "extra_thing": 1}, "chat")
    assert e.value.param == "extra_thing"
    check_fields({"model": "m", "extra_thing": 1}, "chat", ignored=("extra_thing",))


@pytest.mark.parametrize(
    ("role", "sdk"),
    [
        ("user", "chat_completion_user_message_param.ChatCompletionUserMessageParam"),
        ("system", "chat_completion_system_message_param.ChatCompletionSystemMessageParam"),
        ("developer", "chat_completion_developer_message_param.ChatCompletionDeveloperMessageParam"),
        ("assistant", "chat_completion_assistant_message_param.ChatCompletionAssistantMessageParam"),
        ("tool", "chat_completion_tool_message_param.ChatCompletionToolMessageParam"),
    ],
)
def test_every_sdk_message_field_is_taken(role: str, sdk: str) -> None:
    """Nested objects are checked field by field too: what the SDK sends in a message is taken."""
    module, name = sdk.split(".")
    hints = typing.get_type_hints(getattr(importlib.import_module(f"openai.types.chat.{module}"), name))
    assert set(hints) <= MESSAGE_FIELDS[role]


def test_every_sdk_tool_and_schema_field_is_taken() -> None:
    assert set(typing.get_type_hints(shared_params.FunctionDefinition)) <= FUNCTION_FIELDS
    assert set(typing.get_type_hints(ChatCompletionFunctionToolParam)) <= TOOL_FIELDS
    assert set(typing.get_type_hints(response_format_json_schema.JSONSchema)) <= JSON_SCHEMA_FIELDS
    assert set(typing.get_type_hints(response_format_json_schema.ResponseFormatJSONSchema)) <= RESPONSE_FORMAT_FIELDS


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"spillover": {"alow_shrink": True}}, "spillover.alow_shrink"),
        ({"messages": [{"role": "user", "content": "hi", "nme": "a"}]}, "messages[0].nme"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
        ({"messages": [{"role": "assistant", "content": "a", "refusal": "no"}]}, "messages[0].refusal"),
        ({"tools": [TOOL | {"extra": 1}]}, "tools[0].extra"),
        ({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]}, "tools[0].function.paramters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 0}}]},
            "tools[0].function.description",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "shema": {}}}}, None),
        ({"response_format": SCHEMA_FORMAT | {"strict": True}}, "response_format.strict"),
        ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format.json_schema"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}}, None),
    ],
)
def test_nested_unknown_or_conflicting_fields_are_refused_by_name(extra: dict[str, Any], param: str | None) -> None:
    """A typo inside an object (``paramters``, ``alow_shrink``, ``shema``) was answered as if it
    had not been sent: the forced call came back ``{}``, a schema became "any JSON"."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra
    with pytest.raises(InvalidRequest) as e:
        parse_chat(body, "m")
    if param is not None:
        assert e.value.param == param, e.value
    else:
        assert "unknown field" in str(e.value), e.value


def test_what_an_sdk_echoes_back_and_a_name_are_taken() -> None:
    """An assistant message as an answer gives it back (``refusal: null``, ``annotations: []``)
    passes; a message's ``name`` reaches the chat template; equal token limits pass."""
    req = parse_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "yo", "refusal": None, "annotations": [], "audio": None},
                {"role": "user", "content": "again"},
            ],
        },
        "m",
    )
    assert req.messages[0]["name"] == "ann" and req.max_tokens == 5


def test_what_openai_python_echoes_and_nulls_are_taken() -> None:
    """openai-python's ``parse()`` answer appended to the conversation carries ``parsed``, its
    stream helper's tool calls ``index`` and ``parsed_arguments``; a null is absent; Cline's
    text parts carry ``cache_control``. Another key in a part is refused by name."""
    fn = {"name": "f", "arguments": "{}", "parsed_arguments": {}}
    call = {"id": "c", "type": "function", "index": 0, "function": fn}
    parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": "{}", "parsed": {"a": 1}, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "x"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "description": None, "parameters": {}}}],
            "response_format": {"type": "text", "json_schema": None},
        },
        "m",
    )
    part = {"type": "text", "text": "a", "x": 1}
    with pytest.raises(InvalidRequest) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [part]}]}, "m")
    assert e.value.param == "messages[0].content[0].x"


def test_a_key_given_twice_in_one_object_is_refused() -> None:
    """``{"model": "a", "model": "b"}`` was served by ``b``: the last value won, unseen."""
    assert _one_value_a_key([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    with pytest.raises(DuplicateKey) as e:
        json.loads('{"x": {"model": "a", "n": 1, "model": "b"}}', object_pairs_hook=_one_value_a_key)
    assert e.value.key == "model"
