"""OpenAI's wire shapes for a run: a chat/text completion body, or its SSE chunk stream.

An ``Encoding`` (``runtime.requests``) only turns a run's state into bytes; the run owns
what happens and journals what these return. Every answer carries the ``spillover`` object
(route, degraded, reason, limits, attempts) in its body or in its first chunk and in every
route-change chunk, and the ``X-Spillover-*`` headers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from typing import Any

from spillover.errors import SpilloverError, to_http
from spillover.http.notice import notice
from spillover.http.routes import signal_headers
from spillover.runtime.events import TokenLogprob
from spillover.runtime.executor import TokenOut
from spillover.runtime.run import Encoded, Run

__all__ = ["AnswerShapes", "JsonEncoding", "SseEncoding", "encoding_for", "logprob_entry", "tool_call_id"]

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# A forced tool call cut off: its name (as the grammar writes it, first) and its arguments so far.
_PARTIAL_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\Z', re.DOTALL)


def tool_call_id(rid: str, index: int) -> str:
    """Stable tool-call id: derived from the request id, so a replay keeps it."""
    return "call_" + hashlib.sha256(f"{rid}:{index}".encode()).hexdigest()[:24]


def sse(obj: Any) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class AnswerShapes:
    """What both encodings share: the spillover object, headers, usage, tool calls, errors."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.chat = run.req.kind == "chat"

    def spillover_object(self) -> dict[str, Any]:
        r, i = self.run, self.run.info
        return {
            "request_id": r.rid,
            "route": i.route if i else "none",
            "degraded": r.degraded(),
            "reason": r.reason(),
            "model": r.served_model(),
            "fallback": r.on_fallback(),
            "limits": {"max_tokens": i.max_tokens if i else r.prep.max_tokens, "ctx": i.kv_tokens if i else None},
            "shrunk": bool(i and i.shrunk),
            "seed": r.prep.seed,  # the seed it sampled with (a fresh random one when none was asked)
            "attempts": r.exe.attempt,
            "queue_position": i.queue_position if i else 0,
            "estimated_delay_ms": i.estimated_delay_ms if i else 0,
            "notice": notice(r),  # a person's one-line status of a degraded answer (None: none)
        }

    def appended_notice(self) -> str:
        """The text added to a degraded answer's content with ``[server].degraded_notice``
        (never to a tool call or a JSON answer: those must still parse)."""
        r = self.run
        line = notice(r)
        if not line or not r.gw.cfg.server.degraded_notice or r.req.forced_tool or r.req.response_format:
            return ""
        return f"\n\n_({line})_"

    def headers(self) -> dict[str, str]:
        sp = self.spillover_object()
        h = signal_headers(sp) | {
            "X-Spillover-Queue-Position": str(sp["queue_position"]),
            "X-Spillover-Estimated-Delay-Ms": str(sp["estimated_delay_ms"]),
        }
        if (i := self.run.info) is not None:
            h["X-Spillover-Limits"] = f"max_tokens={i.max_tokens};ctx={i.kv_tokens}"
        return h

    def usage(self) -> dict[str, int]:
        n, c = self.run.prompt_tokens(), self.run.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": c, "total_tokens": n + c}

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """OpenAI ``tool_calls`` from the constrained output of a forced tool call. A call cut
        off before it was complete (``max_tokens``) comes as OpenAI gives one:
        the arguments as far as they came, and the run's own finish reason (``tool_finish``)."""
        if self.run.req.forced_tool is None:
            return None
        name, arguments, _ = self._tool_call()
        return [
            {
                "id": tool_call_id(self.run.rid, 0),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        ]

    def tool_finish(self) -> str:
        """A forced tool call's finish reason: ``tool_calls`` when it is whole, else the run's."""
        return "tool_calls" if self._tool_call()[2] else str(self.run.finish_reason)

    def _tool_call(self) -> tuple[str, str, bool]:
        """The forced call's function name, its arguments (JSON text) and whether it is whole."""
        text = "".join(self.run.text)
        try:
            obj = json.loads(text)
            return str(obj["name"]), json.dumps(obj["arguments"]), True
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
        forced = self.run.req.forced_tool or "*"
        names = [str(t["function"]["name"]) for t in self.run.req.tools]
        name = forced if forced != "*" else (names[0] if len(names) == 1 else "")
        if m := _PARTIAL_CALL.match(text):  # the grammar writes the name first, then the arguments
            with contextlib.suppress(json.JSONDecodeError):
                name = str(json.loads(f'"{m.group(1)}"'))
            return name, m.group(2), False
        return name, "", False

    def logprobs(self, tokens: list[TokenOut], offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of ``tokens``: chat's ``content`` list, or the completions
        API's parallel arrays (``text_offset`` counted from ``offset``); None when not asked."""
        if self.run.req.logprobs < 0:
            return None
        chosen = [t for t in tokens if t.logprob is not None]
        if self.chat:
            return {"content": [logprob_entry(t.logprob, t.top) for t in chosen if t.logprob], "refusal": None}
        offsets = []
        for t in chosen:
            offsets.append(offset)
            offset += len(t.logprob.token) if t.logprob else 0
        return {
            "tokens": [t.logprob.token for t in chosen if t.logprob],
            "token_logprobs": [t.logprob.logprob for t in chosen if t.logprob],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in chosen],
            "text_offset": offsets,
        }

    def json_error(self, err: SpilloverError) -> Encoded:
        """An error as a whole JSON answer (before any byte of the answer was sent)."""
        e = to_http(err, self.run.rid)
        return Encoded(e.status, [json.dumps(e.body).encode()], self.headers() | e.headers, JSON, e.body)


class JsonEncoding(AnswerShapes):
    """A non-stream answer: one ``chat.completion`` / ``text_completion`` body."""

    content_type = JSON

    def opening(self) -> list[bytes]:
        return []

    def route_changed(self) -> list[bytes]:
        return []

    def token(self, token: TokenOut) -> list[bytes]:
        return []

    def closing(self) -> Encoded:
        return Encoded(200, [json.dumps(self.body()).encode()], self.headers(), JSON)

    def error(self, err: SpilloverError, *, committed: bool) -> Encoded:
        return self.json_error(err)

    def body(self) -> dict[str, Any]:
        r = self.run
        text = "".join(r.text) + self.appended_notice()
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = r.finish_reason
            calls = self.tool_calls()
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = self.tool_finish()
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(r.tokens), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(r.tokens), "finish_reason": r.finish_reason}
        fp = r.fingerprint()
        return {
            "id": f"chatcmpl-{r.rid}" if self.chat else f"cmpl-{r.rid}",
            "object": "chat.completion" if self.chat else "text_completion",
            "created": r.created_s,
            "model": r.served_model(),
            "system_fingerprint": f"fp_{fp}" if fp else None,
            "choices": [choice],
            "usage": self.usage(),
            "spillover": self.spillover_object(),
        }


