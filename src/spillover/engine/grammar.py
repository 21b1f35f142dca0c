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
3. The grammar must be at most ``max_bytes`` long and nest parentheses at most
   ``max_repeat`` deep.

A refusal is a ``GrammarRefused`` naming the schema path; the gateway answers 400.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_SCHEMA_DEPTH", "GrammarRefused", "schema_to_grammar"]

MAX_SCHEMA_DEPTH = 32
REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
INT_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_INT_BOUND = 10**18


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
    for key in INT_BOUND_KEYS:
        v = node.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_BOUND:
            raise GrammarRefused(f"'{key}' is out of range (at most 18 digits)", f"{path}.{key}".lstrip("."))
    for key, value in node.items():
        if isinstance(value, dict | list):
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


def schema_to_grammar(schema: dict[str, Any], *, max_bytes: int, max_repeat: int) -> str:
    """The GBNF grammar for ``schema``, or ``GrammarRefused`` (rules 1-3)."""
    _check(schema, "", 0, max_repeat)
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        grammar: str = json_schema_to_gbnf(json.dumps(schema))
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
