"""Tool schemas become bounded grammars in the gateway: the bounds hold at their edges, and
what the converter cannot handle is refused with the schema path, before any worker."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from spillover.engine.grammar import (
    JSON_CHAR,
    JSON_DOT,
    MAX_SCHEMA_DEPTH,
    GrammarRefused,
    _json_pattern,
    _max_nesting,
    integer_bounds,
    integer_range,
    schema_to_grammar,
)
from spillover.errors import InvalidRequest
from spillover.http.schemas import parse_chat
from spillover.runtime.prepare import _tool_grammar, tool_schema

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


def _regex(expr: str) -> re.Pattern[str]:
    """``integer_range``'s GBNF (quoted digits, digit classes, groups, alternatives) as a regex."""
    return re.compile(re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), expr).replace("(", "(?:").replace(" ", ""))


EDGES = [(0, 0), (1, 7), (-7, -1), (-15, 230), (0, 120), (10, 99), (100, 100), (7, 1007), (-1000, 1000), (19, 21)]


@pytest.mark.parametrize(
    ("lo", "hi"), EDGES + [tuple(sorted(random.Random(i).sample(range(-3000, 3000), 2))) for i in range(12)]
)
def test_an_integer_range_spells_exactly_the_integers_in_it(lo: int, hi: int) -> None:
    """The rule for an integer's bounds matches every integer from ``lo`` to ``hi`` as JSON
    writes it, and nothing else near them: no value outside, no leading zero, no ``-0``."""
    pattern = _regex(integer_range(lo, hi))
    for v in range(min(lo, 0) - 1200, max(hi, 0) + 1200):
        assert bool(pattern.fullmatch(str(v))) is (lo <= v <= hi), v
    for bad in ("-0", "00", "01", "+1", "007", ""):
        assert not pattern.fullmatch(bad), bad


def test_an_integer_range_holds_at_eighteen_digits() -> None:
    lo, hi = 123456789012345678, 987654321098765432
    pattern = _regex(integer_range(lo, hi))
    for v in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 5 * 10**17, 10**18, -lo):
        assert bool(pattern.fullmatch(str(v))) is (lo <= v <= hi), v


@pytest.mark.parametrize(
    ("bounds", "want"),
    [
        ({"minimum": 1, "maximum": 7}, (1, 7)),
        ({"exclusiveMinimum": 0, "exclusiveMaximum": 8}, (1, 7)),  # drafts 6+: numbers
        ({"minimum": 0, "exclusiveMinimum": True, "maximum": 8, "exclusiveMaximum": True}, (1, 7)),  # draft 4
        ({"minimum": 0, "exclusiveMinimum": False}, (0, 10**18 - 1)),
        ({"minimum": 0.5, "maximum": 7.9}, (1, 7)),  # fractional bounds: the integers within
        ({"exclusiveMinimum": 0.5, "exclusiveMaximum": 7.0}, (1, 6)),
        ({"minimum": 3, "exclusiveMinimum": 5}, (6, 10**18 - 1)),  # both: the tighter
        ({"maximum": -5}, (-(10**18) + 1, -5)),
    ],
)
def test_integer_bounds_of_either_draft(bounds: dict[str, Any], want: tuple[int, int]) -> None:
    assert integer_bounds({"type": "integer", **bounds}) == want


@pytest.mark.parametrize(
    "bounds",
    [{"minimum": 5, "maximum": 4}, {"exclusiveMinimum": 1, "exclusiveMaximum": 2}, {"minimum": 0.2, "maximum": 0.8},
     {"minimum": "1"}, {"maximum": None}, {"minimum": float("nan")}, {"maximum": float("inf")}, {"minimum": 1e300}],
)  # fmt: skip
def test_integer_bounds_nothing_meets_or_not_numbers_are_refused(bounds: dict[str, Any]) -> None:
    with pytest.raises(GrammarRefused):
        schema_to_grammar(obj(n={"type": "integer", **bounds}), **BOUNDS)


