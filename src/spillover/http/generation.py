"""One generation request over HTTP: prepare, journal, execute (with failover), answer.

``RequestHandler`` is used by the routes (with a client) and by the start-up recovery
(without one): the outcome is always stored in the journal, in the request's own format
(a JSON body, or the SSE transcript of a stream), so a retry with the same
Idempotency-Key, or ``GET /v1/requests/{id}``, gets exactly what was (or would have been)
sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2

from spillover.core.lifecycle import State
from spillover.engine.grammar import GrammarRefused, schema_to_grammar
from spillover.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    NotFound,
    RequestCancelled,
    SpilloverError,
    WorkerFailed,
    to_http,
)
from spillover.http.schemas import GenerationRequest, tool_schema
from spillover.runtime.executor import Execution, Finished, RouteInfo, TokenOut, classify_error

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["Prepared", "RequestHandler", "new_request_id", "prepare", "tool_call_id"]

log = logging.getLogger("spillover.request")


def new_request_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex[:24]


def tool_call_id(rid: str, index: int) -> str:
    """Stable tool-call id: derived from the request id, so a replay keeps it."""
    return "call_" + hashlib.sha256(f"{rid}:{index}".encode()).hexdigest()[:24]


def sse(obj: Any) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True)
class Prepared:
    """A request turned into tokens and limits, ready for the scheduler."""

    rid: str
    req: GenerationRequest
    tokens: list[int]
    max_tokens: int
    grammar: str | None  # GBNF that constrains the output (a forced tool call), bounded
    seed: int
    cpu_tokens: list[int] | None = None  # the prompt in the CPU lane's fallback model's tokens (if it differs)


def _tool_system_prompt(req: GenerationRequest) -> dict[str, Any]:
    fns = [t["function"] for t in req.tools if req.forced_tool in ("*", t["function"]["name"])]
    return {
        "role": "system",
        "content": 'You call functions. Reply with one JSON object {"name": ..., "arguments": {...}} '
        "that calls one of these functions:\n" + json.dumps(fns),
    }


def _render(tok: Any, req: GenerationRequest) -> list[int]:
    """The prompt in ``tok``'s tokens (with that model's chat template)."""
    if req.kind == "text":
        return list(tok.tokenize(req.prompt, special=False))
    messages = [dict(m) for m in req.messages]
    if req.forced_tool is not None:
        messages.insert(0, _tool_system_prompt(req))
    return list(tok.tokenize_chat(messages, [dict(t) for t in req.tools] or None))


def _tool_grammar(req: GenerationRequest, max_bytes: int, max_repeat: int) -> str | None:
    """The bounded output grammar of a forced tool call (400 naming the schema otherwise).
    Each chosen tool's parameters are checked alone first, so the error names its tool."""
    if req.forced_tool is None:
        return None
    for i, t in enumerate(req.tools):
        if req.forced_tool in ("*", t["function"]["name"]):
            param = f"tools[{i}].function.parameters"
            try:
                schema_to_grammar(tool_schema((t,), t["function"]["name"]), max_bytes=max_bytes, max_repeat=max_repeat)
            except GrammarRefused as exc:
                raise InvalidRequest(exc.message, param=f"{param}.{exc.path}" if exc.path else param) from exc
    try:
        return schema_to_grammar(tool_schema(req.tools, req.forced_tool), max_bytes=max_bytes, max_repeat=max_repeat)
    except GrammarRefused as exc:
        raise InvalidRequest(f"the tools together: {exc.message}", param="tools") from exc


async def _render_or_400(tok: Any, req: GenerationRequest) -> list[int]:
    """``_render`` in a thread; a chat template that refuses the conversation (Jinja's
    ``raise_exception``, e.g. roles that do not alternate) is the client's 400."""
    try:
        return await asyncio.to_thread(_render, tok, req)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param="messages") from exc


