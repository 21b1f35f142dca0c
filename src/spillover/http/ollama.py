"""Ollama's API on the same port, over the same request service.

``/api/chat`` and ``/api/generate`` are translated into the OpenAI-shaped request the
service already validates (so the journal, Idempotency-Key, failover, lanes and degraded
flags all hold), and answered as Ollama answers: NDJSON lines (``stream`` defaults to true)
or one JSON object, errors as ``{"error": "..."}``. ``/api/tags``, ``/api/ps``,
``/api/show`` and ``/api/version`` describe what spillover serves, and where.

Rules:

1. Sampling options are honoured (``temperature``, ``top_p``, ``top_k``, ``min_p``,
   ``seed``, ``stop``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``,
   ``num_predict``), with Ollama's defaults where the request gives none (``null`` is none).
   ``num_ctx`` limits prompt + output (it cannot grow a lane's context). A generation stops
   when its context is full, as Ollama's does: ``num_predict`` is cut to the room the prompt
   leaves (reported ``shrunk`` when the lanes' context, not ``num_ctx``, cut it), and
   shrink-to-fit is on.
2. Options that place or load a model (``num_gpu``, ``num_thread``, ``use_mmap``, ...) are
   refused: spillover decides placement. ``keep_alive`` is accepted: the model stays loaded
   while spillover runs, and the pressure ladder, not the client, moves it.
3. Anything else unknown is a 400 naming it, a message's own keys too. Sampling options Ollama
   clients send at the value that asks for what spillover does anyway are accepted
   (``NO_OP_OPTIONS``: ``mirostat`` 0, ``typical_p`` 1, ``tfs_z`` 1, ``repeat_last_n`` 64,
   ``penalize_newline`` true; ``mirostat_tau`` and ``mirostat_eta`` while mirostat is off),
   another value is a 400; so is ``num_keep`` accepted, since the context never shifts here (a
   generation stops when it is full); an option sent as null is not given, whatever its name.
   ``raw`` takes no ``system``, as Ollama's refuses it. A message takes Ollama's keys and
   OpenAI's ``name`` and a tool message's ``tool_call_id`` (``MESSAGE_FIELDS``).
4. Every answer carries the ``X-Spillover-*`` headers; the last line (or the one object) has
   a ``spillover`` object (route, degraded, reason).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
import time
from typing import Any

from spillover.errors import InvalidRequest, SpilloverError, to_http
from spillover.http.openai import AnswerShapes, logprob_entry
from spillover.http.schemas import MAX_TOKENS, parse_chat, parse_completion
from spillover.runtime.executor import TokenOut
from spillover.runtime.prepare import GenerationRequest
from spillover.runtime.run import Encoded, Run

__all__ = [
    "NdjsonEncoding",
    "ollama_error_body",
    "ollama_param",
    "parse_ollama_chat",
    "parse_ollama_generate",
    "unloads",
]

NDJSON = "application/x-ndjson"
JSON = "application/json"
DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repeat_penalty": 1.1}  # Ollama's own
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty", "presence_penalty",
            "frequency_penalty")  # fmt: skip
PLACEMENT = frozenset(
    {"num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "numa", "low_vram", "vocab_only",
     "f16_kv", "logits_all", "embedding_only"}
)  # fmt: skip
# Rule 3: accepted at the value that asks for what spillover does anyway (llama-cpp-python's
# sampler: no mirostat, no typical or tail-free sampling, penalties over the last 64 tokens,
# newlines penalized as any token), with why another value is refused.
NO_OP_OPTIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "mirostat": ((0,), "mirostat sampling is not supported"),
    "typical_p": ((1, 1.0), "typical sampling is not supported"),
    "tfs_z": ((1, 1.0), "tail-free sampling is not supported"),
    "repeat_last_n": ((64,), "penalties look at the last 64 tokens"),
    "penalize_newline": ((True,), "newlines are penalized as any other token"),
}
MIROSTAT_TUNING = ("mirostat_tau", "mirostat_eta")  # any number while mirostat is off (rule 3)
CHAT_FIELDS = frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think",
                         "logprobs", "top_logprobs"})  # fmt: skip
GENERATE_FIELDS = frozenset({"model", "prompt", "suffix", "images", "format", "options", "system", "template",
                             "stream", "raw", "keep_alive", "context", "think", "logprobs",
                             "top_logprobs"})  # fmt: skip


# Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "-1s"; a bare number
# of seconds too). Nothing else, so that what the journal keeps of it stays small.
_DURATION = re.compile(r"[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h)?)+")


def _keep_alive_ok(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, int | float) and not isinstance(value, bool):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= 32 and _DURATION.fullmatch(value) is not None


def unloads(value: Any) -> bool:
    """Whether ``keep_alive`` asks to unload now (Ollama's unload request: 0, or under a second
    as a number, which Ollama truncates to whole seconds; "0", "0s", "0m0s")."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return 0 <= value < 1  # Ollama truncates a number of seconds to whole ones
    if isinstance(value, str) and _keep_alive_ok(value):
        return all(float(n) == 0 for n in re.findall(r"\d+(?:\.\d*)?|\.\d+", value))
    return False


