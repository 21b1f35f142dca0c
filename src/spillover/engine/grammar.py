"""A client's JSON schema turned into a bounded output grammar, in the gateway, before any
worker sees it.

llama.cpp parses a grammar recursively and expands repetitions into nested optional groups,
so a 267-byte schema (``{"type": "string", "maxLength": 200000}``) becomes 200,000 nested
groups and overflows the worker's stack; a huge ``minLength`` builds a gigabyte grammar.
Rules:

1. Before converting, every repetition keyword (``minLength``, ``maxLength``, ``minItems``,
   ``maxItems``, ``minProperties``, ``maxProperties``) must be at most ``max_repeat``, the
   schema at most ``MAX_SCHEMA_DEPTH`` levels deep, and integer bounds at most 18 digits, so
   the conversion itself is cheap.
2. The schema is converted by llama-cpp-python's own converter (the one the engine used);
   anything it cannot convert (an unsupported ``pattern``, a remote ``$ref``, ...) is refused.
   Two of its rules are spillover's (``_Converter``): a string's characters leave out the
   control characters JSON forbids unescaped (the converter's let them through, so
   ``json.loads`` and the SDKs' ``parse()`` refused what it forced), and an integer's
   ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` (either draft's form)
   are a rule that spells exactly the integers in range (the converter ignored them).
   Bounds no integer meets are refused. Before converting, the schema is read as the
   converter reads it (``engine.schema_keywords``): a keyword it would drop without a word
   (a ``number``'s bounds, ``uniqueItems``, ``minProperties``, ``if``, ``not``, a keyword
   beside a ``$ref`` or a union...) or that no value meets (an empty ``enum``, a ``const``
   of another type, a minimum above its maximum) is refused, and what it would misread is
   written as meant (a ``required`` name ``properties`` does not define is added to it).
3. The grammar must be at most ``max_bytes`` long and nest parentheses at most
   ``max_repeat`` deep.

A refusal is a ``GrammarRefused`` naming the schema path; the gateway answers 400.
"""

from __future__ import annotations

import json
import math
from typing import Any

from spillover.engine.schema_keywords import SCHEMA_MAPS, normalised, unenforced

__all__ = ["MAX_SCHEMA_DEPTH", "GrammarRefused", "schema_to_grammar"]

MAX_SCHEMA_DEPTH = 32
DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
INT_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_INT_BOUND = 10**18 - 1  # 18 digits


