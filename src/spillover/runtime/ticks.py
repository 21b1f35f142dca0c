"""Periodic sleeps that share the event loop's wake-ups.

The gateway's periodic loops (the device reading, the host-memory reading, each worker's
health ping, the HTTP server's tick) each slept on a timer of its own, so an idle gateway
woke 25-35 times a second, each wake-up costing a few hundred microseconds of CPU on a
small machine (``benchmarks.request_cost`` prints the floor) and, at threads = cores, taken
from the engine. ``sleep`` ends on a common grid of ``TICK_S`` instead: every periodic sleep
due at the same grid point is woken by one timer, in one turn of the loop. The schedulers'
safety nets (a pass when no event came for 0.5 s) end on the grid too (rule 4).

Rules:

1. ``await sleep(period)`` returns at the first grid point (a multiple of ``TICK_S`` in the
   loop's clock) after now and at or after ``now + period - TICK_S / 2``: within half a tick
   of ``period``, or at the next grid point for a period under half a tick. It returns that
   grid point's loop time (what a caller measuring its own lateness compares against).
2. All sleeps of one event loop that end at the same grid point share one timer handle.
3. A cancelled sleep raises ``CancelledError`` as ``asyncio.sleep`` does and leaves the other
   sleeps of its grid point as they were.
4. ``at(period)`` is rule 1's grid point as a loop time, for a wait that is not a sleep (a
   safety net: ``asyncio.timeout_at(ticks.at(period))`` around an event's wait). Its timer
   fires in the same turn as the grid point's own (the loop's timers share its clock), so
   it adds no wake-up while a periodic sleep waits for that point, as the device reading's
   always does.
"""

from __future__ import annotations

import asyncio
import math
import weakref

__all__ = ["TICK_S", "at", "sleep"]

TICK_S = 0.1  # the grid: the device reading's own period


class _Ticker:
    """One event loop's grid points that some sleep waits for, each with its one timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[int, list[asyncio.Future[float]]] = {}

    def wait(self, period: float) -> asyncio.Future[float]:
        """Rule 1's grid point for ``period`` from now, as a future resolved then (rule 2)."""
        k = _point(self._loop.time(), period)
        fut: asyncio.Future[float] = self._loop.create_future()
        waiters = self._waiting.get(k)
        if waiters is None:
            self._waiting[k] = waiters = []
            self._loop.call_at(k * TICK_S, self._fire, k)
        waiters.append(fut)
        return fut

    def _fire(self, k: int) -> None:
        when = k * TICK_S
        for fut in self._waiting.pop(k, ()):
            if not fut.done():  # a cancelled sleep's future is done (rule 3)
                fut.set_result(when)


def _point(now: float, period: float) -> int:
    """Rule 1: the index of the grid point a wait of ``period`` from ``now`` ends at."""
    return max(math.ceil((now + period - TICK_S / 2) / TICK_S), math.floor(now / TICK_S) + 1)


def at(period: float) -> float:
    """Rule 4: the running loop's time of the grid point ``sleep(period)`` would end at."""
    return _point(asyncio.get_running_loop().time(), period) * TICK_S


_tickers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ticker] = weakref.WeakKeyDictionary()


async def sleep(period: float) -> float:
    """Rule 1: sleep about ``period`` seconds, waking with every other sleep due at the same
    grid point; the grid point's loop time."""
    loop = asyncio.get_running_loop()
    ticker = _tickers.get(loop)
    if ticker is None:
        _tickers[loop] = ticker = _Ticker(loop)
    return await ticker.wait(period)
