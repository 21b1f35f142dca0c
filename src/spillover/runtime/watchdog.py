"""A time bound for one await among many, such as the wait for each streamed token.

``asyncio.timeout`` around every token makes a context object, looks up the task, and
schedules and cancels a timer handle each time: a measurable share of the gateway's CPU per
token. ``Watchdog`` keeps one timer for as long as the bound keeps moving forward: ``guard``
only moves the deadline, and a timer that fires before the current deadline re-arms itself
at it. Between guarded awaits the watchdog is disarmed, so it never cancels the task
anywhere else (for instance while it writes to a slow client).

Rules:

1. ``async with watchdog.guard(delay)`` raises ``TimeoutError`` when the block is still
   waiting ``delay`` seconds after it started (and at rule 4's look after), as
   ``asyncio.timeout(delay)`` does; a cancellation from elsewhere still propagates as
   ``CancelledError``.
2. Outside a ``guard`` block the watchdog never cancels anything.
3. ``close`` drops the timer (the watchdog may be guarded again afterwards).
4. A block's event that comes in time is not lost to a bound that runs out in the turn it is
   read. The loop runs due timers before (uvloop) or beside (asyncio) the I/O of the same turn,
   so a worker's line that arrived before the deadline, while the loop was busy, could meet
   the expired timer first: a token read as a stall, and a healthy worker killed. So a bound is
   enforced only at a second look, ``PENDING_GRACE_S`` after it ran out (one I/O poll between),
   and not while ``pending()`` (``guard(delay, pending)``) says the awaited event is queued
   for the block: then it looks again ``PENDING_GRACE_S`` later, by when the block has taken
   it and left.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

__all__ = ["PENDING_GRACE_S", "Watchdog"]

PENDING_GRACE_S = 0.01  # rule 4: how long an expired bound waits for a block whose event has come


class Watchdog:
    """One task's amortized time bound (see the module's rules)."""

    def __init__(self) -> None:
        self._deadline = math.inf  # loop time; inf while disarmed (rule 2)
        self._handle: asyncio.Handle | None = None
        self._when = math.inf  # the loop time the handle is set for: uvloop's call_at with a time
        # already past gives a plain Handle, which has no when()
        self._task: asyncio.Task[object] | None = None
        self._expired = False
        self._delay = 0.0
        self._cancelling = 0
        self._pending: Callable[[], bool] | None = None
        self._looked = False  # rule 4's first look at an expired deadline was taken

    def guard(self, delay: float, pending: Callable[[], bool] | None = None) -> Watchdog:
        """Rule 1 (and rule 4 with ``pending``) for the ``async with`` block that follows."""
        self._delay, self._pending = delay, pending
        return self

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "a watchdog guards a task"
        self._task, self._expired, self._cancelling, self._looked = task, False, task.cancelling(), False
        self._deadline = loop.time() + max(0.0, self._delay)
        if self._handle is None or self._when > self._deadline:
            if self._handle is not None:
                self._handle.cancel()
            self._handle, self._when = loop.call_at(self._deadline, self._fire), self._deadline

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        expired, self._deadline, self._expired, self._pending = self._expired, math.inf, False, None
        if expired:  # as asyncio.timeout: its own cancellation is taken back, another's stays
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _fire(self) -> None:
        self._handle = None
        if self._deadline == math.inf:  # disarmed: nothing to bound now (rule 2)
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:  # the deadline moved on since this timer was set
            self._handle, self._when = loop.call_at(self._deadline, self._fire), self._deadline
            return
        if not self._looked or (self._pending is not None and self._pending()):  # rule 4
            self._looked = True
            self._when = loop.time() + PENDING_GRACE_S
            self._handle = loop.call_at(self._when, self._fire)
            return
        self._expired = True
        assert self._task is not None
        self._task.cancel()

    def close(self) -> None:
        """Rule 3."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._deadline = math.inf