class SseEncoding(AnswerShapes):
    """A stream: a first chunk with the spillover object, tokens, a route-change chunk
    whenever the route changes, the end (or a typed error event), ``[DONE]``. A forced tool
    call is buffered and sent whole at the end (it must parse)."""

    content_type = EVENT_STREAM

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.buffer_tools = self.chat and run.req.forced_tool is not None
        self.offset = 0  # text_offset of the next token (completions logprobs)
        self._text_frame: tuple[str, bytes, bytes] | None = None  # (model, head, tail): ``_text``

    def _text(self, text: str) -> bytes:
        """``chunk`` for a plain text token, byte for byte, without building the chunk: the
        bytes around the text are made once per served model (once per stream, in practice)."""
        model = self.run.served_model()
        if self._text_frame is None or self._text_frame[0] != model:
            mark = "\u0000"  # any text: its JSON form is found from the end of the chunk
            whole = self.chunk({"content": mark} if self.chat else mark)
            head, _, tail = whole.rpartition(json.dumps(mark).encode())  # the text is the last string
            self._text_frame = (model, head, tail)
        _, head, tail = self._text_frame
        return head + json.dumps(text).encode() + tail

    def frame(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        r = self.run
        return sse(
            {
                "id": f"chatcmpl-{r.rid}" if self.chat else f"cmpl-{r.rid}",
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": r.created_s,
                "model": r.served_model(),
                "choices": choices,
                **extra,
            }
        )

    def chunk(
        self, delta: dict[str, Any] | str, finish: str | None = None, logprobs: Any = None, **extra: Any
    ) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        choice["delta" if self.chat else "text"] = delta
        return self.frame([choice], **extra)

    def _empty(self) -> dict[str, Any] | str:
        return {} if self.chat else ""

    def opening(self) -> list[bytes]:
        first = {"role": "assistant", "content": ""} if self.chat else ""
        return [self.chunk(first, spillover=self.spillover_object())]

    def route_changed(self) -> list[bytes]:
        return [self.chunk(self._empty(), spillover=self.spillover_object())]

    def token(self, token: TokenOut) -> list[bytes]:
        if self.buffer_tools or not (token.text or token.logprob):
            return []
        if token.logprob is None:
            return [self._text(token.text)]
        lp = self.logprobs([token], self.offset)
        self.offset += len(token.logprob.token)
        return [self.chunk({"content": token.text} if self.chat else token.text, logprobs=lp)]

    def closing(self) -> Encoded:
        frames = []
        finish = self.run.finish_reason
        if self.buffer_tools:
            calls = self.tool_calls() or []
            frames.append(self.chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}))
            finish = self.tool_finish()
        if extra := self.appended_notice():
            frames.append(self.chunk({"content": extra} if self.chat else extra))
        frames.append(self.chunk(self._empty(), finish))
        if self.run.req.include_usage:
            frames.append(self.frame([], usage=self.usage()))
        return Encoded(200, [*frames, DONE], self.headers() | {"Cache-Control": "no-cache"}, EVENT_STREAM)

    def error(self, err: SpilloverError, *, committed: bool) -> Encoded:
        if not committed:
            return self.json_error(err)
        body = to_http(err, self.run.rid).body
        body["error"]["tokens_delivered"] = self.run.exe.sent_tokens()
        return Encoded(200, [sse(body), DONE], self.headers() | {"Cache-Control": "no-cache"}, EVENT_STREAM, body)


def encoding_for(run: Run) -> JsonEncoding | SseEncoding:
    """The encoding of a run's answer: SSE when it streams, else one JSON body."""
    return SseEncoding(run) if run.req.stream else JsonEncoding(run)


def logprob_entry(lp: TokenLogprob, top: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """One token of chat's ``logprobs.content``."""
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in top],
    }