async def prepare(gw: Gateway, req: GenerationRequest, rid: str) -> Prepared:
    """Check the model, tokenize, and apply the context limits (400 when too long)."""
    if req.model != gw.cfg.model.name:
        raise NotFound(
            f"model {req.model!r} does not exist; this server serves {gw.cfg.model.name!r}",
            param="model",
            code="model_not_found",
        )
    m = gw.cfg.model
    grammar = await asyncio.to_thread(_tool_grammar, req, m.max_grammar_bytes, m.max_grammar_repeat)
    tokens = await _render_or_400(gw.tokenizer, req)
    cpu_tokens = None
    if gw.cpu_tokenizer is not None:  # a fallback model: its own template and vocabulary
        cpu_tokens = await _render_or_400(gw.cpu_tokenizer, req)
        if cpu_tokens == tokens:
            cpu_tokens = None
    cap = gw.context_cap_tokens()
    n = max(len(tokens), len(cpu_tokens or ()))
    if n >= cap or (req.max_tokens is not None and n + req.max_tokens > cap):
        want = n + (req.max_tokens or 1)
        raise ContextLengthExceeded(
            f"this request needs {want} tokens ({n} in the prompt) but the longest context "
            f"any lane serves is {cap} tokens",
            param="messages" if req.kind == "chat" else "prompt",
        )
    max_tokens = req.max_tokens if req.max_tokens is not None else min(gw.cfg.model.default_max_tokens, cap - n)
    seed = req.seed if req.seed is not None else gw.cfg.model.seed
    return Prepared(rid, req, tokens, max_tokens, grammar, seed, cpu_tokens)


