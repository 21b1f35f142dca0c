"""The field table covers every field of the OpenAI SDK's request types: a field the SDK
gains fails this test until it is decided (honoured, or refused by name)."""

from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params

from spillover.errors import InvalidRequest
from spillover.http.fields import CHAT, COMPLETION, NO_OP, check_fields


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
