"""One accepted request while it runs: the ``Run`` drives its Execution's events through its
answer's ``Encoding`` (given by the HTTP layer) and journals its one terminal state.

Rules:

1. Every way a run ends (done, an error, a bug, DELETE, the client going away, the server
   stopping) journals exactly one terminal state, in the answer's own wire format.
2. Write ahead: the outcome, with the answer's last frames, is journaled before those
   frames are sent, so a client that goes away while reading them cannot leave the request
   unfinished, and a replay of its Idempotency-Key gets exactly what was sent.
3. A stream's first token that reaches the client is journaled (``tokens_delivered``): from
   then on it is not replayable from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from spillover.core.lifecycle import State
from spillover.core.reasons import FailoverReason
from spillover.errors import RequestCancelled, SpilloverError
from spillover.runtime.executor import Execution, Finished, RouteInfo, TokenOut, classify_error
from spillover.runtime.outcomes import not_durable, stopped
from spillover.runtime.prepare import GenerationRequest, Prepared

if TYPE_CHECKING:
    from spillover.runtime.chat import ChatModel
    from spillover.runtime.gateway import Gateway

__all__ = ["Answer", "Encoded", "Encoding", "Run", "Streaming", "as_error"]

log = logging.getLogger("spillover.request")


@dataclass(frozen=True)
class Encoded:
    """An answer (or its last part) in wire format, as sent and as journaled."""

    status: int
    frames: list[bytes]
    headers: dict[str, str]
    content_type: str
    error: dict[str, Any] | None = None  # the error object of a failed request

    def journaled(self, response: bytes) -> dict[str, Any]:
        """The journal's fields for this answer, whose bytes (all frames sent) are ``response``."""
        return {
            "status_code": self.status,
            "response": response,
            "content_type": self.content_type,
            "headers": json.dumps(self.headers),
            "error": json.dumps(self.error) if self.error else None,
        }


class Encoding(Protocol):
    """One request's answer in its wire format (an OpenAI JSON body, an SSE stream, ...).
    Every frame returned is sent and kept; the kept frames are the stored answer. An error
    of a stream that has not started (``committed=False``) is a whole error answer."""

    @property
    def content_type(self) -> str: ...  # of the stream (or the whole answer)
    def headers(self) -> dict[str, str]: ...
    def opening(self) -> list[bytes]: ...
    def route_changed(self) -> list[bytes]: ...
    def token(self, token: TokenOut) -> list[bytes]: ...
    def closing(self) -> Encoded: ...  # may raise SpilloverError (e.g. a cut-off tool call)
    def error(self, err: SpilloverError, *, committed: bool) -> Encoded: ...


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
    frames: Frames
    content_type: str


@dataclass(eq=False)
class Frames:
    """A stream's frames (``gen``) as the HTTP server reads them. ``aclose`` ends the request
    even when not one frame was read: closing an async generator that never started runs
    none of its code, so a client gone between the stream's headers and its first frame
    (the server then cancels the body before it reads it) left the request running, its
    lease held and its journal row open, for good. Then ``abandoned`` does what the
    generator does when its reader goes away."""

    gen: AsyncGenerator[bytes, None]
    abandoned: Callable[[], Awaitable[None]]
    _started: bool = False

    def __aiter__(self) -> Frames:
        return self

    async def __anext__(self) -> bytes:
        self._started = True
        return await anext(self.gen)

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            await self.abandoned()
        await self.gen.aclose()


