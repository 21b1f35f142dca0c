"""engine.schema_keywords through engine.grammar: a keyword the output grammar would drop
without a word, or that no value meets, is a refusal naming it; what the converter enforces
(pydantic's usual shapes among them) still converts. Round 45b's schemas came back broken with
``finish_reason: stop``: ``{"b": 10}`` for ``required: ["a"]``, ``5`` for a string ``const``,
``[1, 2, 3, 4, 5]`` for ``maxItems: 2``."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.engine import schema_keywords
from spillover.engine.grammar import GrammarRefused, schema_to_grammar
from spillover.engine.schema_keywords import ANY_VALUE, normalised, unenforced

OBJ = {"type": "object", "properties": {"a": {"type": "string"}}}


def convert(schema: dict[str, Any]) -> str:
    return schema_to_grammar(schema, max_bytes=65536, max_repeat=512)


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        (
            {"type": "object", "properties": {"a": {}}, "required": ["a", "b"], "additionalProperties": False},
            "required",
        ),
        ({"type": "string", "minLength": 10, "maxLength": 2}, "minLength"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2}, "minItems"),
        ({"type": "object", "minProperties": 3}, "minProperties"),
        (OBJ | {"maxProperties": 0}, "maxProperties"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        ({"type": "string", "const": 5}, "const"),
        ({"type": "string", "enum": [1, 2]}, "enum"),
        ({"enum": []}, "enum"),
        ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "patternProperties"),
        (OBJ | {"if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["a"]}}, "if"),
        ({"type": "number", "minimum": 0}, "minimum"),
        ({"type": "string", "not": {"const": "x"}}, "not"),
        ({"type": "object", "anyOf": [OBJ]}, "type"),
        ({"$ref": "#/$defs/a", "minLength": 2, "$defs": {"a": {"type": "string"}}}, "minLength"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "minItems"),
        ({"type": "array", "minItems": 1}, "minItems"),
        ({"type": "string", "format": "date", "maxLength": 4}, "maxLength"),
        (
            {"type": "object", "properties": {"x": {"type": "array", "contains": {"type": "integer"}}}},
            "properties.x.contains",
        ),
        ({"type": ["string", "null"], "const": 1}, "const"),
        # round 46's review
        ({"allOf": [OBJ, {"type": "object", "properties": {"a": {"type": "integer"}}}]}, "allOf"),  # "a" twice
        ({"$ref": "#/x/A", "x": {"A": {"type": "number", "minimum": 5}}}, "x.A.minimum"),  # walked nowhere else
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "properties.a.anyOf"),
        ({"type": "string", "format": "uuid4", "maxLength": 3}, "maxLength"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 3}, "minItems"),
        ({"$ref": "#/$defs/M", "required": ["a"], "$defs": {"M": OBJ}}, "required"),
        ({"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}}, "additionalItems"),
        # round 47's review
        ({"type": "string", "pattern": "^a$|^b$"}, "pattern"),  # an anchor inside: a literal ^ and $
        ({"type": "object", "properties": {"a": {}}, "required": "ab"}, "required"),  # read as {"a", "b"}
    ],
)
def test_a_keyword_the_grammar_would_drop_or_no_value_meets_is_refused_by_name(
    schema: dict[str, Any], path: str
) -> None:
    with pytest.raises(GrammarRefused) as e:
        convert(schema)
    assert e.value.path == path, e.value


PYDANTIC = {
    "$defs": {
        "Colour": {"enum": ["red", "green"], "title": "Colour", "type": "string"},
        "Inner": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "title": "Inner"},
    },
    "type": "object",
    "title": "Outer",
    "properties": {
        "colour": {"$ref": "#/$defs/Colour"},
        "inner": {"allOf": [{"$ref": "#/$defs/Inner"}], "description": "an older pydantic's wrapper"},
        "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Maybe"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "name": {"type": "string", "minLength": 1, "format": "email", "title": "Name"},
        "literal": {"const": "a", "enum": ["a"], "type": "string"},
        "stars": {"type": ["integer", "null"], "minimum": 1, "maximum": 5},
        "when": {"type": "string", "format": "date-time"},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2},
        "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        "minLength": {"type": "integer", "default": {"minLength": "not a schema"}},
    },
    "required": ["colour", "inner", "tags", "name", "literal"],
}


ACCEPTED = [
    PYDANTIC,
    {},
    {"type": "object", "required": ["a"]},
    {"type": "string", "minLength": 2},
    {"type": ["string", "null"], "enum": ["celsius", "fahrenheit"]},  # OpenAI's strict optional enum
    {"type": ["string", "number"], "enum": ["a", 1]},  # zod's union of literals
    {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},  # draft 7's closed tuple
    {"$defs": {"M": OBJ}, "allOf": [{"$ref": "#/$defs/M"}, {"type": "object", "properties": {"b": {}}}]},
    # pydantic's Any and list[Any]: a title alone was "Unrecognized", items {} a KeyError
    {"type": "object", "properties": {"a": {"title": "A"}, "b": {"type": "array", "items": {}}}, "required": ["a"]},
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_what_the_converter_enforces_still_converts(schema: dict[str, Any]) -> None:
    assert unenforced(normalised(schema)) is None
    assert convert(schema)


def test_a_required_name_without_a_property_is_enforced_as_any_value() -> None:
    """The converter dropped it: ``{"required": ["a"]}`` gave ``{}``, ``["a", "b"]`` with only
    ``a`` defined gave ``{"a": 10}``."""
    out = normalised({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})
    assert out["properties"] == {"a": {"type": "integer"}, "b": ANY_VALUE}
    typed = normalised({"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"}})
    assert typed["properties"] == {"b": {"type": "integer"}}
    assert '\\"b\\"' in convert({"type": "object", "required": ["b"]})  # the key is in the grammar


def test_nested_type_lists_are_checked_once_a_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each type of a list was queued with the node's children: nullable arrays 16 deep took
    2.5 s, six-type lists 30 deep hours. Each level is read once per type, its children once."""
    calls = []
    real = schema_keywords._check_node
    monkeypatch.setattr(schema_keywords, "_check_node", lambda node, root: calls.append(1) or real(node, root))
    schema: dict[str, Any] = {"type": ["array", "null", "string", "number", "boolean", "object"]}
    for _ in range(30):
        schema = {"type": schema["type"], "items": schema}
    assert unenforced(normalised(schema)) is None
    assert len(calls) == 6 * 31


