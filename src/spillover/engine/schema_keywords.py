"""Which of a JSON schema's keywords the output grammar enforces, so that none is silently not.

llama-cpp-python's converter (``engine.grammar``) takes one form per schema object, in its
order, and drops the other keywords of that object without a word: ``{"type": "string",
"const": 5}`` forced ``5``; ``minItems`` beside a fixed tuple, ``uniqueItems``,
``minProperties``, ``patternProperties``, ``if``/``then``, ``not``, a ``number``'s bounds,
and ``allOf`` of anything but objects were answered as if absent, with ``finish_reason:
stop`` on an answer that broke the client's schema. Rules:

1. Each schema object is read as the converter reads it (``_form``): a ``$ref``; a union
   (``oneOf``, else ``anyOf``); a list of types (each type with the object's other keywords,
   as ``engine.grammar``'s converter does); a ``const``; an ``enum``; an object with
   ``properties`` (or a closed or typed ``additionalProperties``); an object's ``allOf``; an
   array with ``items`` or ``prefixItems``; a string's ``pattern``, its ``format`` (``date``,
   ``time``, ``date-time``, ``uuid``, ``uuid1``..``uuid5``), its length; else a bare type.
   Each form enforces some keywords; a keyword of another type than the form's output
   (``minLength`` on an object) is vacuous, as JSON Schema itself says; any other assertion
   keyword is refused (400, naming it). Annotations (``title``, ``description``,
   ``default``, ``examples``, ...), ``format`` beyond those (an annotation in JSON Schema
   2020-12 unless a validator is asked to assert it) and keywords JSON Schema does not define
   are not assertions. Every schema object is read, the targets of local ``$ref``s wherever
   they are (``#/components/...``) too; each level once per type of its list (``unenforced``
   is linear in the schema). ``oneOf`` is enforced as ``anyOf``: an answer that matches two
   of its alternatives passes (a limit, not a refusal: pydantic's tagged unions cannot).
2. What no value meets is refused: an empty ``enum``, ``anyOf``, ``oneOf`` or ``allOf``, a
   ``const`` or ``enum`` value of another type than ``type``, a minimum above its maximum, a
   ``required`` name that ``additionalProperties: false`` forbids, an ``allOf`` of anything
   but object members (``$ref`` ones too), or whose members define one name twice.
3. ``normalised`` writes what the converter would misread as what it means: a ``required``
   name that an object's ``properties`` does not define is added to it as its
   ``additionalProperties`` schema, or any value (the converter dropped it, and
   ``{"required": ["a"]}`` gave ``{}``), a type list with ``object`` included; a type beside
   ``const``/``enum`` values that all are of it goes (the values are the answer; beside them
   a type list was read as the bare types); a one-member ``allOf`` beside annotations is its
   member (pydantic's ``{"allOf": [{"$ref": ...}], "description": ...}``); an empty
   sub-schema is any value (it was an object, and ``items: {}`` failed to convert); an
   object with ``properties`` and open ``additionalProperties`` is closed (the converter's
   extra keys could repeat a declared one with another type; the declared ones meet any).
"""

from __future__ import annotations

import copy
import re
from typing import Any

__all__ = ["ANY_VALUE", "normalised", "unenforced"]

STRING_KW = frozenset({"minLength", "maxLength", "pattern"})
NUMBER_KW = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
ARRAY_KW = frozenset(
    {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains",
     "additionalItems", "unevaluatedItems"}
)  # fmt: skip
OBJECT_KW = frozenset(
    {"properties", "required", "additionalProperties", "minProperties", "maxProperties", "patternProperties",
     "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties"}
)  # fmt: skip
ANY_KW = frozenset(
    {"type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
     "$recursiveRef"}
)  # fmt: skip
ASSERTIONS = STRING_KW | NUMBER_KW | ARRAY_KW | OBJECT_KW | ANY_KW
FORMS = frozenset({"$ref", "anyOf", "oneOf", "allOf", "const", "enum"})  # forms that are not an object's own
FAMILY = {"string": STRING_KW, "number": NUMBER_KW, "integer": NUMBER_KW, "array": ARRAY_KW, "object": OBJECT_KW}
FORMATS = ("date", "time", "date-time")  # what the converter writes a rule for, with uuid, uuid1..uuid5
# Any JSON value, as a type list the converter turns into a union of its primitives.
ANY_VALUE = {"type": ["string", "number", "boolean", "null", "object", "array"]}
_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}


