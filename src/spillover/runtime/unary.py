"""Requests with one whole answer and no token stream (embeddings; transcription next): the
same ownership rules as a generation (``runtime.requests``), without the stream machinery.

Rules:

1. Accepted means journaled (ACCEPTED, fsync) before anything is queued; the Idempotency-Key
   rules are the request service's (one execution per key at a time; a finished key answers
   from the journal, byte for byte).
2. A ``UnaryRun`` owns the request from acceptance to its one terminal state, journaled with
   its whole answer (status, body, headers) before the answer is returned, on every path:
   done, an error, a bug, DELETE, the server stopping.
3. The endpoint's ``execute`` does the work and reports each step through ``on_move``
   (admitted, running, queued again for a failover), which the run journals.
4. After a restart an orphan is run again through its endpoint (its stored body), as for a
   generation; its answer is journaled for its key.
5. A streamed request (its endpoint's ``streams(req)``) answers with the frames its
   ``execute`` emits as it goes (SSE), the first one with the response headers. Until the
   first frame it is answered as a whole (an error before anything was sent keeps its own
   status). Once streaming, an error ends the stream with an error frame, and a client that
   goes away stops the request (resumable: ``outcomes.stopped``). What was sent, the last
   frame included, is journaled as its answer, so a retry with its Idempotency-Key gets the
   same bytes; one that ended resumable runs again. Its first frame's delivery is journaled
   before it is sent (``tokens_delivered``, as a generation's first token): a stream the
   gateway's restart finds unfinished after that is not run again (its client saw part of
   it), it ends ``failover_interrupted``, resumable with its key.
6. An answer the journal cannot take now (a full disk: ``Gateway.store_outcome`` keeps it, and
   writes it once it can) is not sent: the client gets ``journal_unavailable`` (503, or a
   stream's last frame), resumable, and its Idempotency-Key gets the answer once it is
   journaled. A gateway killed before that runs the request again, and no client acted on a
   first answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.core.lifecycle import State
from spillover.errors import RequestCancelled, RequestTimedOut, SpilloverError
from spillover.runtime.journal import NOTED
from spillover.runtime.outcomes import classify_error, not_durable, stopped
from spillover.runtime.run import Answer, Encoded, Frames, Streaming, as_error

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["UnaryEndpoint", "UnaryRun"]

log = logging.getLogger("spillover.request")

OnMove = Callable[[str, dict[str, Any]], Awaitable[None]]
Emit = Callable[[bytes, dict[str, str]], None]  # one streamed frame, and the headers it is sent under
SSE = "text/event-stream"
STOPPING_WAIT_S = 1.0  # ``_settle`` while the gateway stops its requests
DONE = b"data: [DONE]\n\n"  # a stream's end, after its last event (an error too)


@dataclass(frozen=True)
class UnaryEndpoint:
    """One route whose answer is a whole body (given by the HTTP layer).

    ``parse`` validates a body into a request (with its ``model``), or raises InvalidRequest;
    ``hold_place`` promises the request (by id) a place in its queue or raises QueueFull at
    once when none is left (or a CapacityError when the client's deadline, in seconds from
    now, cannot be met); ``release_place`` ends the promise (idempotent); ``execute``
    answers it (rule 3) or raises a SpilloverError, which ``error`` encodes. For a request
    that ``streams``, ``execute`` is given an ``Emit`` and returns the stream's last frames
    (rule 5)."""

    name: str
    kind: str
    parse: Callable[[Any], Any]
    stored: Callable[[dict[str, Any]], dict[str, Any]]
    hold_place: Callable[[Any, str, float | None], None]
    release_place: Callable[[Any, str], None]
    execute: Callable[[str, Any, int, OnMove, Emit | None], Coroutine[Any, Any, Encoded]]
    error: Callable[[SpilloverError, str], Encoded]
    streams: Callable[[Any], bool] = lambda req: False


@dataclass(eq=False)
class UnaryRun:
    """One accepted unary request while it runs (rule 2)."""

    gw: Gateway
    ep: UnaryEndpoint
    rid: str
    req: Any
    attempt: int = 0
    route: str | None = None
    reason: str | None = None  # why it runs on its route (its last move's), for /metrics
    started_s: float = field(default_factory=time.monotonic)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled_by_user: bool = False
    cancelled_early: bool = False  # cancelled before its work began: it never starts
    on_end: Callable[[], None] | None = None  # a streamed run's owner lets go of it (rule 5)
    unread: bool = False  # replayed after a restart with no client: nothing it streams is delivered
    _delivery_noted: bool = False
    _task: asyncio.Task[Encoded] | None = None
    _caller: asyncio.Task[Any] | None = None  # the task waiting for a non-streamed answer
    _woken: bool = False  # ``cancel`` woke it: the gateway stops its requests
    _sent: list[bytes] = field(default_factory=list)  # frames streamed so far (rule 5)
    _head: dict[str, str] | None = None
    _frames: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    _first: asyncio.Event = field(default_factory=asyncio.Event)

    def __repr__(self) -> str:
        return f"<UnaryRun {self.ep.name} {self.rid} route={self.route} attempt={self.attempt}>"

    def brief(self) -> dict[str, Any]:
        """Its line in /v1/status ``running``."""
        return {"rid": self.rid, "route": self.route, "attempt": self.attempt, "endpoint": self.ep.name}

    def cancel(self, *, by_user: bool = True) -> None:
        """DELETE /v1/requests/{id} (``by_user``), the client going away or the server stopping:
        the work stops; it ends CANCELLED after a DELETE, else resumable (``_cancelled``)."""
        self.cancelled_by_user = self.cancelled_by_user or by_user
        if self._task is not None:
            self._task.cancel()
        else:
            self.cancelled_early = True
        caller = self._caller
        if self.gw.stopping and not by_user and caller is not None and not caller.done():
            self._woken = True  # its client is answered now, not when the worker lets go (``_reply``)
            caller.cancel()

    def _cancelled(self) -> SpilloverError:
        """The error of work that was stopped: the DELETE's, else ``outcomes.stopped``."""
        if self.cancelled_by_user:
            return RequestCancelled(f"request {self.rid} was cancelled")
        return stopped(self.rid, server_stopping=self.gw.stopping)

    async def _move(self, state: str, fields: dict[str, Any]) -> None:
        if "route" in fields:
            self.route = fields["route"]
        if "reason" in fields:
            self.reason = str(fields["reason"])
        if "attempts" in fields:
            self.attempt = int(fields["attempts"])
        if self.gw.journal is None:
            return
        if (target := State(state)) in NOTED:  # an intermediate step: not waited for (journal rule 7)
            self.gw.journal.note_move(self.rid, target, **fields)
        else:
            await self.gw.journal.move(self.rid, target, **fields)

    @property
    def streaming(self) -> bool:
        return self.ep.streams(self.req)

    def _emit(self, frame: bytes, headers: dict[str, str]) -> None:
        """Rule 5: a frame to send now (the first one's headers are the response's)."""
        if self._head is None:
            self._head = dict(headers)
        self._sent.append(frame)
        self._frames.put_nowait(frame)
        self._first.set()

    async def reply(self) -> Answer | Streaming:
        """Run it to its end and journal the outcome before answering (rule 2); a streamed
        request answers once its first frame is out (rule 5). A streamed run's ``on_end``
        is called once it is over, whichever way it ends."""
        handed = False
        try:
            got = await self._reply()
            handed = isinstance(got, Streaming)
            return got
        finally:
            if self.streaming and not handed and self.on_end is not None:
                self.on_end()

    async def _reply(self) -> Answer | Streaming:
        if self.cancelled_early:  # a DELETE (or the gateway's stop) came while it was being queued
            return _answer(await asyncio.shield(self._settle(self._cancelled())))
        timeout_s = self.gw.cfg.server.request_timeout_s
        self._task = asyncio.create_task(self._bounded(timeout_s))
        try:
            if self.streaming:
                first = asyncio.create_task(self._first.wait())
                try:
                    await asyncio.wait({self._task, first}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    first.cancel()
                if self._first.is_set():
                    self.gw.loops.spawn(f"stream-{self.rid}", self._end_stream())
                    assert self._head is not None
                    return Streaming(self._head, Frames(self._stream(), self._reader_gone), SSE)
            self._caller = asyncio.current_task()  # woken by ``cancel`` only while it waits here
            try:
                outcome = await asyncio.shield(self._task)
            finally:
                self._caller = None
        except asyncio.CancelledError:
            me = asyncio.current_task()
            cancelled = self._cancelled()
            if self._woken and me is not None:  # the gateway stops its requests: its answer now
                me.uncancel()
                return _answer(await asyncio.shield(self._settle(cancelled)))
            if me is not None and me.cancelling():  # our caller is cancelled (the server stops)
                await asyncio.shield(self._settle(cancelled))
                raise
            return _answer(await asyncio.shield(self._settle(cancelled)))  # the work was (DELETE)
        except Exception as exc:  # the request's own error, or (a bug) a 500: journaled too
            err = RequestCancelled(f"request {self.rid} was cancelled") if self.cancelled_by_user else None
            return _answer(await asyncio.shield(self._settle(err or as_error(exc, self.rid))))
        if not await asyncio.shield(self._store(State.COMPLETED, outcome)):  # sent only once durable
            return _answer(self._error(not_durable(self.rid)))
        return _answer(outcome)

    async def _stream(self) -> AsyncGenerator[bytes, None]:
        """The frames as they come; the client going away stops the request (rule 5)."""
        try:
            while (frame := await self._frames.get()) is not None:
                await self._note_delivery()
                yield frame
        finally:
            await self._reader_gone()

    async def _note_delivery(self) -> None:
        """Rule 5: its first frame is about to reach the client: from now on it is not replayed
        after a restart (round 36: a streamed transcription whose first segment had reached its
        client was run again, and its key answered frames the client never saw). A note the
        journal cannot take leaves it replayable, as it was."""
        if self._delivery_noted or self.unread or self.gw.journal is None or self.ended.is_set():
            return  # (ended: its whole answer is journaled already, as it was sent)
        try:
            await self.gw.journal.update(self.rid, tokens_delivered=1)
            self._delivery_noted = True
        except Exception:  # a full disk, a journal closing: tried again with the next frame
            log.warning("request %s: a frame's delivery could not be journaled", self.rid, exc_info=True)

    async def _reader_gone(self) -> None:
        """Nobody reads the frames on (rule 5; ``Frames``): a run still going is stopped."""
        if not self.ended.is_set():
            self.cancel(by_user=False)

    async def _end_stream(self) -> None:
        """Rule 5: once the work ends, its last frames (or an error frame) are sent, and the
        whole stream is journaled; then the owner lets go of the run."""
        assert self._task is not None
        try:
            try:
                last = await asyncio.shield(self._task)
                state = State.COMPLETED
                err: SpilloverError | None = None
            except asyncio.CancelledError:
                err = self._cancelled()
            except Exception as exc:
                err = RequestCancelled(f"request {self.rid} was cancelled") if self.cancelled_by_user else None
                err = err or as_error(exc, self.rid)
            if err is not None:
                state = classify_error(err)
                last = self._error_frames(err)
            if not self._first.is_set():  # nothing was sent: the whole answer goes as usual
                await self._store(state, last)
                return
            # the stream's end tells its route and reason as the run ended (a failover's), its
            # first frame's headers as it began (round 23: the journal and /metrics said "fits")
            whole = Encoded(200, [*self._sent, *last.frames], (self._head or {}) | last.headers, SSE, last.error)
            if not await self._store(state, whole) and err is None:  # its end is sent only once durable
                last = self._error_frames(not_durable(self.rid))
            for frame in last.frames:
                self._frames.put_nowait(frame)
        finally:
            self._frames.put_nowait(None)
            if self.on_end is not None:
                self.on_end()

    def _error_frames(self, err: SpilloverError) -> Encoded:
        """A stream's last frames for ``err``: its error in OpenAI's shape, then ``[DONE]``."""
        body = self.ep.error(err, self.rid).error or {"error": {"message": err.message}}
        return Encoded(200, [b"data: " + json.dumps(body).encode() + b"\n\n", DONE], {}, SSE, body)

    async def _bounded(self, timeout_s: float) -> Encoded:
        """The work, within ``[server].request_timeout_s`` (a hung worker cannot hold it forever)."""
        emit = self._emit if self.streaming else None
        try:
            async with asyncio.timeout(timeout_s):
                return await self.ep.execute(self.rid, self.req, self.attempt, self._move, emit)
        except TimeoutError as exc:
            raise RequestTimedOut(f"request {self.rid} ran past request_timeout_s ({timeout_s:.0f}s)") from exc

    async def fail_now(self, err: SpilloverError) -> Answer:
        """End it before it ran (its QUEUED move could not be journaled): journaled, answered."""
        return _answer(await asyncio.shield(self._settle(err)))

    async def _settle(self, err: SpilloverError) -> Encoded:
        """The task has ended (or is made to); journal ``err`` as the outcome. While the gateway
        stops its requests the answer waits at most ``STOPPING_WAIT_S`` for the task (a GPU
        batch runs on until its worker lets go; the stop kills the workers after)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            if self.gw.stopping:
                self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, whenever
                await asyncio.wait({self._task}, timeout=STOPPING_WAIT_S)
            else:
                await asyncio.gather(self._task, return_exceptions=True)
        outcome = self._error(err)
        await self._store(classify_error(err), outcome)
        return outcome

    def _error(self, err: SpilloverError) -> Encoded:
        """``err`` as the whole answer; one that ran somewhere says where in its
        ``X-Spillover-Route``, as its record and chat's errors do (it said ``none``)."""
        outcome = self.ep.error(err, self.rid)
        if self.route is not None:
            outcome.headers["X-Spillover-Route"] = self.route
        return outcome

    async def _store(self, state: State, outcome: Encoded) -> bool:
        """Journal the outcome and count it; False when it is not durable yet."""
        try:
            self.gw.metrics.request_done(
                # An answer says its reason; an error (a cancel) not, and counts its route's, as chat's
                # does (round 31: a cancelled embeddings request was counted reason="none", route="gpu").
                self.route or "none", state.value,
                outcome.headers.get("X-Spillover-Reason") or (self.reason if self.route else None) or "none",
                time.monotonic() - self.started_s, 0,
            )  # fmt: skip
            if state is State.COMPLETED and self.route is not None:
                self.gw.degraded.note(time.monotonic(), self.route, outcome.headers.get("X-Spillover-Reason"))
            return await self.gw.store_outcome(
                self.rid,
                state,
                **outcome.journaled(b"".join(outcome.frames)),
                route=self.route,
                attempts=self.attempt,
                reason=outcome.headers.get("X-Spillover-Reason"),
            )
        finally:
            self.ended.set()


def _answer(o: Encoded) -> Answer:
    return Answer(o.status, b"".join(o.frames), o.headers, o.content_type)
