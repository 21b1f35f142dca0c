"""Fakes shared by the runtime tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from spillover.core.ledger import DeviceLedger
    from spillover.runtime.embeddings import EmbeddingsService


def ready_worker(wid: str, lane: str, slots: int = 1) -> WorkerClient:
    """A worker the scheduler sees as ready with ``slots`` slots (no process: nothing is sent to it)."""
    w = WorkerClient(WorkerSpec(wid, lane, "cpu", "", "", slots, 4096, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    return w


def embeddings_service(ledger: DeviceLedger) -> EmbeddingsService:
    """The default config's embeddings service on ``ledger``, its gateway a stand-in (no
    workers: a test sets ``gpu`` and ``cpu``)."""
    from spillover.config import load_config
    from spillover.runtime.embeddings import EmbeddingsService

    cfg = load_config()
    gw = SimpleNamespace(
        cfg=cfg,
        ledger=ledger,
        host=SimpleNamespace(observed_bytes=0, budget_bytes=1 << 40),
        kick_scheduler=lambda: None,
        note_event=lambda *a: None,
    )
    return EmbeddingsService(gw, cfg.services[0])  # type: ignore[arg-type]


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
