"""The embeddings service's lease: a request cancelled in the instant after it was dispatched
(slot claimed, device bytes reserved) gives both back; nobody is left holding them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.core.ledger import DeviceLedger
from spillover.runtime.embeddings import EmbeddingsService
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState
from tests.runtime.fakes import embeddings_service

MIB = 1024 * 1024


def _ready_worker(wid: str, lane: str) -> WorkerClient:
    """A worker seen as ready with one slot (no process: nothing is sent to it)."""
    w = WorkerClient(WorkerSpec(wid, lane, "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    return w


def _working_worker(
    worker_id: str,
    stopped: asyncio.Future[None],
    interrupt: Callable[[str], object],
    kill: Callable[[str], Awaitable[None]],
) -> Any:
    """A stand-in worker whose attempt starts and works on: only its stop (``stopped``) ends it."""
    from spillover.runtime.events import Started

    async def request(_op: str, _msg: dict[str, object]):  # type: ignore[no-untyped-def]
        yield Started()
        await asyncio.Event().wait()
        yield Started()  # pragma: no cover

    return SimpleNamespace(
        request=request,
        has_event=lambda rid: False,
        interrupt=interrupt,
        when_stopped=lambda rid: None if stopped.done() else stopped,
        kill=kill,
        spec=SimpleNamespace(worker_id=worker_id, slots=1),
    )


async def _no_move(_state: str, _fields: dict[str, object]) -> None:
    return None


def _two_lanes() -> tuple[DeviceLedger, EmbeddingsService, WorkerClient, WorkerClient]:
    """The embeddings service on an empty 1 GiB device, its GPU and CPU workers ready, one slot each."""
    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, 0.0)
    svc = embeddings_service(ledger)
    gpu, cpu = _ready_worker("emb-gpu", "gpu"), _ready_worker("emb-cpu", "cpu")
    svc.gpu = SimpleNamespace(worker=gpu, parked=False, start_failure=None)  # type: ignore[assignment]
    svc.cpu = SimpleNamespace(worker=cpu, parked=False, start_failure=None)  # type: ignore[assignment]
    return ledger, svc, gpu, cpu


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
    assert svc._stall_rate["gpu"] == 0.0001
    svc._measured(0.05, 1000.0 - over)  # faster: a fifth of the way
    assert svc._stall_rate["gpu"] == 0.8 * 0.0001 + 0.2 * 0.00005
    svc._measured(5.0, 1000.0 - over)  # slower: at once
    assert svc._stall_rate["gpu"] == 0.005
    # A 1-input query is mostly fixed cost (3 ms here): its rate keeps a large chunk's bound
    # a few times that chunk's own time (50 us a unit here), not hundreds of seconds.
    fresh = embeddings_service(DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9))
    fresh._measured(0.003, chunk_units([[101, 7592, 102]]))
    assert fresh.stall_bound_s(big, 2) < 2 * STALL_FACTOR * 2 * 50e-6 * big


def test_a_transcriptions_stall_bound_covers_one_window_after_the_worker_says_what_it_heard() -> None:
    """Until the worker says what it heard, a wait covers all the audio (its decoding, the
    language's), in whole 30 s windows; after that and after every event (a segment, a
    window's progress: ``engine.transcribe_worker`` rule 4) one window. Round 70: a wait over
    all the audio after the last segment let a hung device run 305 s in a 600 s file."""
    from spillover.runtime.events import AudioInfo, Progress, Segment, Started
    from spillover.runtime.transcription import TranscriptionService

    steps = TranscriptionService.stall_steps(None, {}, 600.0)  # type: ignore[arg-type]
    assert steps.units == 600.0  # whole 30 s windows
    steps.after(Started())  # before the file is decoded: all of it still
    assert steps.units == 600.0
    steps.after(AudioInfo("en", 600.0))
    assert steps.units == 30.0
    steps.after(Progress(1))  # a window without speech: no segment, but its progress
    assert steps.units == 30.0
    steps.after(Segment({"end": 61.0, "text": " b"}))
    assert steps.units == 30.0
    # a cancelled attempt's worker may take the audio after the last segment to stop (rule 4;
    # round 71: one window's average could kill a healthy worker busy with a dense window)
    assert steps.stop_units == 540.0
    steps.after(Progress(3))
    assert steps.stop_units == 540.0 and steps.units == 30.0
    assert TranscriptionService.stall_steps(None, {}, 100.0).units == 120.0  # type: ignore[arg-type]
    assert TranscriptionService.stall_units(None, {}, 1.0) == 30.0  # type: ignore[arg-type]


FAKE_EMBED_WORKER = r"""
import base64, json, os, sys, time
print(json.dumps({"ev": "ready", "info": {"pid": os.getpid()}}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("op") != "embed":
        continue
    rid = msg["rid"]
    print(json.dumps({"ev": "started", "rid": rid}), flush=True)
    for i in range(60):  # a chunk every 20 ms
        time.sleep(0.02)
        print(json.dumps({"ev": "progress", "rid": rid, "done": i + 1}), flush=True)
    data = base64.b64encode(b"\0" * 16).decode()
    print(json.dumps({"ev": "vectors", "rid": rid, "n": 1, "dim": 4, "data": data}), flush=True)
    print(json.dumps({"ev": "done", "rid": rid, "finish_reason": "stop", "completion_tokens": 0}), flush=True)
"""


def test_progress_that_came_in_time_while_the_loop_was_busy_is_no_stall() -> None:
    """A GPU embeddings attempt whose worker reports a chunk every 20 ms, while the gateway's
    loop is busy past the attempt's stall bound (0.3 s). Those lines came in time: the attempt
    ends with its vectors and the worker is not killed. Before the service's bound was a
    ``Watchdog`` (rule 4), ``asyncio.timeout``'s expired timer ran first in the turn that read
    them: a stall, and a healthy worker killed."""
    import sys
    import time
    from dataclasses import dataclass

    from spillover.core.reasons import Reason
    from spillover.runtime.events import Done
    from spillover.runtime.service import _Dispatch

    @dataclass(frozen=True)
    class FakeSpec(WorkerSpec):
        def argv(self) -> list[str]:
            return [sys.executable, "-c", FAKE_EMBED_WORKER]

    moves: list[tuple[str, dict[str, object]]] = []

    async def main() -> tuple[object, list[str]]:
        ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
        svc = embeddings_service(ledger)
        killed: list[str] = []

        async def kill_worker(w: WorkerClient, why: str) -> None:
            killed.append(why)
            await w.kill()

        svc.gw.kill_worker = kill_worker  # type: ignore[attr-defined]
        svc.stall_bound_s = lambda units, slots: 0.3  # type: ignore[method-assign]
        worker = WorkerClient(FakeSpec("emb-gpu", "gpu", "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
        await worker.start(20)
        try:

            async def on_move(state: str, fields: dict[str, object]) -> None:
                moves.append((state, fields))
                if state == "running":  # while the attempt waits for its next chunk
                    asyncio.get_running_loop().call_later(0.1, time.sleep, 1.0)

            d = _Dispatch(worker, "gpu", Reason.FITS, 0)
            msg = {"inputs": [[101, 7, 102]] * 61, "batch_size": 1}  # 61 chunks: 60 progress lines, the last
            out = await svc._run_on(d, "r1", msg, 1.0, on_move, attempt=2)
        finally:
            await worker.stop()
        return out, killed

    out, killed = asyncio.run(main())
    assert not killed and isinstance(out, tuple) and isinstance(out[1], Done), out
    # round 23: a service's RUNNING move said neither its route nor its attempt (chat's says both)
    assert moves == [("running", {"route": "gpu", "attempts": 2})], moves


def test_a_second_cancel_while_the_worker_stops_the_first_does_not_kill_the_worker() -> None:
    """A DELETE, then a second DELETE (or the client leaving, or the request's timeout) while
    the attempt waits for its worker to let go of the first cancel: the wait goes on (rule 4's
    bound, ``STOP_WAIT_S``), the worker is not killed as hung (its other requests would fail),
    and the lease comes back once the worker has stopped the request."""
    from spillover.core.reasons import Reason
    from spillover.runtime.service import _Dispatch

    async def main() -> None:
        ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
        ledger.observe(0, 0.0)
        svc = embeddings_service(ledger)
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = loop.create_future()
        kills: list[str] = []
        interrupts: list[str] = []

        async def kill(why: str) -> None:
            kills.append(why)

        worker = _working_worker("emb-cpu", stopped, interrupts.append, kill)
        d = _Dispatch(worker, "cpu", Reason.CPU_LANE, 0)
        task = asyncio.create_task(svc._run_on(d, "r1", {"inputs": [[1, 2]], "batch_size": 1}, 1.0, _no_move))
        await asyncio.sleep(0.01)
        task.cancel()  # the first DELETE: the worker is told to stop
        await asyncio.sleep(0.01)
        assert interrupts == ["r1"] and not task.done()
        task.cancel()  # the second, while the attempt waits for the worker
        await asyncio.sleep(0.05)
        assert not task.done() and kills == []  # still waiting: nothing is killed
        stopped.set_result(None)  # the worker lets go
        try:
            await asyncio.wait_for(task, 1.0)
        except asyncio.CancelledError:
            pass
        else:  # pragma: no cover - the cancel must win
            raise AssertionError("the attempt was not cancelled")
        assert kills == []

    asyncio.run(main())


def test_a_failover_the_busy_cpu_lane_does_not_start_goes_back_to_the_restarted_gpu_once() -> None:
    """Rule 3 (round 28): a failover waits for the CPU lane (its slot busy); once it has waited
    ``delay_max_s`` there, the restarted GPU worker, idle, takes it rather than let it wait
    for its queue_timeout. Not sooner, and not when it may not return (after a stall, a
    second time in its run, or on the run's last attempt: ``returns``)."""
    from spillover.runtime.scheduler import RETURN_AFTER_MIN_S

    async def main() -> None:
        ledger, svc, gpu, cpu = _two_lanes()
        cpu.claim_slot("someone")  # the CPU lane is busy
        wait = max(svc.gw.cfg.admission.delay_max_s, RETURN_AFTER_MIN_S)
        for returns in (False, True):
            task = asyncio.create_task(svc._dispatch("r1", MIB, 1.0, avoid_gpu=True, returns=returns))
            await asyncio.sleep(0)
            assert [j.rid for j in svc.queue] == ["r1"] and not task.done()  # the GPU is not for it yet
            svc.queue[0].enqueued_s -= wait - 0.05  # not yet
            svc.pump_once()
            await asyncio.sleep(0)
            assert not task.done()
            svc.queue[0].enqueued_s -= 0.1  # past it
            svc.pump_once()
            await asyncio.sleep(0)
            if not returns:
                assert not task.done() and gpu.busy == 0  # it waits for the CPU lane
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                continue
            d = await task
            assert d.lane == "gpu" and gpu.busy == 1 and ledger.holds("r1")
            svc._release("r1", d)
        assert gpu.busy == 0 and not ledger.holds("r1") and not svc.queue

    asyncio.run(main())


@pytest.mark.parametrize(
    ("faults", "asked"),
    [
        # each attempt's lane and how it fails (None: done); what each dispatch may do (avoid_gpu, returns)
        ([("gpu", "crash"), ("gpu", "oom"), ("cpu", None)], [(False, False), (True, True), (True, False)]),
        ([("gpu", "stall"), ("cpu", None)], [(False, False), (True, False)]),  # a stall: never back
        ([("gpu", "crash"), ("cpu", None)], [(False, False), (True, True)]),
    ],
)
def test_a_run_lets_a_failover_return_to_the_gpu_once_never_after_a_stall_nor_on_its_last_attempt(
    faults: list[tuple[str, str | None]], asked: list[tuple[bool, bool]]
) -> None:
    from spillover.core.reasons import Reason
    from spillover.runtime.events import Done
    from spillover.runtime.service import _Dispatch

    async def main() -> None:
        svc = embeddings_service(DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9))
        svc.gw.budget = SimpleNamespace(take=lambda: True)  # type: ignore[attr-defined]
        svc.gw.metrics = SimpleNamespace(failovers=SimpleNamespace(labels=lambda k: SimpleNamespace(inc=lambda: 0)))  # type: ignore[attr-defined]
        svc.cpu = SimpleNamespace(worker=_ready_worker("emb-cpu", "cpu"))  # type: ignore[assignment]
        script = iter(faults)
        seen: list[tuple[bool, bool]] = []

        async def dispatch(rid: str, nbytes: int, work: float, *, avoid_gpu: bool, returns: bool) -> _Dispatch:
            seen.append((avoid_gpu, returns))
            lane, fault = next(script)
            dispatch.fault = fault  # type: ignore[attr-defined]
            return _Dispatch(_ready_worker(f"emb-{lane}", lane), lane, Reason.FITS, 0)

        async def run_on(d: _Dispatch, *a: object, **k: object) -> object:
            fault = dispatch.fault  # type: ignore[attr-defined]
            return ([], Done("stop", 0, 0.0, 0.0)) if fault is None else (fault, "it failed")

        async def on_move(_state: str, _fields: dict[str, object]) -> None:
            return None

        svc._dispatch = dispatch  # type: ignore[method-assign]
        svc._run_on = run_on  # type: ignore[assignment,method-assign]
        got = await svc.serve("r1", {}, nbytes=MIB, work=1.0, attempt=0, on_move=on_move)
        assert got.lane == "cpu" and got.attempts == len(faults)
        assert seen == asked

    asyncio.run(main())


@pytest.mark.parametrize(("kind", "counted"), [("bad_audio", False), ("engine", True), ("oom", True)])
def test_a_requests_own_fault_on_the_gpu_does_not_feed_its_breaker(kind: str, counted: bool) -> None:
    """Round 28: a transcription whose audio the GPU worker cannot decode (``bad_audio``: the
    client's fault, a 400) counted as a GPU failure for the breaker, so a few bad uploads
    could open it and push the service onto its CPU path. A lane's own failure still counts."""
    from spillover.core.reasons import Reason
    from spillover.runtime.events import Failed, Started
    from spillover.runtime.service import _Dispatch

    async def main() -> bool:
        svc = embeddings_service(DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9))
        before = svc.breaker

        async def request(_op: str, _msg: dict[str, object]):  # type: ignore[no-untyped-def]
            yield Started()
            yield Failed(kind, "it failed")

        worker = SimpleNamespace(
            request=request,
            has_event=lambda rid: False,
            interrupt=lambda rid: None,
            when_stopped=lambda rid: None,
            spec=SimpleNamespace(worker_id="emb-gpu", slots=1),
        )
        d = _Dispatch(worker, "gpu", Reason.FITS, 0)  # type: ignore[arg-type]

        async def on_move(_state: str, _fields: dict[str, object]) -> None:
            return None

        got = await svc._run_on(d, "r1", {"inputs": [[1, 2]], "batch_size": 1}, 1.0, on_move)
        assert got == (kind, "it failed")
        return svc.breaker != before

    assert asyncio.run(main()) is counted


def test_the_queue_holds_no_more_than_its_depth_while_the_gpu_cannot_take_a_job() -> None:
    """Round 28: every free GPU slot counted as a place a job would leave the queue through,
    even with the GPU's breaker open (or no room on the device): the queue then held
    ``queue_depth`` + the GPU's slots, all waiting for the CPU. A GPU that cannot take one
    adds no place; once it can, its free slot is a place again."""
    import time

    from spillover.core.breaker import BreakerState, Circuit
    from spillover.errors import QueueFull

    async def main() -> None:
        _, svc, _, cpu = _two_lanes()
        cpu.claim_slot("someone")
        svc.breaker = BreakerState(circuit=Circuit.OPEN, opened_at_s=time.monotonic(), cooldown_s=100, opens=1)
        depth = svc.cfg.queue_depth
        for i in range(depth):
            svc.hold_place(f"r{i}", nbytes=MIB)
        with pytest.raises(QueueFull):
            svc.hold_place("one-more", nbytes=MIB)  # the GPU's free slot is no way out now
        svc.breaker = BreakerState()
        svc.hold_place("one-more", nbytes=MIB)  # closed: its free slot is a place again
        with pytest.raises(QueueFull):
            svc.hold_place("two-more", nbytes=MIB)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("lane", "stops_after_s", "killed"),
    [
        ("gpu", 0.2, False),  # past STOP_WAIT_S, within the stall bound: busy, not hung
        ("gpu", None, True),  # never stops: hung, killed at the stall bound
        ("cpu", 0.45, False),  # past the GPU's, within the CPU lane's (twice as slow)
        ("cpu", None, True),
    ],
)
def test_a_cancelled_attempt_s_worker_has_as_long_to_stop_as_its_next_event_may_take(
    monkeypatch: pytest.MonkeyPatch, lane: str, stops_after_s: float | None, killed: bool
) -> None:
    """Round 31: a worker looks for a cancel between its events (a transcription's segments come
    a 30 s window at a time). A cancel waited a fixed ``STOP_WAIT_S`` for its stop, then killed
    the worker as hung: under load one window took longer, and every other request on the
    worker failed over as a stall. It now waits as long as the next event may take at its lane's
    speed (within ``STOP_WAIT_S`` and ``STOP_WAIT_MAX_S``) before it calls the worker hung."""
    import spillover.runtime.service as service
    from spillover.core.reasons import Reason
    from spillover.runtime.embeddings import chunk_units
    from spillover.runtime.service import _Dispatch

    monkeypatch.setattr(service, "STOP_WAIT_S", 0.05)
    monkeypatch.setattr(service, "STOP_WAIT_MAX_S", 2.0)

    async def main() -> list[str]:
        ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
        svc = embeddings_service(ledger)
        units = chunk_units([[1, 2]]) + svc.stall_overhead_units  # the request's one chunk
        gpu_rate = 0.3 / (service.STALL_FACTOR * units)  # the GPU's stop bound: 0.3 s
        svc._stall_rate = {"gpu": gpu_rate, "cpu": 2 * gpu_rate}  # the CPU's: 0.6 s
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = loop.create_future()
        kills: list[str] = []

        async def kill(why: str) -> None:
            kills.append(why)
            if not stopped.done():
                stopped.set_result(None)  # its exit lets go of the request

        def interrupt(rid: str) -> None:
            if stops_after_s is not None:
                loop.call_later(stops_after_s, lambda: stopped.done() or stopped.set_result(None))

        d = _Dispatch(_working_worker(f"emb-{lane}", stopped, interrupt, kill), lane, Reason.FITS, 0)
        assert svc.stop_bound_s(d, 0) >= service.STOP_WAIT_S  # within the floor and the ceiling
        assert svc.stop_bound_s(d, 1e12) == service.STOP_WAIT_MAX_S
        svc.gw.note_event = lambda *_a: None  # type: ignore[method-assign]
        task = asyncio.create_task(svc._run_on(d, "r1", {"inputs": [[1, 2]], "batch_size": 1}, 1.0, _no_move))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return kills

    assert asyncio.run(main()) == (["hung"] if killed else [])


def test_a_deadline_the_request_alone_overruns_is_refused_without_a_retry() -> None:
    """Round 70: a deadline the request alone overruns, with nothing ahead of it, was a
    retryable 503 with Retry-After (the openai SDK retried a 1 ms deadline for 50 s). It is
    said only on every lane's measured speeds (round 71: the first guess, or a speed counted a
    request at a time as an embedding's is, refused a feasible deadline for good); with work
    ahead, the refusal still says when to retry."""
    from spillover.errors import CapacityError, DeadlineTooShort, to_http

    def refusal(svc: EmbeddingsService, deadline_s: float) -> CapacityError | DeadlineTooShort:
        with pytest.raises((CapacityError, DeadlineTooShort)) as e:
            svc.hold_place("r", nbytes=MIB, work=10.0, deadline_s=deadline_s)
        return e.value

    async def main() -> None:
        _, svc, gpu, _ = _two_lanes()
        assert isinstance(refusal(svc, 0.001), CapacityError)  # a request's work: not its size
        svc.work_is_size = True  # as a transcription's (its seconds)
        assert isinstance(refusal(svc, 0.001), CapacityError)  # no lane measured: a guess
        svc._fastest["gpu"].extend([0.09, 0.05])
        assert isinstance(refusal(svc, 0.001), CapacityError)  # the CPU lane not measured
        svc._fastest["cpu"].append(0.2)
        alone = refusal(svc, 0.001)
        assert isinstance(alone, DeadlineTooShort)
        http = to_http(alone)
        assert http.status == 503 and http.body["error"]["code"] == "deadline_exceeded"
        assert http.headers["x-should-retry"] == "false" and "Retry-After" not in http.headers
        assert http.headers["X-Spillover-Reason"] == "deadline_exceeded"
        assert "even with nothing ahead" in http.body["error"]["message"]
        assert "0.5s" in http.body["error"]["detail"]  # 10 units at the fastest measured 0.05
        svc.hold_place("r2", nbytes=MIB, work=10.0, deadline_s=svc.lane_eta_s("gpu", 10.0) * 1.5)  # in time
        svc.release_place("r2")
        gpu.claim_slot("busy")
        svc._running_work["busy"] = 100.0  # a long request ahead of it on the GPU
        queued = refusal(svc, 0.6)  # alone in 0.5 s: a retry may meet it
        assert not isinstance(queued, DeadlineTooShort) and to_http(queued).headers["x-should-retry"] == "true"

    asyncio.run(main())
