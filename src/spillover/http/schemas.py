"""Validation of OpenAI-shaped request bodies into frozen values.

Bad input raises ``InvalidRequest`` with ``param`` naming the field; nothing invalid
gets past this module (and so nothing invalid is ever queued or journaled).
"""

from __future__ import annotations

import json
from typing import Any

from spillover.engine.grammar import MAX_SCHEMA_DEPTH
from spillover.errors import InvalidRequest
from spillover.http.fields import check_fields, stored
from spillover.runtime.prepare import GenerationRequest

__all__ = ["MAX_TOKENS", "parse_chat", "parse_completion", "positive_ms", "stored_body"]

MAX_STOPS = 4
MAX_TOKENS = 1 << 20  # the largest max_tokens asked (no context is longer)
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_DEADLINE_MS = 86_400_000  # a day: longer "deadlines" are not deadlines

MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's own limit)
MAX_TOP_LOGPROBS = 20


def stored_body(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The part of a validated body that is journaled: the fields this gateway reads."""
    return stored(body, kind)


def positive_ms(v: Any, name: str) -> int | None:
    """A positive whole number of milliseconds (at most a day), or None when absent."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DEADLINE_MS:
        raise InvalidRequest(f"'{name}' must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS}", param=name)
    return v


def _only(obj: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    """A 400 naming the first key of ``obj`` (found at ``where``) outside ``allowed``: nothing a
    client sends is silently dropped, inside an object either (a typo such as ``paramters`` or
    ``alow_shrink`` was answered as if it had not been sent)."""
    for key, value in obj.items():
        if key not in allowed and value is not None:  # null is absent, as everywhere here
            raise InvalidRequest(
                f"unknown field '{where}.{key}': this server does not ignore what it does not understand",
                param=f"{where}.{key}",
            )


SPILLOVER_FIELDS = frozenset({"allow_shrink", "prefer", "deadline_ms"})
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
RESPONSE_FORMAT_FIELDS = frozenset({"type", "json_schema"})
JSON_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})
# A message's fields by role. An assistant message an SDK echoes back from an answer carries
# ``refusal``, ``annotations``, ``audio`` and ``function_call``: taken when empty (null, []);
# and openai-python's ``parse()`` answers ``parsed``, a copy of ``content`` (taken, unread).
MESSAGE_FIELDS = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset(
        {"role", "content", "name", "tool_calls", "refusal", "annotations", "audio", "function_call", "parsed"}
    ),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}
# A text part's fields; ``cache_control`` (Anthropic's prompt-cache hint, which clients such as
# Cline send to any OpenAI-compatible server) is taken and does nothing: there is no prompt cache.
TEXT_PART_FIELDS = frozenset({"type", "text", "cache_control"})
ECHOED_EMPTY = ("refusal", "annotations", "audio", "function_call")


def _num(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    if not lo <= v <= hi:  # int vs float compares exactly: no float() of a huge int
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}", param=name)
    return float(v)


def _int_opt(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{name}' must be an integer", param=name)
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}", param=name)
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v):
        raise InvalidRequest(
            f"'stop' must be a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of them",
            param="stop",
        )
    if len(v) > MAX_STOPS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOPS} sequences", param="stop")
    return tuple(v)