def _enforced_format(fmt: Any) -> bool:
    """Whether the converter writes a rule for a string ``format`` (its own test)."""
    return isinstance(fmt, str) and (fmt in FORMATS or re.fullmatch(r"uuid[1-5]?", fmt) is not None)


def _is(value: Any, kind: Any) -> bool:
    """Whether ``value`` is of JSON type ``kind`` (a name or a list of names)."""
    if isinstance(kind, list):
        return any(_is(value, k) for k in kind)
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, _JSON_TYPES.get(kind, ()))


def _vacuous(output: str | None) -> frozenset[str]:
    """Keywords of other types than ``output`` (None: any): true of every value of it."""
    if output is None:
        return frozenset()
    own = FAMILY.get(output, frozenset())
    return (STRING_KW | NUMBER_KW | ARRAY_KW | OBJECT_KW) - own


def _form(node: dict[str, Any]) -> tuple[frozenset[str], str | None] | None:
    """The keywords the converter enforces on ``node`` and the type of what it writes (None:
    several); None for a plain type list (each type is read on its own)."""
    kind = node.get("type")
    plain = not {"$ref", "oneOf", "anyOf", "const", "enum"} & set(node)
    if "$ref" in node:
        return frozenset({"$ref"}), None
    if "oneOf" in node:
        return frozenset({"oneOf"}), None
    if "anyOf" in node:
        return frozenset({"anyOf"}), None
    if isinstance(kind, list):
        return None if plain else (frozenset({"type"}), None)
    if "const" in node or "enum" in node:
        return frozenset({"const", "enum", "type"}), None  # checked against each other in ``_values``
    if kind in (None, "object") and (
        "properties" in node or ("additionalProperties" in node and node["additionalProperties"] is not True)
    ):
        return frozenset({"type", "properties", "required", "additionalProperties"}), "object"
    if kind in (None, "object") and "allOf" in node:
        return frozenset({"type", "allOf"}), "object"
    if kind in (None, "array") and ("items" in node or "prefixItems" in node):
        items = node.get("items") or node.get("prefixItems")
        if isinstance(items, list):  # a tuple: exactly its items (draft 7's closing additionalItems too)
            return frozenset({"type", "items", "prefixItems", "minItems", "maxItems", "additionalItems"}), "array"
        return frozenset({"type", "items", "minItems", "maxItems"}), "array"
    if kind in (None, "string") and "pattern" in node:
        return frozenset({"type", "pattern"}), "string"
    if kind in (None, "string") and _enforced_format(node.get("format")):
        return frozenset({"type"}), "string"
    if kind == "string":
        return frozenset({"type", "minLength", "maxLength"}), "string"
    if kind == "object" or not node:
        return frozenset({"type", "additionalProperties"}), "object"
    if kind == "integer":
        return frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}), "integer"
    return frozenset({"type"}), kind if isinstance(kind, str) else None


def _why(node: dict[str, Any], key: str, form: frozenset[str]) -> str:
    if key in ("prefixItems", "minItems", "maxItems") and "items" not in form:
        return f"'{key}' cannot be enforced here; give 'items' (one schema for every item)"
    if key in NUMBER_KW:
        return f"'{key}' cannot be enforced by this server's output grammar (an integer's bounds can)"
    if "$ref" in form:
        return f"'{key}' beside '$ref' cannot be enforced; put it in the schema the reference points to"
    if {"oneOf", "anyOf"} & set(form):
        return f"'{key}' beside '{next(iter(form))}' cannot be enforced; put it inside each alternative"
    return f"'{key}' cannot be enforced by this server's output grammar"


