"""Tool schemas become bounded grammars in the gateway: the bounds hold at their edges, and
what the converter cannot handle is refused with the schema path, before any worker."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.engine.grammar import MAX_SCHEMA_DEPTH, GrammarRefused, _max_nesting, schema_to_grammar

BOUNDS = {"max_bytes": 65536, "max_repeat": 512}


def obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": sorted(props)}


@pytest.mark.parametrize("key", ["minLength", "maxLength"])
def test_string_repetition_bound_is_inclusive(key: str) -> None:
    """A repetition of exactly max_repeat compiles; one more is refused naming the keyword."""
    lo = {"minLength": 0} if key == "maxLength" else {}
    assert schema_to_grammar(obj(s={"type": "string", key: 512, **lo}), **BOUNDS)
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(s={"type": "string", key: 513}), **BOUNDS)
    assert e.value.path == f"properties.s.{key}"


@pytest.mark.parametrize("key", ["minItems", "maxItems", "minProperties", "maxProperties"])
def test_array_and_object_repetitions_are_bounded(key: str) -> None:
    """Item and property counts are repetitions too."""
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(a={"type": "array", key: 10**6}), **BOUNDS)
    assert e.value.path == f"properties.a.{key}"


def test_non_integer_repetition_is_refused() -> None:
    """A repetition keyword must be a whole number (a float or a string is refused)."""
    for bad in (1.5, "10", True):
        with pytest.raises(GrammarRefused):
            schema_to_grammar(obj(s={"type": "string", "maxLength": bad}), **BOUNDS)


def test_schema_depth_bound() -> None:
    """A schema nested deeper than MAX_SCHEMA_DEPTH levels is refused before conversion."""
    node: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        node = obj(x=node)
    with pytest.raises(GrammarRefused, match="nests deeper"):
        schema_to_grammar(node, **BOUNDS)


def test_grammar_bytes_bound() -> None:
    """The compiled grammar's size is bounded; a smaller bound refuses what a larger one takes."""
    schema = obj(**{f"p{i}": {"type": "string", "maxLength": 40} for i in range(30)})
    size = len(schema_to_grammar(schema, **BOUNDS))
    assert schema_to_grammar(schema, max_bytes=size, max_repeat=512)
    with pytest.raises(GrammarRefused, match="byte grammar"):
        schema_to_grammar(schema, max_bytes=size - 1, max_repeat=512)


def test_unsupported_pattern_and_remote_ref_are_refused() -> None:
    """What the converter asserts on is a refusal, not a crash."""
    with pytest.raises(GrammarRefused):
        schema_to_grammar(obj(s={"type": "string", "pattern": "abc"}), **BOUNDS)
    with pytest.raises(GrammarRefused):
        schema_to_grammar({"$ref": "https://example.invalid/schema.json"}, **BOUNDS)


def test_huge_integer_bounds_are_refused() -> None:
    """Integer bounds past 18 digits are refused (the converter's range rules grow with them)."""
    assert schema_to_grammar(obj(n={"type": "integer", "minimum": 0, "maximum": 10**17}), **BOUNDS)
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(n={"type": "integer", "maximum": 10**19}), **BOUNDS)
    assert e.value.path == "properties.n.maximum"


@pytest.mark.parametrize(
    ("grammar", "depth"),
    [
        ("root ::= a", 0),
        ('root ::= ("(" ")")', 1),  # parentheses in a literal do not count
        ("root ::= [()] ((a))", 2),  # nor in a character class
        (r'root ::= "\"(" (a (b)?)?', 2),  # an escaped quote does not end the literal
    ],
)
def test_nesting_is_measured_outside_literals(grammar: str, depth: int) -> None:
    """Only grammar parentheses count towards the nesting bound."""
    assert _max_nesting(grammar) == depth


def test_nesting_bound_refuses_a_deep_grammar() -> None:
    """A repetition within max_repeat but nesting past a lower bound is refused by the nesting check."""
    schema = obj(s={"type": "string", "maxLength": 100})
    assert schema_to_grammar(schema, max_bytes=65536, max_repeat=100)
    with pytest.raises(GrammarRefused):
        schema_to_grammar(obj(s={"type": "string", "maxLength": 99, "minLength": 0}), max_bytes=65536, max_repeat=50)