# Ollama's own types for its flags and texts: a "yes" or a [] is Ollama's 400 ("cannot
# unmarshal"), not a truthy value read as true or an empty list read as "no options".
BOOLEANS = ("raw", "stream", "verbose", "truncate")
STRINGS = ("system", "suffix", "template")


def check_body(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """A 400 naming a field outside ``allowed``, a flag that is not a boolean, a text that is
    not a string, or ``options`` that is not an object (null is absent, as Ollama reads it)."""
    for name in body:
        if name not in allowed:
            raise InvalidRequest(f"unknown field '{name}'", param=name)
    for name in BOOLEANS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequest(f"'{name}' must be true or false", param=name)
    for name in STRINGS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequest(f"'{name}' must be a string", param=name)
    if body.get("options") is not None and not isinstance(body["options"], dict):
        raise InvalidRequest("'options' must be an object", param="options")


def _fields(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    check_body(body, allowed)
    if not _keep_alive_ok(body.get("keep_alive")):
        raise InvalidRequest(
            "'keep_alive' must be a number of seconds or a duration such as \"5m\" (it changes nothing here)",
            param="keep_alive",
        )
    if body.get("think"):
        raise InvalidRequest(
            "'think' is not supported: the served model does not think in separate steps", param="think"
        )
    return body


def _options(body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """OpenAI sampling fields from Ollama's ``options``, and the ``num_ctx`` limit (rules 1-3)."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise InvalidRequest("'options' must be an object", param="options")
    out: dict[str, Any] = dict(DEFAULTS)
    num_ctx = None
    mirostat_off = opts.get("mirostat") in (None, 0)
    for name, value in opts.items():
        if value is None:  # null: not given, as Ollama reads it (the ollama client sends them)
            continue
        if name in MIROSTAT_TUNING and mirostat_off:  # they tune mirostat, which is off: no effect (rule 3)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidRequest(f"'{name}' must be a number", param=f"options.{name}")
            continue
        if name in PLACEMENT:
            raise InvalidRequest(
                f"option '{name}' is not supported: spillover decides where the model runs", param=f"options.{name}"
            )
        if name not in SAMPLING and name not in ("num_predict", "num_ctx", "num_keep") and name not in NO_OP_OPTIONS:
            raise InvalidRequest(f"option '{name}' is not supported", param=f"options.{name}")
        if name in NO_OP_OPTIONS:
            allowed, why = NO_OP_OPTIONS[name]
            if isinstance(value, bool) is not isinstance(allowed[0], bool) or value not in allowed:
                raise InvalidRequest(
                    f"option '{name}'={value!r} is not supported: {why} (only {allowed[0]!r} is accepted)",
                    param=f"options.{name}",
                )
            continue
        if name == "num_keep":  # no effect: the context never shifts here (rule 3)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise InvalidRequest("'num_keep' must be -1 or a non-negative integer", param="options.num_keep")
            continue
        if name in SAMPLING:
            out[name] = value
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise InvalidRequest(
                    "'num_predict' must be -1 (no limit), -2 (fill the context) or positive",
                    param="options.num_predict",
                )
            if value > 0:  # past any context: it stops when its context is full (rule 1)
                out["max_tokens"] = min(value, MAX_TOKENS)
        elif name == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest("'num_ctx' must be a positive integer", param="options.num_ctx")
            num_ctx = value
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise InvalidRequest("'format' must be \"json\" or a JSON schema", param="format")
    if body.get("logprobs"):
        out["logprobs"] = True
        if body.get("top_logprobs") is not None:
            out["top_logprobs"] = body["top_logprobs"]
    out["stream"] = body.get("stream", True)
    out["spillover"] = {"allow_shrink": True}  # the output stops when the context is full (rule 1)
    return out, num_ctx


def _tool_call(c: Any, param: str, call_id: str) -> dict[str, Any]:
    """An earlier assistant turn's Ollama tool call as OpenAI's (a 400 naming it when it is
    not ``{"function": {"name": ..., "arguments": {...}}}``)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("each tool call must be {'function': {'name': ..., 'arguments': {...}}}", param=param)
    arguments = fn.get("arguments") or {}
    if not isinstance(arguments, dict | str):
        raise InvalidRequest("a tool call's 'arguments' must be an object", param=f"{param}.function.arguments")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": text}}


# A message's keys (rule 3): Ollama's, and two of OpenAI's that code written for it sends to
# /api/chat and that mean the same here: ``name`` (the speaker, given to the template as
# OpenAI's is) and a tool message's ``tool_call_id`` (its call, beside or for ``tool_name``).
MESSAGE_FIELDS = frozenset({"role", "content", "images", "tool_calls", "tool_name", "thinking", "name", "tool_call_id"})


def _message(m: Any, i: int) -> dict[str, Any]:
    """An Ollama chat message as OpenAI's: ``content`` a string (absent or null: empty, as
    Ollama reads it), and nothing else it carries dropped (rule 3)."""
    if not isinstance(m, dict):
        raise InvalidRequest("each message must be an object", param=f"messages[{i}]")
    for name in m:
        if name not in MESSAGE_FIELDS:
            raise InvalidRequest(f"unknown field '{name}' in a message", param=f"messages[{i}].{name}")
    if m.get("images"):
        raise InvalidRequest("images are not supported by the served model", param=f"messages[{i}].images")
    if m.get("thinking"):
        raise InvalidRequest(
            "'thinking' is not supported: the served model does not think in separate steps, and an earlier"
            " turn's thinking would not be shown to it; leave it out",
            param=f"messages[{i}].thinking",
        )
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise InvalidRequest("'content' must be a string", param=f"messages[{i}].content")
    out: dict[str, Any] = {"role": m.get("role"), "content": content or ""}
    if calls := m.get("tool_calls"):
        if not isinstance(calls, list):
            raise InvalidRequest("'tool_calls' must be an array", param=f"messages[{i}].tool_calls")
        param = f"messages[{i}].tool_calls"
        out["tool_calls"] = [_tool_call(c, f"{param}[{j}]", f"call_{i}_{j}") for j, c in enumerate(calls)]
    if m.get("name") is not None:
        out["name"] = m["name"]  # OpenAI's checks it (a string) and hands it to the template
    if m.get("role") == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequest("'tool_call_id' must be a string", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = str(m.get("tool_name") or call_id or "tool")
    elif m.get("tool_call_id") is not None:
        raise InvalidRequest("'tool_call_id' belongs to a tool message", param=f"messages[{i}].tool_call_id")
    return out


def parse_ollama_chat(body: Any, default_model: str) -> GenerationRequest:
    """``/api/chat`` as a validated request."""
    body = _fields(body, CHAT_FIELDS)
    fields, num_ctx = _options(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise InvalidRequest("'messages' must be an array", param="messages")
    openai = {"model": body.get("model"), "messages": [_message(m, i) for i, m in enumerate(msgs)], **fields}
    if body.get("tools"):
        openai["tools"] = body["tools"]
    return _with_ctx(parse_chat(openai, default_model), num_ctx)


def parse_ollama_generate(body: Any, default_model: str) -> GenerationRequest:
    """``/api/generate`` as a validated request: the model's chat template around ``prompt``
    (and ``system``), or the bare prompt with ``raw``."""
    body = _fields(body, GENERATE_FIELDS)
    for name in ("suffix", "images", "template", "context"):
        if body.get(name):
            raise InvalidRequest(f"'{name}' is not supported", param=name)
    fields, num_ctx = _options(body)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string", param="prompt")
    if body.get("raw"):
        if body.get("system"):  # as Ollama's: "raw mode does not support template, system, or context"
            raise InvalidRequest("'system' needs the chat template ('raw': false)", param="system")
        if fields.pop("response_format", None) is not None:
            raise InvalidRequest("'format' needs the chat template ('raw': false)", param="format")
        fields.pop("logprobs", None)
        fields.pop("top_logprobs", None)
        return _with_ctx(
            parse_completion({"model": body.get("model"), "prompt": prompt, **fields}, default_model), num_ctx
        )
    msgs = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + [
        {"role": "user", "content": prompt}
    ]
    return _with_ctx(parse_chat({"model": body.get("model"), "messages": msgs, **fields}, default_model), num_ctx)


def _with_ctx(req: GenerationRequest, num_ctx: int | None) -> GenerationRequest:
    """Ollama's context rule (rule 1): the output stops when the context (``num_ctx``, or the
    lanes' cap) is full; ``num_predict`` is never refused for the room it asks."""
    return dataclasses.replace(req, ctx_limit=num_ctx, stops_at_context=True)


# Where a request's fields sit in Ollama's body (``ollama_param``): the translated OpenAI request
# names them its own way.
_OPTION_PARAMS = {name: f"options.{name}" for name in SAMPLING} | {"max_tokens": "options.num_predict"}
# The route a request of another kind belongs on, in Ollama's API (``ENDPOINT_OF_KIND`` is OpenAI's).
_OLLAMA_ROUTES = {
    "send it to /v1/chat/completions": "send it to /api/chat",
    "send it to /v1/embeddings": "send it to /api/embed",
    "send a prompt to /v1/completions": 'send a prompt to /api/generate with "raw": true',
}


def ollama_param(param: str | None, *, generate: bool = False) -> str | None:
    """An error's ``param`` as the field of Ollama's body that it names: a sampling field is
    an option (``options.temperature``), ``max_tokens`` is ``options.num_predict``,
    ``response_format``'s schema is ``format``, and ``/api/generate``'s prompt is ``prompt``."""
    if param is None:
        return None
    if param in _OPTION_PARAMS:
        return _OPTION_PARAMS[param]
    for openai, ollama in (("response_format.json_schema.schema", "format"), ("response_format", "format")):
        if param == openai or param.startswith(openai + "."):
            return ollama + param[len(openai) :]
    if generate and (param == "messages" or param.startswith("messages[")):
        return "prompt"
    return param


def ollama_error_body(err: BaseException, *, generate: bool = False) -> dict[str, Any]:
    """Ollama's error shape; the machine-readable code stays with it, and the technical
    account (``detail``: a model load's failures, each worker's) where there is one. Any
    exception: one that is not a ``SpilloverError`` is an ``internal_error`` (``to_http``).
    ``param`` names the field of Ollama's body (``ollama_param``), and a model of another
    kind is sent to Ollama's route for it."""
    e = to_http(err).body["error"]
    detail = {"detail": e["detail"]} if "detail" in e else {}
    message = e["message"]
    if e["code"] == "model_not_supported":
        for openai, ollama in _OLLAMA_ROUTES.items():
            message = message.replace(openai, ollama)
    return {"error": message, "code": e["code"], "param": ollama_param(e["param"], generate=generate)} | detail


def created_at() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


class NdjsonEncoding(AnswerShapes):
    """Ollama's answer: NDJSON lines while it streams, else one object (rule 4)."""

    def __init__(self, run: Run, *, generate: bool) -> None:
        super().__init__(run)
        self.generate = generate
        self.stream = run.req.stream
        self.content_type = NDJSON if self.stream else JSON

    def _line(self, obj: dict[str, Any]) -> bytes:
        return (json.dumps(obj, separators=(",", ":")) + "\n").encode()

    def _part(self, text: str) -> dict[str, Any]:
        base = {"model": self.run.served_model(), "created_at": created_at()}
        if self.generate:
            return base | {"response": text}
        return base | {"message": {"role": "assistant", "content": text}}

    def opening(self) -> list[bytes]:
        return []

    def route_changed(self) -> list[bytes]:
        return []

    def token(self, token: TokenOut) -> list[bytes]:
        if not self.stream or not (token.text or token.logprob):
            return []
        obj = self._part(token.text) | {"done": False}
        if token.logprob is not None:
            obj["logprobs"] = _ollama_logprobs([token])
        return [self._line(obj)]

    def closing(self) -> Encoded:
        r = self.run
        now = time.monotonic()
        first = r.first_token_s or now
        extra = self.appended_notice()
        obj = self._part("" if self.stream else "".join(r.text) + extra) | {
            "done": True,
            "done_reason": r.finish_reason or "stop",
            "total_duration": int((now - r.started_s) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": r.prompt_tokens(),
            "prompt_eval_duration": int((first - r.started_s) * 1e9),
            "eval_count": r.completion_tokens,
            "eval_duration": int((now - first) * 1e9),
            "spillover": self.spillover_object(),
        }
        if not self.stream and r.req.logprobs >= 0:
            obj["logprobs"] = _ollama_logprobs(r.tokens)
        if not self.stream:
            return Encoded(200, [json.dumps(obj).encode()], self.headers(), self.content_type)
        lines = [self._line(self._part(extra) | {"done": False})] if extra else []
        return Encoded(200, [*lines, self._line(obj)], self.headers(), self.content_type)

    def error(self, err: SpilloverError, *, committed: bool) -> Encoded:
        e = to_http(err, self.run.rid)
        sp = self.spillover_object()
        if (refused_for := e.headers.get("X-Spillover-Estimated-Delay-Ms")) is not None:
            sp["estimated_delay_ms"] = int(refused_for)  # as the header says (round 66)
        body = ollama_error_body(err, generate=self.generate) | {"spillover": sp}
        if committed:
            return Encoded(200, [self._line(body)], self.headers(), NDJSON, e.body)
        return Encoded(e.status, [json.dumps(body).encode()], self.headers() | e.headers, JSON, e.body)


def _ollama_logprobs(tokens: list[TokenOut]) -> list[dict[str, Any]]:
    """Ollama's ``logprobs``: OpenAI's entries (its ``bytes`` are extra to Ollama's shape)."""
    return [logprob_entry(t.logprob, t.top) for t in tokens if t.logprob is not None]