def _values(node: dict[str, Any]) -> tuple[str, str] | None:
    """Rule 2 for ``const`` and ``enum``: (keyword, why) when no value can be written."""
    if "enum" in node:
        enum = node["enum"]
        if not isinstance(enum, list) or not enum:
            return "enum", "'enum' must list at least one value"
        if "const" in node and node["const"] not in enum:
            return "const", "'const' is not one of 'enum'"
    values = [node["const"]] if "const" in node else node.get("enum", [])
    if "type" in node:
        for v in values:
            if not _is(v, node["type"]):
                return "const" if "const" in node else "enum", f"{v!r} is not of type {node['type']!r}"
    return None


def _check_node(node: dict[str, Any], root: Any) -> tuple[str, str] | None:
    """(keyword, why) for the first keyword of one schema object that would go unenforced, or
    that no value meets; None when every keyword holds (``root``: where its refs point)."""
    for key in ("anyOf", "oneOf"):
        if key in node and (not isinstance(node[key], list) or not node[key]):
            return key, f"'{key}' must list at least one schema"
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):  # "ab" was {"a", "b"}
        return "required", "'required' must be a list of property names"
    for low, high in _PAIRS:
        lo, hi = node.get(low), node.get(high)
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            return low, f"'{low}' ({lo}) is above '{high}' ({hi}): no value meets both"
    if ("const" in node or "enum" in node) and (bad := _values(node)) is not None:
        return bad
    found = _form(node)
    if found is None:
        return None  # a plain type list: each type is checked as its own object (``unenforced``)
    form, output = found
    items = node.get("items") or node.get("prefixItems")  # as the converter takes them
    if "additionalItems" in node and isinstance(items, list) and node["additionalItems"] is not False:
        return "additionalItems", "'additionalItems' beside a tuple cannot be enforced (a tuple is exactly its items)"
    if isinstance(node.get("items"), list) and "prefixItems" in node:
        return "prefixItems", "'prefixItems' beside a list of 'items' cannot both be enforced; give one"
    if isinstance(node.get("items"), dict) and "prefixItems" in node:
        return "prefixItems", "'prefixItems' with 'items' (the items after them) cannot be enforced"
    if isinstance(items, list):
        n = len(items)
        lo, hi = node.get("minItems", 0), node.get("maxItems", n)
        for key, holds in (
            ("minItems", isinstance(lo, int) and lo <= n),
            ("maxItems", isinstance(hi, int) and hi >= n),
        ):
            if not holds:
                return key, f"'{key}' cannot be enforced beside a tuple of {n} items (a tuple is exactly its items)"
    if "allOf" in form and (bad := _all_of(node, root)) is not None:
        return bad
    allowed = form | _vacuous(output)
    for key in node:
        if key in ASSERTIONS and key not in allowed:
            return key, _why(node, key, form)
    if output == "object" and node.get("additionalProperties") is False:
        missing = [r for r in node.get("required", []) if r not in node.get("properties", {})]
        if missing:
            return "required", f"'required' names {missing[0]!r}, which 'additionalProperties': false forbids"
    return None


def _all_of(node: dict[str, Any], root: Any) -> tuple[str, str] | None:
    """The converter merges an ``allOf``'s members' properties (each one required; a member
    that is a ``$ref`` is the schema it points to): only members that are objects with
    properties, no name in two of them, are that."""
    members = node.get("allOf")
    if not isinstance(members, list) or not members:
        return "allOf", "'allOf' must list at least one schema"
    names: set[str] = set()
    for m in members:
        if isinstance(m, dict) and set(m) == {"$ref"}:
            m = _pointer(root, m["$ref"])
        if not isinstance(m, dict) or m.get("type", "object") != "object" or "properties" not in m:
            return "allOf", "'allOf' can be enforced only as objects with 'properties' (their properties merged)"
        if set(m) & ASSERTIONS - {"type", "properties", "required"}:
            return "allOf", "an 'allOf' member can hold only 'type', 'properties' and 'required'"
        props = m["properties"] if isinstance(m["properties"], dict) else {}
        if twice := names & set(props):
            return "allOf", f"'allOf' members both define {sorted(twice)[0]!r}: the answer would hold it twice"
        names |= set(props)
    return None