class GrammarRefused(ValueError):
    """The schema would give a grammar over the bounds, or cannot be converted."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.path = path


def _check(node: Any, path: str, depth: int, max_repeat: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarRefused(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", path)
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check(item, f"{path}[{i}]", depth + 1, max_repeat)
        return
    if not isinstance(node, dict):
        return
    for key in REPEAT_KEYS:
        v = node.get(key)
        if isinstance(v, bool) or (v is not None and not isinstance(v, int)):
            raise GrammarRefused(f"'{key}' must be a whole number", f"{path}.{key}".lstrip("."))
        if isinstance(v, int) and not 0 <= v <= max_repeat:
            raise GrammarRefused(
                f"'{key}' is {v}; this server constrains output to at most {max_repeat} repetitions",
                f"{path}.{key}".lstrip("."),
            )
    if isinstance(node.get("pattern"), str):
        try:
            _json_pattern(node["pattern"])
        except GrammarRefused as exc:
            raise GrammarRefused(exc.message, f"{path}.pattern".lstrip(".")) from None
    unsupported = _unsupported(node)
    if unsupported is not None:
        key, why = unsupported
        raise GrammarRefused(why, f"{path}.{key}".lstrip("."))
    for key in INT_BOUND_KEYS:
        v = node.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and not abs(v) <= MAX_INT_BOUND:  # NaN too
            raise GrammarRefused(f"'{key}' is out of range (at most 18 digits)", f"{path}.{key}".lstrip("."))
    if _integer_type(node):
        try:
            integer_bounds(node)
        except GrammarRefused as exc:
            raise GrammarRefused(exc.message, f"{path}.{exc.path}".lstrip(".")) from None
    for key, value in node.items():
        if key in DATA_KEYS:  # values, not schemas: a default may hold any key
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):  # names are the client's (a property "minLength")
            for name, sub in value.items():
                _check(sub, f"{path}.{key}.{name}".lstrip("."), depth + 2, max_repeat)
        elif isinstance(value, dict | list):
            _check(value, f"{path}.{key}".lstrip("."), depth + 1, max_repeat)


def _max_nesting(grammar: str) -> int:
    """The deepest parenthesis nesting outside string literals and character classes."""
    depth = deepest = 0
    in_str = in_class = escaped = False
    for ch in grammar:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_str:
            in_str = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            in_str = True
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


JSON_UNSAFE = r'"\\\x00-\x1F\x7F'  # what a JSON string holds only escaped, in a character class
JSON_DOT = f"[^{JSON_UNSAFE}]"  # a pattern's ``.`` inside a JSON string
# A JSON string's character: anything but a quote, a backslash and the control characters
# (JSON forbids them unescaped), or an escape.
JSON_CHAR = JSON_DOT + r' | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
# How a grammar literal writes a character that is not itself there.
_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"} | {
    chr(c): f"\\x{c:02X}" for c in [*range(0x20), 0x7F] if chr(c) not in "\n\r\t"
}
NO_INT_BOUND = 10**18 - 1  # an integer's missing bound: rule 1's widest
OTHER_FORMS = frozenset(("$ref", "oneOf", "anyOf", "const", "enum"))  # the converter's, before a type's


def _sequence(first: str, any_digits: int) -> str:
    return " ".join([first, *["[0-9]"] * any_digits])


def _span(x: str, y: str) -> list[str]:
    """Alternatives whose union is the digit strings from ``x`` to ``y`` (same length,
    ``x <= y``): a shared first digit, then the partial first digit ranges at either end and
    the whole ones between."""
    if x == y:
        return [f'"{x}"']
    n = len(x) - 1
    if x[0] == y[0]:
        return [f'"{x[0]}" ({" | ".join(_span(x[1:], y[1:]))})']
    alts = []
    low, high = int(x[0]), int(y[0])
    if x[1:] != "0" * n:  # x's first digit, then a tail from x's to 9...9
        alts.append(f'"{x[0]}" ({" | ".join(_span(x[1:], "9" * n))})')
        low += 1
    partial_top = y[1:] != "9" * n
    if partial_top:
        high -= 1
    if low <= high:
        alts.append(_sequence(f"[{low}-{high}]", n))
    if partial_top:  # y's first digit, then a tail from 0...0 to y's
        alts.append(f'"{y[0]}" ({" | ".join(_span("0" * n, y[1:]))})')
    return alts


def _naturals(a: int, b: int) -> list[str]:
    """Alternatives spelling exactly the integers ``a..b`` (``0 <= a <= b``), no leading zero."""
    alts: list[str] = []
    for digits in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (digits - 1) if digits > 1 else 0), min(b, 10**digits - 1)
        if lo <= hi:
            alts += _span(str(lo), str(hi))
    return alts


def integer_range(lo: int, hi: int) -> str:
    """A GBNF expression matching exactly the decimal integers ``lo..hi`` as JSON writes them."""
    alts = []
    if lo < 0:
        alts.append(f'"-" ({" | ".join(_naturals(max(1, -hi), -lo))})')
    if hi >= 0:
        alts += _naturals(max(0, lo), hi)
    return " | ".join(alts)


def _unsupported(node: dict[str, Any]) -> tuple[str, str] | None:
    """A keyword the grammar would silently not enforce, and why it is refused (rule 2): the
    answer would break the schema instead."""
    if "multipleOf" in node:
        return "multipleOf", "'multipleOf' cannot be enforced by this server's output grammar"
    if isinstance(node.get("pattern"), str) and ("minLength" in node or "maxLength" in node):
        return "pattern", (
            "a 'pattern' together with 'minLength'/'maxLength' cannot both be enforced; "
            "put the length in the pattern (e.g. {1,8})"
        )
    return None


def _integer_type(schema: Any) -> bool:
    """Whether a schema's ``type`` is ``integer`` or a list that holds it (a nullable integer)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