def test_a_schemas_strings_leave_out_control_characters() -> None:
    """JSON forbids control characters unescaped in a string; the converter's ``char`` let
    them through, so a forced answer could fail ``json.loads`` and the SDKs' ``parse()``."""
    grammar = schema_to_grammar(obj(name={"type": "string"}, short={"type": "string", "maxLength": 3}), **BOUNDS)
    char = next(line for line in grammar.splitlines() if line.startswith("char ::="))
    assert char == f"char ::= {JSON_CHAR}"
    assert r"\x00-\x1F" in char and r"\x7F" in char


def test_integer_bounds_refused_name_their_schema_path() -> None:
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(n={"type": "integer", "minimum": 5, "maximum": 4}), **BOUNDS)
    assert e.value.path == "properties.n.maximum" and "no integer" in e.value.message


def test_a_nullable_integer_keeps_its_bounds() -> None:
    """``"type": ["integer", "null"]`` (OpenAI's strict mode's nullable field): each type keeps
    the other keywords, so the bounds hold (the converter's list branch dropped them) and
    bounds no integer meets are refused."""
    grammar = schema_to_grammar({"type": ["integer", "null"], "minimum": 1, "maximum": 7}, **BOUNDS)
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["root"] == "alternative-0 | null" and "integral-part" not in grammar
    assert rules["alternative-0"] == f"({integer_range(1, 7)}) space"
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(n={"type": ["integer", "null"], "minimum": 9, "maximum": 1}), **BOUNDS)
    assert e.value.path == "properties.n.maximum"


def test_a_patterns_dot_and_negated_classes_leave_out_what_json_escapes() -> None:
    """A ``pattern`` string: ``.`` and ``[^...]`` could write a raw quote, backslash or control
    character into the JSON string (the converter's ``dot`` is ``[^\\x0A\\x0D]``)."""
    grammar = schema_to_grammar(obj(a={"type": "string", "pattern": r"^[^,]{1,3}\..[a-c]$"}), **BOUNDS)
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["dot"] == JSON_DOT == r'[^"\\\x00-\x1F\x7F]'
    assert r'[^"\\\x00-\x1F\x7F\x2C]' in grammar and r"[\x61-\x63]" in grammar


@pytest.mark.parametrize(
    ("bounds", "path"),
    [
        ({"minimum": 10**18}, "properties.n.minimum"),  # 19 digits: the 18-digit bound names it
        ({"exclusiveMinimum": 5, "exclusiveMaximum": 6}, "properties.n.exclusiveMaximum"),
        ({"minimum": 5, "exclusiveMaximum": 5}, "properties.n.exclusiveMaximum"),
    ],
)
def test_integer_bounds_refusals_name_the_keyword_the_schema_has(bounds: dict[str, Any], path: str) -> None:
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(n={"type": "integer", **bounds}), **BOUNDS)
    assert e.value.path == path


@pytest.mark.parametrize(
    ("pattern", "want"),
    [
        (r"^\d{5}$", "^([0-9]{5})$"),  # pydantic's digits: llama.cpp's parser refused \d; the body is one group
        (r"\w+\s\W", r'[0-9A-Za-z_]+[ ][^"\\\x00-\x1F\x7F0-9A-Za-z_]'),
        (r"[\d-]", r"[\x30-\x39\x2D]"),
        (r"[\w\.-]+", r"[\x30-\x39\x41-\x5A\x5F\x61-\x7A\x2E\x2D]+"),  # refused by llama.cpp before
        (r"[ -~]+", r"[\x20-\x21\x23-\x5B\x5D-\x7E]+"),  # less the quote and the backslash JSON escapes
        (r"[^a]", r'[^"\\\x00-\x1F\x7F\x61]'),
        (r"a\\+", r"a(\\\\)+"),  # a quantifier takes the whole escape (it took "a\\" as one literal)
        ('a"?', r'a(\\")?'),
        (r"a\"b", r'a(\\")b'),
        (r"^\n+$", r"^((\\u000a)+)$"),  # it wrote \nnn
        (r"a\.b\-c\/d\$", r"a[.]b-c/d[\x24]"),
        (r"\x41\u0022", r'A(\\")'),
    ],
)
def test_a_pattern_is_rewritten_for_a_json_string(pattern: str, want: str) -> None:
    assert _json_pattern(pattern) == want