@dataclass
class RequestHandler:
    """Runs one prepared request through an Execution and stores its outcome."""

    gw: Gateway
    prep: Prepared
    exe: Execution
    info: RouteInfo | None = None
    text: list[str] = field(default_factory=list)
    transcript: list[bytes] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    cancelled_by_user: bool = False
    _first_delivery_noted: bool = False
    _created: int = 0
    started_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None

    @property
    def rid(self) -> str:
        return self.prep.rid

    @property
    def req(self) -> GenerationRequest:
        return self.prep.req

    # -- signals -------------------------------------------------------------------
    def degraded(self) -> bool:
        return self.info is not None and self.info.route != "gpu"

    def on_fallback(self) -> bool:
        """Whether the CPU lane's fallback model (not a replica) serves this request."""
        return self.gw.fallback_name is not None and self.info is not None and self.info.route == "cpu"

    def served_model(self) -> str:
        """The model that serves the request: the fallback's name when the CPU lane's fallback does."""
        return self.gw.fallback_name if self.on_fallback() and self.gw.fallback_name else self.gw.cfg.model.name

    def spillover_object(self) -> dict[str, Any]:
        i = self.info
        return {
            "request_id": self.rid,
            "route": i.route if i else "none",
            "degraded": self.degraded(),
            "reason": (f"failover:{i.failover}" if i and i.failover else i.reason) if i else None,
            "model": self.served_model(),
            "fallback": self.on_fallback(),
            "limits": {
                "max_tokens": i.max_tokens if i else self.prep.max_tokens,
                "ctx": i.kv_tokens if i else None,
            },
            "shrunk": bool(i and i.shrunk),
            "attempts": self.exe.attempt,
            "queue_position": i.queue_position if i else 0,
            "estimated_delay_ms": i.estimated_delay_ms if i else 0,
        }

    def headers(self) -> dict[str, str]:
        sp = self.spillover_object()
        h = {
            "X-Spillover-Request-Id": self.rid,
            "X-Spillover-Route": sp["route"],
            "X-Spillover-Degraded": "1" if sp["degraded"] else "0",
            "X-Spillover-Model": self.served_model(),
            "X-Spillover-Attempts": str(self.exe.attempt),
            "X-Spillover-Queue-Position": str(sp["queue_position"]),
            "X-Spillover-Estimated-Delay-Ms": str(sp["estimated_delay_ms"]),
        }
        if sp["reason"]:
            h["X-Spillover-Reason"] = sp["reason"]
        if self.info is not None:
            h["X-Spillover-Limits"] = f"max_tokens={self.info.max_tokens};ctx={self.info.kv_tokens}"
        return h

    # -- driving -------------------------------------------------------------------
    async def first_route(self, events: AsyncGenerator[Any, None]) -> None:
        """Wait until the request runs somewhere (its first RouteInfo)."""
        ev = await anext(events)
        assert isinstance(ev, RouteInfo)
        self.info = ev

    def _note_token(self) -> None:
        if self.first_token_s is None and self.info is not None:
            self.first_token_s = time.monotonic()
            self.gw.metrics.ttft.labels(self.info.route).observe(self.first_token_s - self.started_s)
            self.gw.metrics.queue_wait.labels(self.info.route).observe(self.info.queued_s)

    def cancel(self) -> None:
        """DELETE /v1/requests/{id} or a disconnected client: the Execution stops the attempt
        (queued, dispatched or running) and its events end with RequestCancelled, which the
        consumer turns into the stored (and, for a stream, sent) terminal error."""
        self.cancelled_by_user = True
        self.exe.cancel()

    async def store(
        self,
        state: State,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str],
        error: dict[str, Any] | None = None,
    ) -> None:
        """Write the outcome to the journal (terminal state)."""
        i = self.info
        self.gw.metrics.request_done(
            i.route if i else "none",
            state.value,
            self.spillover_object()["reason"] or "none",
            time.monotonic() - self.started_s,
            self.completion_tokens,
        )
        await self.gw.store_outcome(
            self.rid,
            state,
            status_code=status,
            response=body,
            content_type=content_type,
            headers=json.dumps(headers),
            error=json.dumps(error) if error else None,
            route=i.route if i else None,
            attempts=self.exe.attempt,
            reason=self.spillover_object()["reason"],
            tokens_delivered=len(self.exe.delivered) if self.req.stream else self.completion_tokens,
        )

    async def fail(self, exc: SpilloverError) -> tuple[int, bytes, dict[str, str]]:
        """Store an error outcome; return (status, body, headers) for the client."""
        if self.cancelled_by_user and not isinstance(exc, RequestCancelled):
            exc = RequestCancelled(f"request {self.rid} was cancelled")
        e = to_http(exc, self.rid)
        body = json.dumps(e.body).encode()
        headers = self.headers() | e.headers
        await self.store(classify_error(exc), e.status, body, "application/json", headers, e.body)
        return e.status, body, headers

    # -- non-stream ----------------------------------------------------------------
    async def run_to_body(self, events: AsyncGenerator[Any, None]) -> tuple[int, bytes, dict[str, str]]:
        """Drive to the end and build the final JSON body (also stored)."""
        try:
            async with contextlib.aclosing(events):  # an early exit still ends the Execution
                async for ev in events:
                    if isinstance(ev, RouteInfo):
                        self.info = ev
                        if ev.restart:
                            self.text.clear()
                    elif isinstance(ev, TokenOut):
                        self._note_token()
                        self.text.append(ev.text)
                    elif isinstance(ev, Finished):
                        self.finish_reason = ev.finish_reason
                        self.completion_tokens = ev.completion_tokens
            body = json.dumps(self.final_body()).encode()
        except SpilloverError as exc:
            return await self.fail(exc)
        except Exception as exc:  # a bug: the request still ends, journaled, with a 500
            log.exception("request %s failed", self.rid)
            return await self.fail(SpilloverError(f"internal error: {type(exc).__name__}"))
        except asyncio.CancelledError:  # the server is stopping: end the request, then go on unwinding
            await asyncio.shield(self.fail(RequestCancelled(f"request {self.rid} was cancelled")))
            raise
        headers = self.headers()
        await self.store(State.COMPLETED, 200, body, "application/json", headers)
        return 200, body, headers

    def usage(self) -> dict[str, int]:
        n = len(self.prep.cpu_tokens if self.on_fallback() and self.prep.cpu_tokens else self.prep.tokens)
        return {
            "prompt_tokens": n,
            "completion_tokens": self.completion_tokens,
            "total_tokens": n + self.completion_tokens,
        }

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """OpenAI ``tool_calls`` from the constrained output of a forced tool call."""
        if self.req.forced_tool is None:
            return None
        raw = "".join(self.text)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise WorkerFailed(
                f"the tool call was cut off before it was complete (finish_reason={self.finish_reason}); "
                "raise max_tokens"
            ) from exc
        return [
            {
                "id": tool_call_id(self.rid, 0),
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])},
            }
        ]

    def _system_fingerprint(self) -> str | None:
        fp = (self.gw.worker_info(self.info.worker_id) if self.info else {}).get("fingerprint") or {}
        return f"fp_{fp['compat']}" if fp.get("compat") else None

    def final_body(self) -> dict[str, Any]:
        created = int(time.time())
        text = "".join(self.text)
        common = {
            "created": created,
            "model": self.served_model(),
            "system_fingerprint": self._system_fingerprint(),
        }
        if self.req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = self.finish_reason
            calls = self.tool_calls()
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = "tool_calls"
            return {
                "id": f"chatcmpl-{self.rid}",
                "object": "chat.completion",
                **common,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": self.usage(),
                "spillover": self.spillover_object(),
            }
        return {
            "id": f"cmpl-{self.rid}",
            "object": "text_completion",
            **common,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}],
            "usage": self.usage(),
            "spillover": self.spillover_object(),
        }

    # -- stream --------------------------------------------------------------------
    def _chunk(self, delta: dict[str, Any] | str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        chat = self.req.kind == "chat"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {
            "id": f"chatcmpl-{self.rid}" if chat else f"cmpl-{self.rid}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self._created,
            "model": self.served_model(),
            "choices": [choice],
            **extra,
        }

    def _emit(self, obj: Any) -> bytes:
        data = sse(obj)
        self.transcript.append(data)
        return data

    async def stream(self, events: AsyncGenerator[Any, None]) -> AsyncIterator[bytes]:
        """SSE bytes: a first chunk with the spillover object, tokens, a route-change chunk
        whenever the route changes, the end (or a typed error event), ``[DONE]``."""
        self._created = int(time.time())
        chat = self.req.kind == "chat"
        buffer_tools = chat and self.req.forced_tool is not None
        state, status = State.COMPLETED, 200
        error: dict[str, Any] | None = None
        closing: list[dict[str, Any]] = []  # the final events, sent once the outcome is journaled
        try:
            yield self._emit(
                self._chunk({"role": "assistant", "content": ""} if chat else "", spillover=self.spillover_object())
            )
            async for ev in events:
                if isinstance(ev, RouteInfo):
                    self.info = ev
                    if ev.restart:
                        self.text.clear()
                    yield self._emit(self._chunk({} if chat else "", spillover=self.spillover_object()))
                elif isinstance(ev, TokenOut):
                    self._note_token()
                    self.text.append(ev.text)
                    if ev.text and not buffer_tools:
                        if not self._first_delivery_noted and self.gw.journal is not None:
                            self._first_delivery_noted = True
                            await self.gw.journal.update(self.rid, tokens_delivered=1)
                        yield self._emit(self._chunk({"content": ev.text} if chat else ev.text))
                elif isinstance(ev, Finished):
                    self.finish_reason = ev.finish_reason
                    self.completion_tokens = ev.completion_tokens
            finish = self.finish_reason
            if buffer_tools:
                calls = self.tool_calls() or []
                closing.append(self._chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}))
                finish = "tool_calls"
            closing.append(self._chunk({} if chat else "", finish))
            if self.req.include_usage:
                usage_chunk = self._chunk({} if chat else "", None, usage=self.usage())
                usage_chunk["choices"] = []
                closing.append(usage_chunk)
        except Exception as caught:  # an error event: the request's own, or (a bug) a 500
            if not isinstance(caught, SpilloverError):
                log.exception("request %s failed", self.rid)
            err = (
                caught
                if isinstance(caught, SpilloverError)
                else SpilloverError(f"internal error: {type(caught).__name__}")
            )
            if self.cancelled_by_user:
                err = RequestCancelled(f"request {self.rid} was cancelled")
            state = classify_error(err)
            body = to_http(err, self.rid).body
            body["error"]["tokens_delivered"] = len(self.exe.delivered)
            error = body
            closing = [body]
        except (asyncio.CancelledError, GeneratorExit):  # the connection went away: nobody reads on
            self.exe.cancel()
            # One shielded task: under a cancelled (anyio) scope every later await raises again,
            # so closing the Execution and journaling CANCELLED must not be two awaits here.
            await asyncio.shield(self._end_abandoned(events, status))
            raise
        # Write ahead: the outcome, with the closing events, is journaled before they are sent,
        # so a client that goes away while reading them cannot leave the request unfinished.
        tail = [self._emit(c) for c in closing] + [self._emit_done()]
        await asyncio.shield(self._finish(events, state, status, error))
        for data in tail:
            yield data

    async def _end_abandoned(self, events: AsyncGenerator[Any, None], status: int) -> None:
        """The client of a stream went away: end the Execution, journal CANCELLED."""
        error = to_http(RequestCancelled(f"request {self.rid} was cancelled"), self.rid).body
        self._emit(error)
        self._emit_done()
        await self._finish(events, State.CANCELLED, status, error)

    async def _finish(
        self, events: AsyncGenerator[Any, None], state: State, status: int, error: dict[str, Any] | None
    ) -> None:
        """End the Execution (a no-op when its events ended; else it stops, e.g. after this
        body's own journal write failed) and journal the stream's outcome. Run shielded, as
        one task: a client that hangs up meanwhile cannot leave the request unfinished."""
        await events.aclose()
        await self._store_stream(state, status, error)

    def _emit_done(self) -> bytes:
        data = b"data: [DONE]\n\n"
        self.transcript.append(data)
        return data

    async def _store_stream(self, state: State, status: int, error: dict[str, Any] | None) -> None:
        await self.store(
            state,
            status,
            b"".join(self.transcript),
            "text/event-stream",
            self.headers() | {"Cache-Control": "no-cache"},
            error,
        )


