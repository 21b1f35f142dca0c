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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.core.lifecycle import State
from spillover.errors import RequestCancelled, RequestTimedOut, SpilloverError
from spillover.runtime.outcomes import classify_error
from spillover.runtime.run import Answer, Encoded, as_error

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["UnaryEndpoint", "UnaryRun"]

log = logging.getLogger("spillover.request")

OnMove = Callable[[str, dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class UnaryEndpoint:
    """One route whose answer is a whole body (given by the HTTP layer).

    ``parse`` validates a body into a request (with its ``model``), or raises InvalidRequest;
    ``hold_place`` promises the request (by id) a place in its queue or raises QueueFull at
    once when none is left (or a CapacityError when the client's deadline, in seconds from
    now, cannot be met); ``release_place`` ends the promise (idempotent); ``execute``
    answers it (rule 3) or raises a SpilloverError, which ``error`` encodes."""

    name: str
    kind: str
    parse: Callable[[Any], Any]
    stored: Callable[[dict[str, Any]], dict[str, Any]]
    hold_place: Callable[[Any, str, float | None], None]
    release_place: Callable[[Any, str], None]
    execute: Callable[[str, Any, int, OnMove], Coroutine[Any, Any, Encoded]]
    error: Callable[[SpilloverError, str], Encoded]


@dataclass(eq=False)
class UnaryRun:
    """One accepted unary request while it runs (rule 2)."""

    gw: Gateway
    ep: UnaryEndpoint
    rid: str
    req: Any
    attempt: int = 0
    route: str | None = None
    started_s: float = field(default_factory=time.monotonic)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled_by_user: bool = False
    _task: asyncio.Task[Encoded] | None = None

    def __repr__(self) -> str:
        return f"<UnaryRun {self.ep.name} {self.rid} route={self.route} attempt={self.attempt}>"

    def brief(self) -> dict[str, Any]:
        """Its line in /v1/status ``running``."""
        return {"rid": self.rid, "route": self.route, "attempt": self.attempt, "endpoint": self.ep.name}

    def cancel(self) -> None:
        """DELETE /v1/requests/{id}, or the server stopping: the work stops; it ends CANCELLED."""
        self.cancelled_by_user = True
        if self._task is not None:
            self._task.cancel()

    async def _move(self, state: str, fields: dict[str, Any]) -> None:
        if "route" in fields:
            self.route = fields["route"]
        if "attempts" in fields:
            self.attempt = int(fields["attempts"])
        if self.gw.journal is not None:
            await self.gw.journal.move(self.rid, State(state), **fields)

    async def reply(self) -> Answer:
        """Run it to its end and journal the outcome before answering (rule 2)."""
        if self.cancelled_by_user:  # DELETE came while it was being queued
            return _answer(await asyncio.shield(self._settle(RequestCancelled(f"request {self.rid} was cancelled"))))
        timeout_s = self.gw.cfg.server.request_timeout_s
        self._task = asyncio.create_task(self._bounded(timeout_s))
        try:
            outcome = await asyncio.shield(self._task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            cancelled = RequestCancelled(f"request {self.rid} was cancelled")
            if me is not None and me.cancelling():  # our caller is cancelled (the server stops)
                await asyncio.shield(self._settle(cancelled))
                raise
            return _answer(await asyncio.shield(self._settle(cancelled)))  # the work was (DELETE)
        except Exception as exc:  # the request's own error, or (a bug) a 500: journaled too
            err = RequestCancelled(f"request {self.rid} was cancelled") if self.cancelled_by_user else None
            return _answer(await asyncio.shield(self._settle(err or as_error(exc, self.rid))))
        await asyncio.shield(self._store(State.COMPLETED, outcome))
        return _answer(outcome)

    async def _bounded(self, timeout_s: float) -> Encoded:
        """The work, within ``[server].request_timeout_s`` (a hung worker cannot hold it forever)."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self.ep.execute(self.rid, self.req, self.attempt, self._move)
        except TimeoutError as exc:
            raise RequestTimedOut(f"request {self.rid} ran past request_timeout_s ({timeout_s:.0f}s)") from exc

    async def fail_now(self, err: SpilloverError) -> Answer:
        """End it before it ran (its QUEUED move could not be journaled): journaled, answered."""
        return _answer(await asyncio.shield(self._settle(err)))

    async def _settle(self, err: SpilloverError) -> Encoded:
        """The task has ended (or is made to); journal ``err`` as the outcome."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        outcome = self.ep.error(err, self.rid)
        await self._store(classify_error(err), outcome)
        return outcome

    async def _store(self, state: State, outcome: Encoded) -> None:
        try:
            self.gw.metrics.request_done(
                self.route or "none", state.value, outcome.headers.get("X-Spillover-Reason", "none"),
                time.monotonic() - self.started_s, 0,
            )  # fmt: skip
            if state is State.COMPLETED and self.route is not None:
                self.gw.degraded.note(time.monotonic(), self.route, outcome.headers.get("X-Spillover-Reason"))
            await self.gw.store_outcome(
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