# A pattern's class escapes as code-point ranges (``\s``: a space only: JSON writes the other
# whitespace escaped), and the characters a JSON string holds only escaped.
_CLASS_RANGES = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x20, 0x20)],
}
_CLASS_BODIES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " "}
_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)]
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
_SPECIAL = set("[]()|{}*+?")  # the converter takes these escaped (``\X``)


def _refuse_escape(e: str) -> GrammarRefused:
    return GrammarRefused(f"the pattern's '\\{e}' cannot be enforced by this server's output grammar", "pattern")


def _escaped_char(pattern: str, i: int) -> tuple[int, int]:
    """The character an escape at ``pattern[i]`` (a backslash) stands for, and its length;
    ``GrammarRefused`` for an escape that is not one character (``\b``, ``\\p``, ...)."""
    e = pattern[i + 1] if i + 1 < len(pattern) else "\\"
    if e in _CHAR_ESCAPES:
        return _CHAR_ESCAPES[e], 2
    if e in "xu":
        digits = 2 if e == "x" else 4
        code = pattern[i + 2 : i + 2 + digits]
        if len(code) == digits and all(c in "0123456789abcdefABCDEF" for c in code):
            return int(code, 16), 2 + digits
        raise _refuse_escape(e)
    if e.isalnum():
        raise _refuse_escape(e)
    return ord(e), 2


def _json_char(c: int) -> str:
    """A regex the converter takes for the JSON text of character ``c`` in a string: itself, or
    its escape (a quote, a backslash and the control characters are written escaped)."""
    ch = chr(c)
    if ch == '"':
        return '(\\\\")'
    if ch == "\\":
        return "(\\\\\\\\)"
    if c < 0x20 or c == 0x7F:
        return f"(\\\\u{c:04x})"
    if ch == ".":
        return "[.]"
    if ch in _SPECIAL:
        return "\\" + ch
    if ch in "^$":
        return f"[\\x{c:02X}]"
    return ch


