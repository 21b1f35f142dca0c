"""The embeddings service's lease: a request cancelled in the instant after it was dispatched
(slot claimed, device bytes reserved) gives both back; nobody is left holding them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from spillover.core.ledger import DeviceLedger
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState
from tests.runtime.fakes import embeddings_service

MIB = 1024 * 1024


def _ready_worker(wid: str, lane: str) -> WorkerClient:
    """A worker seen as ready with one slot (no process: nothing is sent to it)."""
    w = WorkerClient(WorkerSpec(wid, lane, "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    return w


def test_a_dispatch_cancelled_before_its_request_wakes_releases_slot_and_bytes() -> None:
    """GPU busy: the job waits; the slot frees and a pass dispatches it (slot claimed, bytes
    reserved), then its request is cancelled before it runs: both come back at once."""

    async def main() -> None:
        ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
        ledger.observe(0, 0.0)
        svc = embeddings_service(ledger)
        gpu = _ready_worker("emb-gpu", "gpu")
        svc.gpu = SimpleNamespace(worker=gpu, parked=False, start_failure=None)  # type: ignore[assignment]
        gpu.claim_slot("someone")
        task = asyncio.create_task(svc._dispatch("r1", 10 * MIB, 1.0, avoid_gpu=False))
        await asyncio.sleep(0)
        assert len(svc.queue) == 1 and not ledger.holds("r1")
        gpu.release_slot("someone")
        svc.pump_once()  # dispatched: the future holds a result, the task has not woken yet
        assert gpu.busy == 1 and ledger.holds("r1")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:  # pragma: no cover - the cancel must win
            raise AssertionError("the dispatch was not cancelled")
        assert gpu.busy == 0 and not ledger.holds("r1") and not svc.queue

    asyncio.run(main())


def test_the_stall_bound_grows_with_the_padded_tokens_and_the_workers_slots() -> None:
    """Rule 3's bound: each chunk of ``batch_size`` inputs counts as padded to its longest; the
    bound is ``STALL_FACTOR`` times their expected GPU time for each slot that may share the
    device, never below ``stall_timeout_s``."""
    from spillover.runtime.service import STALL_FACTOR

    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    svc = embeddings_service(ledger)
    msg = {"inputs": [[1] * 5, [1] * 20, [1] * 7], "batch_size": 2}
    assert svc.stall_units(msg, 1.0) == 2 * 20 + 1 * 7
    floor = svc.gw.cfg.failover.stall_timeout_s
    assert svc.stall_bound_s(47, 1) == floor  # a small request: the floor
    big = {"inputs": [[1] * 510] * 256, "batch_size": 32}
    units = svc.stall_units(big, 1.0)
    assert units == 256 * 510
    assert svc.stall_bound_s(units, 2) == STALL_FACTOR * svc.initial_stall_rate * units * 2 > floor
