"""Fakes shared by the runtime tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState


def ready_worker(wid: str, lane: str, slots: int = 1) -> WorkerClient:
    """A worker the scheduler sees as ready with ``slots`` slots (no process: nothing is sent to it)."""
    w = WorkerClient(WorkerSpec(wid, lane, "cpu", "", "", slots, 4096, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    return w


def watch_timers(
    loop: asyncio.AbstractEventLoop,
    *,
    only: Callable[[Any], bool] = lambda cb: True,
    on_fire: Callable[[], None] | None = None,
    asked_at: list[float] | None = None,
) -> list[float]:
    """The times of the timers ``loop.call_at`` is asked for from now on (for callbacks that
    ``only`` accepts); ``on_fire`` runs just before each such timer's callback; ``asked_at``,
    when given, gets the loop's time at each such ask."""
    whens: list[float] = []
    real = loop.call_at

    def call_at(when: float, cb: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        if not only(cb):
            return real(when, cb, *args, **kw)
        whens.append(when)
        if asked_at is not None:
            asked_at.append(loop.time())
        if on_fire is None:
            return real(when, cb, *args, **kw)
        fire = on_fire
        return real(when, lambda *a: (fire(), cb(*a)), *args, **kw)

    loop.call_at = call_at  # type: ignore[method-assign]
    return whens