def _less_unsafe(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` without the characters a JSON string holds only escaped."""
    out = []
    for lo, hi in ranges:
        for u_lo, u_hi in _UNSAFE:
            if hi < u_lo or lo > u_hi or lo > hi:
                continue
            if lo < u_lo:
                out.append((lo, u_lo - 1))
            lo = max(lo, u_hi + 1)
        if lo <= hi:
            out.append((lo, hi))
    return out


def _class_char(c: int) -> str:
    return f"\\x{c:02X}" if c < 0x100 else f"\\u{c:04X}" if c < 0x10000 else f"\\U{c:08X}"


def _json_class(pattern: str, i: int) -> tuple[str, int]:
    """A character class at ``pattern[i]`` (``[``) for a JSON string, and where it ends: a
    positive class less what JSON writes escaped (a narrower class: what it writes still
    matches), a negated one with those added to what it leaves out."""
    j, n = i + 1, len(pattern)
    negated = j < n and pattern[j] == "^"
    j += 1 if negated else 0
    ranges: list[tuple[int, int]] = []
    first = True
    while j < n and (pattern[j] != "]" or first):
        first = False
        if pattern[j] == "\\" and j + 1 < n and pattern[j + 1] in _CLASS_RANGES:
            ranges += _CLASS_RANGES[pattern[j + 1]]
            j += 2
            continue
        if pattern[j] == "\\" and j + 1 < n and pattern[j + 1] in "DWS":
            raise _refuse_escape(pattern[j + 1])
        lo, step = _escaped_char(pattern, j) if pattern[j] == "\\" else (ord(pattern[j]), 1)
        j += step
        hi = lo
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] != "]":
            hi, step = _escaped_char(pattern, j + 1) if pattern[j + 1] == "\\" else (ord(pattern[j + 1]), 1)
            j += 1 + step
        ranges.append((lo, hi))
    if j >= n:
        raise GrammarRefused("the pattern has a character class without its ']'", "pattern")
    body = "".join(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in
                   (ranges if negated else _less_unsafe(ranges)))  # fmt: skip
    if negated:
        return f"[^{JSON_UNSAFE}{body}]", j + 1
    if not body:
        raise GrammarRefused("the pattern's character class holds only characters JSON writes escaped", "pattern")
    return f"[{body}]", j + 1


def _json_pattern(pattern: str) -> str:
    """A string ``pattern`` rewritten for the converter, which copies literals and classes into
    the grammar as they are, inside a JSON string:
    - a quote, a backslash and the control characters are matched as JSON writes them,
      escaped, each as a group so that a quantifier after it takes the whole escape (``a\\\\b``
      wrote a raw backslash, which JSON read as a backspace; a quote ended the string);
    - a character class leaves those out (a positive one: narrower, what it writes still
      matches), as does ``.`` (``JSON_DOT``); ``\\d``, ``\\w``, ``\\s`` (and their negations) are
      classes, and an escaped character is itself (``\\.``, ``\\$``, ``\\x41``): llama.cpp's
      grammar parser refused them (pydantic writes ``\\d`` for digits);
    - an escape that is not a character (``\\b``, ``\\p{L}``) is refused (``GrammarRefused``);
    - the body between the anchors is one group (``^a|b$`` wrote ``"a | b"`` without it, so
      the closing quote went with ``b`` only: invalid JSON), and an anchor inside it is refused."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n and pattern[i + 1].lower() in _CLASS_BODIES:
            e = pattern[i + 1]
            body = _CLASS_BODIES[e.lower()]
            out.append(f"[^{JSON_UNSAFE}{body}]" if e.isupper() else f"[{body}]")
            i += 2
        elif c == "\\" and i + 1 < n and pattern[i + 1] in _SPECIAL:
            out.append(pattern[i : i + 2])
            i += 2
        elif c == "\\":
            code, step = _escaped_char(pattern, i)
            out.append(_json_char(code))
            i += step
        elif c == "[":
            cls, i = _json_class(pattern, i)
            out.append(cls)
        elif c == '"' or ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(_json_char(ord(c)))
            i += 1
        elif c in "^$" and not (c == "^" and i == 0) and not (c == "$" and i == n - 1):
            raise GrammarRefused("a 'pattern' can be enforced with '^' and '$' only at its start and end")
        else:
            out.append(c)
            i += 1
    text = "".join(out)
    if len(text) >= 2 and text[0] == "^" and text[-1] == "$":  # one group: a top-level | stays inside the quotes
        return f"^({text[1:-1]})$"
    return text


def _number(schema: dict[str, Any], key: str) -> int | float | None:
    """The keyword's value when it is a number (not a boolean), else None."""
    v = schema.get(key)
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def integer_bounds(schema: dict[str, Any]) -> tuple[int, int] | None:
    """The inclusive range an integer schema's bound keywords allow (draft 4's boolean
    ``exclusiveMinimum``/``exclusiveMaximum`` and the later numeric ones), or None when it
    has none. ``GrammarRefused`` (its path: the keyword) when a bound is not a number or no
    integer meets them."""
    if not any(k in schema for k in INT_BOUND_KEYS):
        return None
    for key in INT_BOUND_KEYS:
        draft4 = key.startswith("exclusive") and isinstance(schema.get(key), bool)
        if key in schema and _number(schema, key) is None and not draft4:
            raise GrammarRefused(f"'{key}' must be a number", key)
    lo, hi = -NO_INT_BOUND, NO_INT_BOUND
    if (low := _number(schema, "minimum")) is not None:
        lo = math.floor(low) + 1 if schema.get("exclusiveMinimum") is True else math.ceil(low)
    if (ex_low := _number(schema, "exclusiveMinimum")) is not None:
        lo = max(lo, math.floor(ex_low) + 1)
    if (high := _number(schema, "maximum")) is not None:
        hi = math.ceil(high) - 1 if schema.get("exclusiveMaximum") is True else math.floor(high)
    if (ex_high := _number(schema, "exclusiveMaximum")) is not None:
        hi = min(hi, math.ceil(ex_high) - 1)
    if lo > hi:
        keys = ("maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum")
        named = next(k for k in keys if _number(schema, k) is not None)
        raise GrammarRefused(f"no integer is within the bounds ({lo} > {hi})", named)
    return lo, hi


def _converter() -> Any:
    """llama-cpp-python's converter with spillover's string characters and integer ranges
    (its module is untyped)."""
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class _Converter(SchemaConverter):
        def _add_primitive(self, name: str, rule: Any) -> Any:
            if name == "char":
                rule = type(rule)(JSON_CHAR, [])
            return super()._add_primitive(name, rule)

        def _format_literal(self, literal: str) -> str:
            # every character as itself: a backslash too (a constant's or a property name's JSON
            # text, ``"a\\\\b"``, wrote one backslash, which JSON read as a backspace; a quote
            # inside one broke the grammar), and the control characters by their code
            return '"' + "".join(_LITERAL_ESCAPES.get(ch) or ch for ch in literal) + '"'

        def _add_rule(self, name: str, rule: str) -> Any:
            return super()._add_rule(name, JSON_DOT if name == "dot" else rule)  # type: ignore[no-untyped-call]

        def _visit_pattern(self, pattern: str, name: str) -> Any:
            return super()._visit_pattern(_json_pattern(pattern), name)  # type: ignore[no-untyped-call]

        def visit(self, schema: Any, name: str) -> Any:
            plain = isinstance(schema, dict) and OTHER_FORMS.isdisjoint(schema)
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            if plain and isinstance(schema.get("type"), list):  # each type keeps the other keywords
                union = self._generate_union_rule(name, [{**schema, "type": t} for t in schema["type"]])  # type: ignore[no-untyped-call]
                return self._add_rule(rule_name, union)
            bounds = integer_bounds(schema) if plain and schema.get("type") == "integer" else None
            if bounds is None:
                return super().visit(schema, name)  # type: ignore[no-untyped-call]
            return self._add_rule(rule_name, f"({integer_range(*bounds)}) space")

    return _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)  # type: ignore[no-untyped-call]


def _to_gbnf(schema: dict[str, Any]) -> str:
    """As llama-cpp-python's ``json_schema_to_gbnf``, with ``_converter``'s rules."""
    converter = _converter()
    resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "stdin")
    converter.visit(resolved, "")
    return str(converter.format_grammar())


def schema_to_grammar(schema: dict[str, Any], *, max_bytes: int, max_repeat: int) -> str:
    """The GBNF grammar for ``schema``, or ``GrammarRefused`` (rules 1-3)."""
    _check(schema, "", 0, max_repeat)
    try:
        schema = normalised(schema)
        bad = unenforced(schema)
    except RecursionError as exc:  # a default, const or example nested past Python's stack
        raise GrammarRefused("the schema nests too deeply to convert") from exc
    if bad is not None:
        path, why = bad
        raise GrammarRefused(why, path)
    try:
        grammar = _to_gbnf(schema)
    except GrammarRefused:
        raise
    except RecursionError as exc:
        raise GrammarRefused("the schema nests too deeply to convert") from exc
    except Exception as exc:  # the converter asserts on what it does not support
        raise GrammarRefused(f"the schema cannot be turned into an output grammar: {exc}") from exc
    if len(grammar) > max_bytes:
        raise GrammarRefused(
            f"the schema compiles to a {len(grammar)}-byte grammar; this server allows at most {max_bytes}"
        )
    nesting = _max_nesting(grammar)
    if nesting > max_repeat:
        raise GrammarRefused(f"the schema compiles to a grammar nested {nesting} deep; at most {max_repeat}")
    return grammar
