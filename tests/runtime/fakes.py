"""Fakes shared by the runtime tests."""

from __future__ import annotations

from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState


def ready_worker(wid: str, lane: str, slots: int = 1) -> WorkerClient:
    """A worker the scheduler sees as ready with ``slots`` slots (no process: nothing is sent to it)."""
    w = WorkerClient(WorkerSpec(wid, lane, "cpu", "", "", slots, 4096, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    return w