def test_data_nested_past_the_stack_is_a_refusal_not_a_crash() -> None:
    """A default nested 600 deep is data (not walked as schema), and copying it ran out of
    Python's stack: a 500 where the client's 400 belongs."""
    deep: list[Any] = []
    for _ in range(600):
        deep = [deep]
    with pytest.raises(GrammarRefused, match="nests too deeply"):
        convert({"type": "object", "properties": {"a": {"type": "array", "default": deep}}})


def test_required_beside_a_type_list_with_object_is_enforced() -> None:
    out = normalised({"type": ["object", "null"], "properties": {"a": {"type": "integer"}}, "required": ["b"]})
    assert out["properties"]["b"] == ANY_VALUE
    assert "type" not in normalised({"type": ["string", "null"], "enum": ["x"]})  # the values are the answer


def test_a_sub_schema_without_an_assertion_is_any_value() -> None:
    out = normalised({"type": "object", "properties": {"a": {"title": "A"}, "b": {}}, "items": {}})
    assert out["properties"] == {"a": {"title": "A", **ANY_VALUE}, "b": ANY_VALUE} and out["items"] == ANY_VALUE


def test_an_alternation_in_a_pattern_stays_inside_the_quotes() -> None:
    """``^a|b$`` wrote ``"\\"" "a" | "b" "\\"" space``: the closing quote went with ``b`` only."""
    root = next(
        line for line in convert({"type": "string", "pattern": "^a|b$"}).splitlines() if line.startswith("root")
    )
    assert '("a" | "b")' in root


def test_declared_properties_with_open_extras_are_closed() -> None:
    """The converter's extra keys could repeat a declared one with the extra schema's type
    (``{"a": 1, "a": "x"}``, a parser keeps ``"x"``); the declared properties alone meet any."""
    for extra in (True, {"type": "string"}):
        out = normalised({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": extra})
        assert "additionalProperties" not in out
    mapping = normalised({"type": "object", "additionalProperties": {"type": "integer"}})  # dict[str, int]: kept
    assert mapping["additionalProperties"] == {"type": "integer"}
