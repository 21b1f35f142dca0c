"""Property-based fuzzing of request validation: whatever JSON a client sends, parsing either
gives a request or raises InvalidRequest with a message (never another exception, which
would be a 500)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.errors import InvalidRequest
from spillover.http.fields import CHAT, COMPLETION, NO_OP
from spillover.http.schemas import parse_chat, parse_completion, stored_body

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)
field_names = st.sampled_from(sorted(CHAT | COMPLETION | set(NO_OP["chat"]) | {"role", "content", "function", "name"}))
messages = st.lists(
    st.dictionaries(
        st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"]),
        st.one_of(st.sampled_from(["user", "assistant", "tool", "system", "developer"]), json_values),
        max_size=4,
    ),
    max_size=3,
)
bodies = st.one_of(
    json_values,
    st.dictionaries(field_names, json_values, max_size=8),
    st.fixed_dictionaries({"messages": messages}, optional={"tools": json_values, "tool_choice": json_values}),
)


def _parses_or_refuses(parse: Any, body: Any) -> None:
    try:
        parse(body, "m")
    except InvalidRequest as exc:
        assert exc.message and exc.status == 400


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_parse_chat_never_raises_anything_but_invalid_request(body: Any) -> None:
    """Chat bodies of any shape: a value or a 400, never a crash."""
    _parses_or_refuses(parse_chat, body)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_parse_completion_never_raises_anything_but_invalid_request(body: Any) -> None:
    """Completion bodies of any shape: a value or a 400, never a crash."""
    _parses_or_refuses(parse_completion, body)


@given(st.dictionaries(st.text(max_size=12), json_values, max_size=10))
def test_only_known_fields_are_stored(body: dict[str, Any]) -> None:
    """What is journaled is exactly the fields the gateway reads, unchanged."""
    kept = stored_body(body, "chat")
    assert set(kept) == set(body) & (CHAT | set(NO_OP["chat"]))
    assert all(kept[k] is body[k] for k in kept)
