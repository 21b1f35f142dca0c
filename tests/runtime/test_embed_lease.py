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


def test_the_stall_bound_covers_the_next_chunk_at_a_rate_that_errs_long() -> None:
    """Rule 3's bound for an embeddings attempt: each wait covers the chunk the worker computes
    before its next event (the first, then the one after each ``Progress``), in units that grow
    faster than its padded tokens; ``STALL_FACTOR`` times their time at the GPU's rate, for each
    slot that may share the device, never below ``stall_timeout_s``. The first attempt's rate
    replaces the guess; then it rises at once to a slower one's and falls a fifth of the way
    to a faster one's."""
    from spillover.runtime.embeddings import ATTENTION_TOKENS, chunk_units
    from spillover.runtime.events import Progress, Started
    from spillover.runtime.service import STALL_FACTOR

    svc = embeddings_service(DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9))
    assert chunk_units([[1] * 5, [1] * 20]) == 2 * 20 * (1 + 20 / ATTENTION_TOKENS)  # padded to its longest
    assert chunk_units([[1] * 510]) / chunk_units([[1] * 51]) > 10 * 4  # a long token costs more
    msg = {"inputs": [[1] * 5, [1] * 20, [1] * 7], "batch_size": 2}
    assert svc.stall_units(msg, 1.0) == chunk_units([[1] * 5, [1] * 20]) + chunk_units([[1] * 7])
    steps = svc.stall_steps(msg, 1.0)
    assert steps.units == chunk_units([[1] * 5, [1] * 20])
    steps.after(Started())
    assert steps.units == chunk_units([[1] * 5, [1] * 20])
    steps.after(Progress(2))
    assert steps.units == chunk_units([[1] * 7])
    floor = svc.gw.cfg.failover.stall_timeout_s
    assert svc.stall_bound_s(steps.units, 1) == floor  # a small chunk: the floor
    big = chunk_units([[1] * 510] * 32)
    over = svc.stall_overhead_units  # a request's fixed cost, in units
    assert svc.stall_bound_s(big, 2) == STALL_FACTOR * svc.initial_stall_rate * (big + over) * 2 > floor
    svc._measured(0.1, 1000.0 - over)  # the first measurement replaces the initial guess
    assert svc._stall_rate == 0.0001
    svc._measured(0.05, 1000.0 - over)  # faster: a fifth of the way
    assert svc._stall_rate == 0.8 * 0.0001 + 0.2 * 0.00005
    svc._measured(5.0, 1000.0 - over)  # slower: at once
    assert svc._stall_rate == 0.005
    # A 1-input query is mostly fixed cost (3 ms here): its rate keeps a large chunk's bound
    # a few times that chunk's own time (50 us a unit here), not hundreds of seconds.
    fresh = embeddings_service(DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9))
    fresh._measured(0.003, chunk_units([[101, 7592, 102]]))
    assert fresh.stall_bound_s(big, 2) < 2 * STALL_FACTOR * 2 * 50e-6 * big


def test_a_transcriptions_stall_bound_covers_the_audio_after_its_last_segment() -> None:
    """Until the audio is decoded a wait covers all of it (its header's length, then the decoded
    one); after each segment, the audio after that segment's end; in whole 30 s windows, at
    least one (Whisper pads the last)."""
    from spillover.runtime.events import AudioInfo, Segment
    from spillover.runtime.transcription import TranscriptionService

    steps = TranscriptionService.stall_steps(None, {}, 100.0)  # type: ignore[arg-type]
    assert steps.units == 120.0  # whole 30 s windows
    steps.after(AudioInfo("en", 90.0))
    assert steps.units == 90.0
    steps.after(Segment({"end": 30.0, "text": " a"}))
    assert steps.units == 60.0
    steps.after(Segment({"end": 61.0, "text": " b"}))
    assert steps.units == 30.0
    steps.after(Segment({"end": 95.0, "text": " c"}))  # past the end: the last window still runs
    assert steps.units == 30.0
    steps.after(Segment({"text": " no end"}))
    assert steps.units == 30.0
    assert TranscriptionService.stall_units(None, {}, 1.0) == 30.0  # type: ignore[arg-type]