@pytest.mark.parametrize("pattern", [r'^["]$', r"^[\\]$", r"a\bc", r"\p{L}", r"(a)\1", r"[\D]", r"[a-z"])
def test_a_pattern_the_grammar_cannot_keep_is_refused_naming_it(pattern: str) -> None:
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(p={"type": "string", "pattern": pattern}), **BOUNDS)
    assert e.value.path == "properties.p.pattern"


def test_literals_write_every_character_as_itself() -> None:
    """A constant's or a property name's JSON text: a backslash, a quote, a control character
    (the converter's literal kept one backslash, which JSON read as an escape, and a quote
    inside broke the grammar llama.cpp parses)."""
    grammar = schema_to_grammar({"enum": ["a\\b", 'say "hi"', "tab\there"]}, **BOUNDS)
    root = dict(line.split(" ::= ", 1) for line in grammar.splitlines())["root"]
    assert root == r'"\"a\\\\b\"" | "\"say \\\"hi\\\"\"" | "\"tab\\there\""'


@pytest.mark.parametrize(
    ("prop", "key"),
    [
        ({"type": "integer", "multipleOf": 5}, "multipleOf"),  # silently not enforced before
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}, "pattern"),  # maxLength was ignored
        ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2}, "pattern"),
    ],
)
def test_keywords_the_grammar_cannot_enforce_are_refused(prop: dict[str, Any], key: str) -> None:
    with pytest.raises(GrammarRefused) as e:
        schema_to_grammar(obj(p=prop), **BOUNDS)
    assert e.value.path == f"properties.p.{key}"


def test_a_forced_tools_defs_resolve_from_the_wrapper() -> None:
    """pydantic's nested models: ``#/$defs/Pt`` in a function's parameters (it was resolved
    against the name/arguments wrapper and refused)."""
    pt = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Pt"}}, "required": ["at"], "$defs": {"Pt": pt}}
    tools = ({"type": "function", "function": {"name": "move", "parameters": params}},)
    schema = tool_schema(tools, "move")
    assert schema["$defs"] == {"Pt": pt} and "$defs" not in schema["properties"]["arguments"]
    assert "[0-9]" in schema_to_grammar(schema, **BOUNDS)
    other = {**params, "$defs": {"Pt": {"type": "string"}}}
    both = (*tools, {"type": "function", "function": {"name": "jump", "parameters": other}})
    with pytest.raises(InvalidRequest) as e:
        tool_schema(both, "*")
    assert e.value.param == "tools"


def test_a_forced_tools_own_refs_resolve_inside_its_arguments() -> None:
    """Round 48: zod-to-json-schema's reused part (``#/properties/a``) and a self-recursive
    pydantic root (``$ref`` at the top, beside ``$defs``) resolved against the name/arguments
    wrapper ("a not in {'name': ...}") or got a ``type`` beside their ``$ref``; a refusal named
    the wrapper's ``properties.arguments`` in its path."""

    def tool(name: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": params}}

    zod = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}
    kids = {"type": "array", "items": {"$ref": "#/$defs/N"}}
    recursive = {
        "$defs": {"N": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": kids}}},
        "$ref": "#/$defs/N",
    }
    for params in (zod, recursive):
        assert schema_to_grammar(tool_schema((tool("f", params),), "f"), **BOUNDS)
    one = tool_schema((tool("f", zod),), "f")["properties"]["arguments"]
    assert one["properties"]["b"] == {"$ref": "#/properties/arguments/properties/a"}
    two = tool_schema((tool("f", zod), tool("g", zod)), "*")["anyOf"][1]["properties"]["arguments"]
    assert two["properties"]["b"] == {"$ref": "#/anyOf/1/properties/arguments/properties/a"}
    unique = {"type": "object", "properties": {"v": {"type": "array", "uniqueItems": True, "items": {}}}}
    messages = [{"role": "user", "content": "x"}]
    req = parse_chat({"messages": messages, "tools": [tool("f", unique)], "tool_choice": "required"}, "m")
    with pytest.raises(InvalidRequest) as e:
        _tool_grammar(req, 65536, 512)
    assert e.value.param == "tools[0].function.parameters.properties.v.uniqueItems"
