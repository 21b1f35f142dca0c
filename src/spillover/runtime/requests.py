"""The request service: the one owner of a request from "accepted" to "terminal".

Rules:

1. ``submit()`` validates (the endpoint's parser, the model, the prompt's limits), then, under
   the Idempotency-Key's lock (one execution per key, ever, at a time), answers a finished
   key from the journal, or journals ACCEPTED (fsync) *before* anything is queued.
2. From acceptance on, the ``Run`` owns the terminal state and the ``Execution`` owns the
   lease (slot + reservation, released exactly once). Every way a run ends (done, an error,
   a bug, DELETE, the client going away, the server stopping) journals exactly one terminal
   state, in the answer's own wire format, before its last bytes are sent.
3. A request whose queue is already full is refused *before* it is accepted (503 with
   Retry-After; nothing journaled). One that loses the last place to a concurrent request
   while it is being accepted is journaled REJECTED (resumable with its key) and gets the
   same 503.
4. The HTTP layer registers one ``Endpoint`` per route: how a body is read and how an
   answer is encoded (``Encoding``). Nothing here knows HTTP; start-up recovery replays an
   orphan through the same endpoint (``replay``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from spillover.core.lifecycle import RESUMABLE, State
from spillover.core.reasons import FailoverReason, Reason
from spillover.errors import (
    IdempotencyInFlight,
    IdempotencyMismatch,
    InvalidRequest,
    RequestCancelled,
    SpilloverError,
)
from spillover.runtime.executor import Execution, Finished, RouteInfo, TokenOut, classify_error
from spillover.runtime.journal import JournalRecord, KeyConflict, dumps
from spillover.runtime.prepare import GenerationRequest, Prepared, new_request_id, prepare
from spillover.runtime.recovery import end_orphan

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = [
    "Answer",
    "Encoded",
    "Encoding",
    "Endpoint",
    "Refused",
    "RequestService",
    "Run",
    "Streaming",
]

log = logging.getLogger("spillover.request")
CANCEL_WAIT_S = 2.0  # how long DELETE waits for a cancelled run to journal its end


@dataclass(frozen=True)
class Encoded:
    """An answer (or its last part) in wire format, as sent and as journaled."""

    status: int
    frames: list[bytes]
    headers: dict[str, str]
    content_type: str
    error: dict[str, Any] | None = None  # the error object of a failed request


class Encoding(Protocol):
    """One request's answer in its wire format (an OpenAI JSON body, an SSE stream, ...).
    Every frame returned is sent and kept; the kept frames are the stored answer. An error
    of a stream that has not started (``committed=False``) is a whole error answer."""

    def headers(self) -> dict[str, str]: ...
    def opening(self) -> list[bytes]: ...
    def route_changed(self) -> list[bytes]: ...
    def token(self, text: str) -> list[bytes]: ...
    def closing(self) -> Encoded: ...  # may raise SpilloverError (e.g. a cut-off tool call)
    def error(self, err: SpilloverError, *, committed: bool) -> Encoded: ...


@dataclass(frozen=True)
class Endpoint:
    """How one route's bodies are read and its answers written (given by the HTTP layer).
    ``name`` is stored with the body, so a replay after a restart finds its endpoint again."""

    name: str
    parse: Callable[[Any], GenerationRequest]  # a validated request, or InvalidRequest
    stored: Callable[[dict[str, Any]], dict[str, Any]]  # the part of a body that is journaled
    encoding: Callable[[Run], Encoding]


@dataclass(frozen=True)
class Answer:
    """A whole answer: a stored one (an Idempotency-Key's replay) or a finished run's."""

    status: int
    body: bytes
    headers: dict[str, str]
    content_type: str


@dataclass(frozen=True)
class Streaming:
    """A running stream: its headers now, its frames as they come."""

    headers: dict[str, str]
    frames: AsyncGenerator[bytes, None]


class Refused(Exception):
    """A request refused before it was accepted (nothing journaled), naming the request id
    its error belongs to (the key's request for an Idempotency-Key error)."""

    def __init__(self, error: SpilloverError, rid: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.rid = rid


def _as_error(exc: BaseException, rid: str) -> SpilloverError:
    """Any exception as the request's error; a foreign one is a bug, logged, a 500."""
    if isinstance(exc, SpilloverError):
        return exc
    log.error("request %s failed", rid, exc_info=exc)
    return SpilloverError(f"internal error: {type(exc).__name__}")


@dataclass(eq=False)
class Run:
    """One accepted request while it runs: drives its Execution's events through its
    Encoding and journals its one terminal state (rule 2)."""

    gw: Gateway
    prep: Prepared
    exe: Execution
    events: AsyncGenerator[Any, None]
    encoding: Encoding = field(init=False)
    info: RouteInfo | None = None
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    cancelled_by_user: bool = False
    created_s: int = field(default_factory=lambda: int(time.time()))
    started_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once the outcome is journaled
    _kept: list[bytes] = field(default_factory=list)
    _delivery_noted: bool = False
    _outcome: Encoded | None = None
    _error_state: State = State.FAILED

    def __repr__(self) -> str:
        return f"<Run {self.rid} route={self.info.route if self.info else None} attempt={self.exe.attempt}>"

    @property
    def rid(self) -> str:
        return self.prep.rid

    @property
    def req(self) -> GenerationRequest:
        return self.prep.req

    # -- what the answer says about itself ------------------------------------------------
    def degraded(self) -> bool:
        return self.info is not None and self.info.route != "gpu"

    def on_fallback(self) -> bool:
        """Whether the CPU lane's fallback model (not a replica) serves this request."""
        return self.gw.fallback_name is not None and self.info is not None and self.info.route == "cpu"

    def served_model(self) -> str:
        """The model that serves the request: the fallback's name when the CPU lane's fallback does."""
        return self.gw.fallback_name if self.on_fallback() and self.gw.fallback_name else self.gw.cfg.model.name

    def reason(self) -> str | None:
        """Why it runs where it runs (``failover:<kind>`` after a failover)."""
        i = self.info
        if i is None:
            return None
        return str(FailoverReason(i.failover)) if i.failover else i.reason

    def prompt_tokens(self) -> int:
        return len(self.prep.cpu_tokens if self.on_fallback() and self.prep.cpu_tokens else self.prep.tokens)

    def fingerprint(self) -> str | None:
        """The compatibility fingerprint of the worker that serves it."""
        fp = (self.gw.worker_info(self.info.worker_id) if self.info else {}).get("fingerprint") or {}
        return str(fp["compat"]) if fp.get("compat") else None

    # -- control ----------------------------------------------------------------------
    def cancel(self) -> None:
        """DELETE /v1/requests/{id} or a disconnected client: the Execution stops the attempt
        (queued, dispatched or running); the run ends CANCELLED."""
        self.cancelled_by_user = True
        self.exe.cancel()

    # -- driving ----------------------------------------------------------------------
    async def reply(self) -> Answer | Streaming:
        """Run it: a non-stream to its end (an ``Answer``); a stream until it runs somewhere
        (then ``Streaming``; a failure before that is an ``Answer`` too)."""
        if self.req.stream:
            try:
                ev = await anext(self.events)
                assert isinstance(ev, RouteInfo), ev
                self.info = ev
            except Exception as exc:
                await asyncio.shield(self._end(self._error(exc, committed=False), failed=exc))
                return self._answer()
            except (asyncio.CancelledError, GeneratorExit):  # the server is stopping
                await asyncio.shield(self._end_abandoned(committed=False))
                raise
            return Streaming(self.encoding.headers() | {"Cache-Control": "no-cache"}, self._frames())
        async with contextlib.aclosing(self._frames()) as frames:
            async for _ in frames:
                pass
        return self._answer()

    def _answer(self) -> Answer:
        o = self._outcome
        assert o is not None
        return Answer(o.status, b"".join(self._kept), o.headers, o.content_type)

    def _keep(self, frames: list[bytes]) -> list[bytes]:
        self._kept.extend(frames)
        return frames

    async def _frames(self) -> AsyncGenerator[bytes, None]:
        """The answer's frames, journaled: the outcome (with the last frames) is written
        before those frames are sent, so a client that goes away while reading them
        cannot leave the request unfinished."""
        enc = self.encoding
        failed: BaseException | None = None
        try:
            for f in self._keep(enc.opening()):
                yield f
            async for ev in self.events:
                if isinstance(ev, RouteInfo):
                    self.info = ev
                    if ev.restart:
                        self.text.clear()
                    out = enc.route_changed()
                elif isinstance(ev, TokenOut):
                    self._note_token()
                    self.text.append(ev.text)
                    out = enc.token(ev.text)
                    if out and self.req.stream:
                        await self._note_delivery()
                elif isinstance(ev, Finished):
                    self.finish_reason = ev.finish_reason
                    self.completion_tokens = ev.completion_tokens
                    out = []
                for f in self._keep(out):
                    yield f
            outcome = enc.closing()
        except Exception as exc:  # the request's own error, or (a bug) a 500
            failed = exc
            outcome = self._error(exc, committed=self.req.stream)
        except (asyncio.CancelledError, GeneratorExit):  # nobody reads on: the client went away
            self.exe.cancel()
            # One shielded task: under a cancelled (anyio) scope every later await raises again.
            await asyncio.shield(self._end_abandoned(committed=self.req.stream))
            raise
        await asyncio.shield(self._end(outcome, failed=failed))
        for f in outcome.frames:
            yield f

    def _error(self, exc: BaseException, *, committed: bool) -> Encoded:
        err = _as_error(exc, self.rid)
        if self.cancelled_by_user:
            err = RequestCancelled(f"request {self.rid} was cancelled")
        self._error_state = classify_error(err)
        return self.encoding.error(err, committed=committed)

    async def _end_abandoned(self, *, committed: bool) -> None:
        """The client (or the server) went away: end the Execution, journal CANCELLED."""
        outcome = self._error(RequestCancelled(f"request {self.rid} was cancelled"), committed=committed)
        await self._end(outcome, failed=RequestCancelled(self.rid))

    async def _end(self, outcome: Encoded, *, failed: BaseException | None) -> None:
        """End the Execution (a no-op when its events ended) and journal the outcome."""
        self._keep(outcome.frames)
        self._outcome = outcome
        try:
            await self.events.aclose()
        finally:
            state = State.COMPLETED if failed is None else self._error_state
            await self._store(state, outcome)
            self.ended.set()

    def _note_token(self) -> None:
        if self.first_token_s is None and self.info is not None:
            self.first_token_s = time.monotonic()
            self.gw.metrics.ttft.labels(self.info.route).observe(self.first_token_s - self.started_s)
            self.gw.metrics.queue_wait.labels(self.info.route).observe(self.info.queued_s)

    async def _note_delivery(self) -> None:
        """The first token that reaches the client: from now on the stream is not replayable."""
        if not self._delivery_noted and self.gw.journal is not None:
            self._delivery_noted = True
            await self.gw.journal.update(self.rid, tokens_delivered=1)

    async def _store(self, state: State, outcome: Encoded) -> None:
        """Write the outcome to the journal (terminal state) and count it."""
        i = self.info
        reason = self.reason()
        self.gw.metrics.request_done(
            i.route if i else "none",
            state.value,
            reason or "none",
            time.monotonic() - self.started_s,
            self.completion_tokens,
        )
        await self.gw.store_outcome(
            self.rid,
            state,
            status_code=outcome.status,
            response=b"".join(self._kept),
            content_type=outcome.content_type,
            headers=json.dumps(outcome.headers),
            error=json.dumps(outcome.error) if outcome.error else None,
            route=i.route if i else None,
            attempts=self.exe.attempt,
            reason=reason,
            tokens_delivered=len(self.exe.delivered) if self.req.stream else self.completion_tokens,
        )


class RequestService:
    """Accepts, runs, cancels and replays requests (the rules in the module docstring)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.endpoints: dict[str, Endpoint] = {}
        self.live: dict[str, Run] = {}  # request id -> Run, from acceptance until its events end

    def __repr__(self) -> str:
        return f"<RequestService endpoints={sorted(self.endpoints)} live={len(self.live)}>"

    def register(self, endpoint: Endpoint) -> None:
        self.endpoints[endpoint.name] = endpoint

    async def submit(self, endpoint: str, body: Any, *, idem_key: str | None, deadline_ms: int | None) -> Answer | Run:
        """Rule 1: a stored answer (a finished Idempotency-Key), or an accepted ``Run``.
        Raises ``Refused`` when the request is not accepted."""
        ep = self.endpoints[endpoint]
        rid = new_request_id()
        try:
            req = ep.parse(body)
            try:
                body_hash = hashlib.sha256(dumps({"endpoint": endpoint, "body": body}).encode()).hexdigest()
            except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") is JSON, not text
                raise InvalidRequest("the body contains text that is not valid Unicode (a lone surrogate)") from exc
            body_json = dumps({"endpoint": endpoint, "body": ep.stored(body)})
            async with self.gw.keys.hold(idem_key):
                resume: int | None = None
                if idem_key is not None and self.gw.journal is not None:
                    rec = await self.gw.journal.by_key(idem_key)
                    if rec is not None:
                        rid = rec.id  # errors about this key name the request it is bound to
                        if rec.body_hash != body_hash:
                            raise IdempotencyMismatch(
                                "this Idempotency-Key was used with a different request body",
                                param="Idempotency-Key",
                            )
                        if not rec.terminal or rid in self.live:
                            raise _in_flight(rec.id)
                        if rec.state not in RESUMABLE:
                            return stored_answer(rec)
                        resume = rec.attempts
                prep = await prepare(self.gw, req, rid)
                try:
                    return await self._begin(
                        ep,
                        prep,
                        body_json=body_json,
                        body_hash=body_hash,
                        idem_key=idem_key,
                        resume_attempts=resume,
                        deadline_ms=req.deadline_ms or deadline_ms,
                    )
                except KeyConflict as exc:
                    raise _in_flight(exc.existing.id) from exc
        except SpilloverError as exc:
            raise Refused(exc, rid) from exc

    async def _begin(
        self,
        ep: Endpoint,
        prep: Prepared,
        *,
        body_json: str,
        body_hash: str,
        idem_key: str | None,
        resume_attempts: int | None,
        deadline_ms: int | None = None,
    ) -> Run:
        """Make the request durable (ACCEPTED, or resumed from its record) and only then
        queue it. A request whose queue is already full is refused before anything is journaled."""
        gw = self.gw
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
            exe.prefer_cpu(Reason.CANARY)
        if deadline_ms is not None:
            exe.deadline_s = time.monotonic() + deadline_ms / 1000
        exe.check_queue_nowait()  # rule 3: a full queue answers at once, nothing journaled
        run = Run(gw, prep, exe, self._unregister_when_done(prep.rid, exe.events()))
        run.encoding = ep.encoding(run)
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
        self.live[prep.rid] = run  # visible to DELETE as soon as it is accepted
        try:
            if gw.journal is not None:
                lane = gw.scheduler.entry_lane(exe.next_lane)
                await gw.journal.move(prep.rid, State.QUEUED, route=lane, attempts=exe.attempt + 1)
            exe.submit_nowait()
        except BaseException as exc:
            self.live.pop(prep.rid, None)  # its events never started: their ``finally`` will not run
            exe.cancel()
            await asyncio.shield(run._end(run._error(exc, committed=False), failed=exc))
            raise
        return run

    async def _unregister_when_done(self, rid: str, events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """The Execution's events; when they end, or the consumer closes this early, the
        Execution is closed too (its lease released) and the request leaves ``live``."""
        try:
            async with contextlib.aclosing(events):
                async for ev in events:
                    yield ev
        finally:
            self.live.pop(rid, None)

    async def cancel(self, rid: str) -> None:
        """Cancel a live request and wait (bounded) until its end is journaled."""
        run = self.live.get(rid)
        if run is None:
            return
        run.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.ended.wait(), CANCEL_WAIT_S)

    def cancel_all(self) -> None:
        """The server is stopping: every live request stops (each journals its end)."""
        for run in list(self.live.values()):
            run.exe.cancel()

    async def replay(self, rec: JournalRecord) -> None:
        """Run an orphan again (start-up recovery) under its Idempotency-Key's lock, through
        its own endpoint, so a retry with its key gets exactly what its client would have.
        If its client resumed it meanwhile (it is live, or no longer QUEUED), nothing runs."""
        assert self.gw.journal is not None
        async with self.gw.keys.hold(rec.idem_key):
            current = await self.gw.journal.get(rec.id)
            if rec.id in self.live or current is None or current.state is not State.QUEUED:
                return
            try:
                doc = json.loads(rec.body)
                ep = self.endpoints[doc["endpoint"]]
                prep = await prepare(self.gw, ep.parse(doc["body"]), rec.id)
                run = await self._begin(
                    ep,
                    prep,
                    body_json=rec.body,
                    body_hash=rec.body_hash,
                    idem_key=rec.idem_key,
                    resume_attempts=rec.attempts,
                )
            except Exception as exc:  # its stored body no longer runs (or a bug): it ends, resumable
                current = await self.gw.journal.get(rec.id)
                if current is not None and not current.terminal:
                    await end_orphan(self.gw, current, _as_error(exc, rec.id))
                return
        reply = await run.reply()
        if isinstance(reply, Streaming):
            async with contextlib.aclosing(reply.frames) as frames:
                async for _ in frames:
                    pass

    def replayable(self) -> bool:
        """Whether an orphan can be run again here (some endpoint is registered)."""
        return bool(self.endpoints)


def _in_flight(rid: str) -> IdempotencyInFlight:
    """The 409 for a key whose request ``rid`` has not ended."""
    return IdempotencyInFlight(
        f"a request with this Idempotency-Key ({rid}) is still in flight", param="Idempotency-Key"
    )


def stored_answer(rec: JournalRecord) -> Answer:
    """A finished request's journaled answer, as it was sent (an Idempotency-Key's replay)."""
    headers = json.loads(rec.headers or "{}")
    headers["Idempotent-Replayed"] = "true"
    return Answer(rec.status_code or 200, rec.response or b"", headers, rec.content_type or "application/json")