async def begin(
    gw: Gateway,
    prep: Prepared,
    *,
    deadline_ms: int | None = None,
    body_json: str,
    body_hash: str,
    idem_key: str | None,
    resume_attempts: int | None,
) -> tuple[RequestHandler, AsyncGenerator[Any, None]]:
    """Make the request durable (ACCEPTED, or resumed from its record) and only then queue
    it. From here the Execution owns its lease and the handler its terminal state: a request
    the queue cannot take now is journaled REJECTED (resumable with its key) and the caller
    gets the CapacityError."""
    assert gw.scheduler is not None
    exe = gw.new_execution(
        prep.rid,
        prep.tokens,
        prep.max_tokens,
        {
            "temperature": prep.req.temperature,
            "top_p": prep.req.top_p,
            "seed": prep.seed,
            "stop": list(prep.req.stop),
            "grammar": prep.grammar,
        },
        incremental=prep.req.stream and prep.req.forced_tool is None,
        allow_shrink=prep.req.allow_shrink,
        attempt=resume_attempts or 0,
        cpu_tokens=prep.cpu_tokens,
    )
    if prep.req.prefer_cpu:
        exe.prefer_cpu()  # 400 (before anything is journaled) when the CPU lane cannot take it
    elif gw.canary_due():
        exe.prefer_cpu("canary")
    if deadline_ms is not None:
        exe.deadline_s = time.monotonic() + deadline_ms / 1000
    handler = RequestHandler(gw, prep, exe)
    if gw.journal is not None and resume_attempts is None:
        await gw.journal.accept(
            rid=prep.rid,
            idem_key=idem_key,
            body_hash=body_hash,
            kind=prep.req.kind,
            stream=prep.req.stream,
            body=body_json,
            model=prep.req.model,
        )
    gw.live[prep.rid] = handler  # visible to DELETE as soon as it is accepted
    try:
        if gw.journal is not None:
            lane = gw.scheduler.entry_lane(exe.next_lane)
            await gw.journal.move(prep.rid, State.QUEUED, route=lane, attempts=exe.attempt + 1)
        exe.submit_nowait()
    except BaseException as exc:
        gw.live.pop(prep.rid, None)
        exe.cancel()
        err = exc if isinstance(exc, SpilloverError) else SpilloverError(f"internal error: {type(exc).__name__}")
        await asyncio.shield(handler.fail(err))
        raise
    return handler, _unregister_when_done(gw, prep.rid, exe.events())


async def _unregister_when_done(gw: Gateway, rid: str, events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """The Execution's events; when they end, or the consumer closes this early, the
    Execution is closed too (its lease released) and the request leaves ``gw.live``."""
    try:
        async with contextlib.aclosing(events):
            async for ev in events:
                yield ev
    finally:
        gw.live.pop(rid, None)