def _pointer(root: Any, ref: Any) -> Any:
    """What a local ``$ref`` (``#``, ``#/$defs/A``) points to in ``root``; None when it points
    nowhere, or elsewhere."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
    "additionalItems", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip


def _children(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    """The sub-schemas of one schema object, with their paths (values, defaults and examples
    are data, not schemas)."""
    out: list[tuple[Any, str]] = []
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += [(v, f"{path}.{key}.{name}") for name, v in node[key].items()]
    for key in _SCHEMA_LISTS + ("items",):
        if isinstance(node.get(key), list):
            out += [(v, f"{path}.{key}[{i}]") for i, v in enumerate(node[key])]
    for key in _SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            out.append((node[key], f"{path}.{key}"))
    return out


def unenforced(schema: Any, path: str = "") -> tuple[str, str] | None:
    """(path of the keyword, why) for the first keyword in ``schema`` the grammar would not
    enforce or no value meets (rules 1 and 2); None when all hold. Iterative: the depth is
    bounded before (``engine.grammar`` rule 1)."""
    todo: list[tuple[Any, str]] = [(schema, path)]
    pointed: set[str] = set()  # the refs whose targets are queued already
    while todo:
        node, where = todo.pop()
        if not isinstance(node, dict):
            continue
        plain_types = isinstance(node.get("type"), list) and _form(node) is None
        for each in [{**node, "type": t} for t in node["type"]] if plain_types else [node]:
            bad = _check_node(each, schema)
            if bad is not None:
                key, why = bad
                return f"{where}.{key}".lstrip("."), why
        todo += _children(node, where)  # once, whatever the types: a type list nests linearly
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in pointed:  # a target wherever it is (``#/components/...``)
            pointed.add(ref)
            todo.append((_pointer(schema, ref), ref.lstrip("#/").replace("/", ".")))
    return None


def normalised(schema: Any) -> Any:
    """A copy of ``schema`` the converter reads as JSON Schema means it (rule 3)."""
    out = copy.deepcopy(schema)
    todo: list[Any] = [out]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        one = node.get("allOf")
        alone = not (set(node) - {"allOf"}) & ASSERTIONS
        if (
            isinstance(one, list)
            and len(one) == 1
            and isinstance(one[0], dict)
            and alone
            and not set(one[0]) & set(node)
        ):
            del node["allOf"]
            node.update(one[0])
        values = [node["const"]] if "const" in node else node.get("enum")
        if isinstance(values, list) and "type" in node and all(_is(v, node["type"]) for v in values):
            del node["type"]  # the values are the answer: a type list beside them was read as bare types
        required = node.get("required")
        props = node.get("properties", {})
        extra = node.get("additionalProperties")
        kind = node.get("type", "object")
        objects = (kind == "object" or (isinstance(kind, list) and "object" in kind)) and not FORMS & node.keys()
        if isinstance(required, list) and objects and isinstance(props, dict):
            missing = [r for r in required if isinstance(r, str) and r not in props]
            if missing and extra is not False:
                node["properties"] = props | {
                    r: copy.deepcopy(extra) if isinstance(extra, dict) else dict(ANY_VALUE) for r in missing
                }
        if node.get("properties") and node.get("additionalProperties") not in (None, False) and objects:
            # The converter's extra keys may repeat a declared one with the extra schema's type
            # ({"a": 1, "a": "x"}: a parser keeps "x"); the declared properties alone meet any.
            del node["additionalProperties"]
        _any_for_empty(node)
        todo += [child for child, _ in _children(node, "")]
    return out


def _any_for_empty(node: dict[str, Any]) -> None:
    """A sub-schema with no assertion (``{}``; pydantic's ``Any`` is ``{"title": "A"}``; the
    ``items`` of ``list[Any]``) means any value; the converter wrote an object for ``{}``, and
    failed on the others (``items: {}`` is falsy: a KeyError; a title alone: "Unrecognized")."""

    def any_value(sub: Any) -> Any:
        return {**sub, **ANY_VALUE} if isinstance(sub, dict) and not sub.keys() & ASSERTIONS else sub

    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = any_value(node[key])
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            node[key] = {name: any_value(sub) for name, sub in node[key].items()}
    for key in ("prefixItems", "anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            node[key] = [any_value(sub) for sub in node[key]]