def as_error(exc: BaseException, rid: str) -> SpilloverError:
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
    tokens: list[TokenOut] = field(default_factory=list)  # with log-probabilities, when asked
    completion_tokens: int = 0
    finish_reason: str | None = None
    cancelled_by_user: bool = False
    # Replayed after a restart with no client (``Requests.replay``): what it streams reaches
    # nobody, so its delivery is not journaled and a second crash replays it again (round 36:
    # it ended failover_interrupted, "tokens had been delivered", for tokens nobody read). Its
    # frames are kept as its answer all the same, so a failover still only continues it.
    unread: bool = False
    created_s: int = field(default_factory=lambda: int(time.time()))
    started_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once the outcome is journaled
    _after_end: list[Callable[[], None]] = field(default_factory=list)  # ``after_end``'s, until ``_over``
    _over: bool = False
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

    @property
    def chat(self) -> ChatModel:
        """The chat model that serves it."""
        return self.prep.chat or self.gw.chat

    # -- what the answer says about itself ------------------------------------------------
    def degraded(self) -> bool:
        return self.info is not None and self.info.route != "gpu"

    def on_fallback(self) -> bool:
        """Whether the CPU lane's fallback model (not a replica) serves this request."""
        return self.chat.fallback_name is not None and self.info is not None and self.info.route == "cpu"

    def served_model(self) -> str:
        """The model that serves the request: the fallback's name when the CPU lane's fallback does."""
        fallback = self.chat.fallback_name
        return fallback if self.on_fallback() and fallback else self.chat.name

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

    def brief(self) -> dict[str, Any]:
        """Its line in /v1/status ``running``."""
        return {"rid": self.rid, "route": self.info.route if self.info else None, "attempt": self.exe.attempt}

    # -- control ----------------------------------------------------------------------
    def cancel(self, *, by_user: bool = True) -> None:
        """DELETE /v1/requests/{id} (``by_user``) or a disconnected client: the Execution stops
        the attempt (queued, dispatched or running); the run ends CANCELLED after a DELETE, else
        resumable (the client went away, or the gateway stops: ``outcomes.stopped``)."""
        self.cancelled_by_user = self.cancelled_by_user or by_user
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
            return Streaming(
                self.encoding.headers() | {"Cache-Control": "no-cache"},
                Frames(self._frames(), self._abandoned),
                self.encoding.content_type,
            )
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
                        self.tokens.clear()
                    out = enc.route_changed()
                elif isinstance(ev, TokenOut):
                    self._note_token()
                    self.text.append(ev.text)
                    if ev.logprob is not None:
                        self.tokens.append(ev)
                    out = enc.token(ev)
                    if out and self.req.stream:
                        self.exe.shown = True  # from now on a failover may only continue it
                        if not self.unread:
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
            await self._abandoned()
            raise
        durable = await asyncio.shield(self._end(outcome, failed=failed))
        if not durable and failed is None:  # an answer is sent only once it is durable
            outcome = self._error(not_durable(self.rid), committed=self.req.stream)
            self._outcome = outcome
            if not self.req.stream:  # nothing went out yet: the error is the whole answer
                self._kept = list(outcome.frames)
        for f in outcome.frames:
            yield f

    def _ends_where_it_is(self) -> None:
        """A run that ends on an attempt that never started (it failed before its start, or
        was refused or expired in the CPU queue after a failover) reports that attempt's route
        and reason, as its journal rows have it, not the last started one's (round 49b)."""
        last = self.exe.dispatched
        if last is not None and (self.info is None or last.attempt > self.info.attempt):
            self.info = last

    def _error(self, exc: BaseException, *, committed: bool) -> Encoded:
        self._ends_where_it_is()
        err = as_error(exc, self.rid)
        if self.cancelled_by_user:
            err = RequestCancelled(f"request {self.rid} was cancelled")
        elif isinstance(err, RequestCancelled):  # no DELETE: the client or the server went away
            err = stopped(self.rid, server_stopping=self.gw.stopping)
        self._error_state = classify_error(err)
        return self.encoding.error(err, committed=committed)

    async def _abandoned(self) -> None:
        """Nobody reads the answer on (the client went away): the request ends."""
        self.exe.cancel()
        # One shielded task: under a cancelled (anyio) scope every later await raises again.
        await asyncio.shield(self._end_abandoned(committed=self.req.stream))

    async def _end_abandoned(self, *, committed: bool) -> None:
        """The client (or the server) went away: end the Execution, journal RESUMABLE_ERROR
        (``client_disconnected`` or ``server_stopping``: ``_error``), or CANCELLED after a DELETE."""
        outcome = self._error(RequestCancelled(f"request {self.rid} was cancelled"), committed=committed)
        await self._end(outcome, failed=RequestCancelled(self.rid))

    async def _end(self, outcome: Encoded, *, failed: BaseException | None) -> bool:
        """End the Execution (a no-op when its events ended) and journal the outcome; False
        when the outcome is not durable yet (``Gateway.store_outcome``)."""
        self._keep(outcome.frames)
        self._outcome = outcome
        try:
            await self.events.aclose()
        finally:
            state = State.COMPLETED if failed is None else self._error_state
            try:
                durable = await self._store(state, outcome)
                self.ended.set()
            finally:  # its journal write may fail or be cancelled: what waits for the end still runs
                self._over = True
                for then in self._after_end:
                    then()
                self._after_end.clear()
        return durable

    def after_end(self, then: Callable[[], None]) -> None:
        """Call ``then`` once its end is over (``_end``: the outcome journaled, or its write
        failed): now, or then."""
        if self._over:
            then()
        else:
            self._after_end.append(then)

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

    async def _store(self, state: State, outcome: Encoded) -> bool:
        """Write the outcome to the journal (terminal state) and count it; False when it is
        not durable yet."""
        i = self.info
        # A request refused before it ran has no route: its reason is its answer's (why there
        # was no room), as the client read it, in the journal and /metrics alike.
        reason = self.reason() or outcome.headers.get("X-Spillover-Reason")
        if state is State.COMPLETED and i is not None:
            self.gw.degraded.note(time.monotonic(), i.route, reason)
        self.gw.metrics.request_done(
            i.route if i else "none",
            state.value,
            reason or "none",
            time.monotonic() - self.started_s,
            self.completion_tokens,
        )
        return await self.gw.store_outcome(
            self.rid,
            state,
            **outcome.journaled(b"".join(self._kept)),
            route=i.route if i else None,
            attempts=self.exe.attempt,
            reason=reason,
            tokens_delivered=self.exe.sent_tokens() if self.req.stream else self.completion_tokens,
        )