def _common(body: dict[str, Any], default_model: str) -> dict[str, Any]:
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    n = body.get("n", 1)
    if n != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    so = body.get("stream_options")
    so = {} if so is None else so  # null is absent; [], "" or 0 are not an object: 400
    if not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    if so and not stream:  # as OpenAI answers it
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(so.get("include_usage", False), bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    ext = body.get("spillover")
    ext = {} if ext is None else ext
    if not isinstance(ext, dict):
        raise InvalidRequest("'spillover' must be an object", param="spillover")
    _only(ext, SPILLOVER_FIELDS, "spillover")
    allow_shrink = ext.get("allow_shrink")
    if allow_shrink is not None and not isinstance(allow_shrink, bool):
        raise InvalidRequest("'spillover.allow_shrink' must be a boolean", param="spillover.allow_shrink")
    prefer = ext.get("prefer", "auto")
    if prefer not in ("auto", "cpu"):
        raise InvalidRequest("'spillover.prefer' must be 'auto' or 'cpu'", param="spillover.prefer")
    deadline_ms = positive_ms(ext.get("deadline_ms"), "spillover.deadline_ms")
    max_tokens = _int_opt(body, "max_completion_tokens", 1, MAX_TOKENS)
    older = _int_opt(body, "max_tokens", 1, MAX_TOKENS)
    if max_tokens is None:
        max_tokens = older
    elif older is not None and older != max_tokens:
        raise InvalidRequest(
            f"'max_tokens' ({older}) and 'max_completion_tokens' ({max_tokens}) disagree: send one of them",
            param="max_tokens",
        )
    user = body.get("user")
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # labels and hints: strings
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequest(f"'{name}' must be a string", param=name)
    if not isinstance(so.get("include_obfuscation", False), bool) or so.get("include_obfuscation"):
        raise InvalidRequest(
            "'stream_options.include_obfuscation' is not supported (no padding is added)",
            param="stream_options.include_obfuscation",
        )
    _only(so, STREAM_OPTIONS, "stream_options")
    return {
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 0.0, 1.0),
        "seed": _int_opt(body, "seed", -(1 << 63), (1 << 63) - 1),
        "stop": _stops(body),
        "include_usage": so.get("include_usage", False),
        "allow_shrink": allow_shrink,
        "prefer_cpu": prefer == "cpu",
        "deadline_ms": deadline_ms,
        "user": user if isinstance(user, str) else None,
        "frequency_penalty": _num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "presence_penalty": _num(body, "presence_penalty", 0.0, -2.0, 2.0),
        "repeat_penalty": _num(body, "repeat_penalty", 1.0, 0.0, 10.0),
        "top_k": _int_opt(body, "top_k", 0, 1_000_000) or 0,
        "min_p": _num(body, "min_p", 0.0, 0.0, 1.0),
        "logit_bias": _logit_bias(body),
    }


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` with biases from -100 to 100 (token ids are checked against the
    model's vocabulary when the request is prepared)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to biases", param="logit_bias")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9):
            raise InvalidRequest(f"logit_bias key {k!r} is not a token id", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise InvalidRequest(f"logit_bias[{k}] must be a number from -100 to 100", param="logit_bias")
        out.append((int(k), float(b)))
    return tuple(out)


def _chat_logprobs(body: dict[str, Any]) -> int:
    """``logprobs`` (bool) and ``top_logprobs`` (0-20) as one number: -1 none, else N."""
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise InvalidRequest("'logprobs' must be a boolean", param="logprobs")
    top = _int_opt(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not lp:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if lp else -1


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """``response_format``: None for text, else ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "schema": {...}}`` (the schema is bounded when prepared)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", param="response_format"
        )
    _only(rf, RESPONSE_FORMAT_FIELDS if rf["type"] == "json_schema" else frozenset({"type"}), "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"type": "json_object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise InvalidRequest("'json_schema' needs a 'name' and a 'schema'", param="response_format.json_schema")
    _only(js, JSON_SCHEMA_FIELDS, "response_format.json_schema")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise InvalidRequest("'description' must be a string", param="response_format.json_schema.description")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequest("'schema' must be a JSON schema object", param="response_format.json_schema.schema")
    if not isinstance(js.get("strict", False), bool | None):
        raise InvalidRequest("'strict' must be a boolean", param="response_format.json_schema.strict")
    return {"type": "json_schema", "schema": schema}


def _content(m: dict[str, Any], i: int) -> str | None:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise InvalidRequest("only text content parts are supported", param=f"messages[{i}].content")
            _only(p, TEXT_PART_FIELDS, f"messages[{i}].content[{j}]")
            parts.append(p["text"])
        return "".join(parts)
    raise InvalidRequest("'content' must be a string or a list of text parts", param=f"messages[{i}].content")


def _assistant_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: each ``{"function": {"name": str, "arguments": str}}``."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequest("'tool_calls' must be an array", param=where)
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest("each tool call needs a 'function' object with a 'name'", param=f"{where}[{j}]")
        # ``index`` and ``parsed_arguments``: what openai-python's stream and parse() helpers keep
        _only(c, frozenset({"id", "type", "function", "index"}), f"{where}[{j}]")
        _only(fn, frozenset({"name", "arguments", "parsed_arguments"}), f"{where}[{j}].function")
        if not isinstance(fn.get("arguments", ""), str):
            raise InvalidRequest("'arguments' must be a JSON string", param=f"{where}[{j}].function.arguments")
    return calls


def _messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    if len(msgs) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InvalidRequest("each message must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in MESSAGE_FIELDS:
            raise InvalidRequest(f"unknown role {role!r}", param=f"messages[{i}].role")
        _only(m, MESSAGE_FIELDS[role], f"messages[{i}]")
        for key in ECHOED_EMPTY:
            if m.get(key) not in (None, [], ""):
                raise InvalidRequest(
                    f"an assistant message's '{key}' is not supported (only empty, as an answer echoes it back)",
                    param=f"messages[{i}].{key}",
                )
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        if m.get("name") is not None:  # the template decides what a name does (SmolLM2's drops it)
            if not isinstance(m["name"], str) or not m["name"]:
                raise InvalidRequest("'name' must be a non-empty string", param=f"messages[{i}].name")
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            calls = _assistant_tool_calls(m["tool_calls"], i)
            msg["tool_calls"] = calls
            if msg["content"] is None:
                msg["content"] = "".join(
                    json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) for c in calls
                )
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise InvalidRequest("tool messages need 'tool_call_id'", param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if msg["content"] is None:
            if role != "assistant":
                raise InvalidRequest("'content' is required", param=f"messages[{i}].content")
            msg["content"] = ""
        out.append(msg)
    return tuple(out)


# The deepest JSON a tool's ``parameters`` may nest: a schema's levels (``engine.grammar``'s
# bound on a forced one) are two JSON levels each, an object in ``properties``. Deeper, rendering
# it into the prompt ran out of Python's stack: a 500 in place of the client's 400.
MAX_TOOL_JSON_DEPTH = 2 * MAX_SCHEMA_DEPTH


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value``'s JSON has more than ``limit`` levels of objects and arrays inside it
    (no recursion)."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [
            c
            for v in level
            for c in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
            if isinstance(c, dict | list)
        ]
        if not level:
            return False
    return True


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str | None]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return (), None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("'tools' must be a non-empty array", param="tools")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequest("each tool must be {'type': 'function', 'function': {...}}", param=f"tools[{i}]")
        _only(t, TOOL_FIELDS, f"tools[{i}]")
        _only(fn, FUNCTION_FIELDS, f"tools[{i}].function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest("a function needs a 'name'", param=f"tools[{i}].function.name")
        if fn["name"] in names:
            raise InvalidRequest(
                f"two tools are named {fn['name']!r}: a call could not say which", param=f"tools[{i}].function.name"
            )
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidRequest("'description' must be a string", param=f"tools[{i}].function.description")
        if not isinstance(fn.get("strict", False), bool | None):
            raise InvalidRequest("'strict' must be a boolean", param=f"tools[{i}].function.strict")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest("'parameters' must be a JSON schema object", param=f"tools[{i}].function.parameters")
        if _nests_deeper(params, MAX_TOOL_JSON_DEPTH):
            raise InvalidRequest(
                f"'parameters' nests deeper than {MAX_TOOL_JSON_DEPTH} levels", param=f"tools[{i}].function.parameters"
            )
        names.add(fn["name"])
    forced: str | None = None
    if choice in (None, "auto", "none"):
        forced = None
    elif choice == "required":
        forced = "*"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        _only(choice, TOOL_FIELDS, "tool_choice")
        if isinstance(fn, dict):
            _only(fn, frozenset({"name"}), "tool_choice.function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
            raise InvalidRequest(f"tool_choice names unknown function {name!r}", param="tool_choice")
        forced = name
    else:
        raise InvalidRequest("'tool_choice' must be none, auto, required or a named function", param="tool_choice")
    return tuple(tools), forced


def parse_chat(body: Any, default_model: str, ignored: tuple[str, ...] = ()) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    check_fields(body, "chat", ignored)
    common = _common(body, default_model)
    tools, forced = _tools(body)
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    response_format = _response_format(body)
    if response_format is not None and forced is not None:
        raise InvalidRequest(
            "'response_format' cannot be combined with a forced tool call (the call's arguments follow its schema)",
            param="response_format",
        )
    return GenerationRequest(
        kind="chat",
        messages=_messages(body),
        tools=tools,
        forced_tool=forced,
        tools_unused=body.get("tool_choice") == "none",
        logprobs=_chat_logprobs(body),
        response_format=response_format,
        **common,
    )


def parse_completion(body: Any, default_model: str, ignored: tuple[str, ...] = ()) -> GenerationRequest:
    """Validate a /v1/completions body."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    check_fields(body, "text", ignored)
    common = _common(body, default_model)
    common["logprobs"] = _int_opt(body, "logprobs", 0, 5)
    if common["logprobs"] is None:
        common["logprobs"] = -1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string (batches are not supported)", param="prompt")
    return GenerationRequest(kind="text", prompt=prompt, **common)
