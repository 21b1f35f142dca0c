"""A service or chat model whose workers all fail to start (a model file they cannot load, an
engine that aborts loading it) refuses its requests at once, naming each failure, and fails the
ones already queued: waiting would only end in a queue timeout that hides why, and a chat
model's refusal would read "The GPU is full". One ready worker, or one that has not failed, is
enough to keep taking requests."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import NoWorkerReady
from spillover.runtime.embeddings import EmbeddingsService
from spillover.runtime.scheduler import Job, Scheduler
from spillover.runtime.supervisor import cannot_start
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState
from tests.runtime.fakes import embeddings_service

MIB = 1024 * 1024


def _sup(lane: str, state: WorkerState, failure: str | None, *, parked: bool = False) -> SimpleNamespace:
    w = WorkerClient(WorkerSpec(f"emb-{lane}", lane, "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
    w.state = state
    # its next attempt in 4 s: the refusal's Retry-After
    return SimpleNamespace(worker=w, start_failure=failure, parked=parked, next_start_s=time.monotonic() + 4.0)


def _service(gpu: SimpleNamespace | None, cpu: SimpleNamespace | None) -> EmbeddingsService:
    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, 0.0)
    svc = embeddings_service(ledger)
    svc.gpu, svc.cpu = gpu, cpu  # type: ignore[assignment]
    return svc


DEAD, STARTING, READY = WorkerState.DEAD, WorkerState.STARTING, WorkerState.READY
BAD = "load_failed: InvalidProtobuf: the file is not ONNX"


@pytest.mark.parametrize(
    ("gpu", "cpu", "refused"),
    [
        ((DEAD, BAD), (DEAD, BAD), True),
        ((STARTING, BAD), (DEAD, "TimeoutError"), True),  # retrying after failing: still refused
        ((DEAD, BAD), (STARTING, None), False),  # the CPU worker has not failed (yet)
        ((DEAD, BAD), (READY, None), False),
        ((READY, None), (DEAD, BAD), False),
        (None, (DEAD, BAD), True),  # a service with only a CPU path
        ((DEAD, BAD, "parked"), (READY, None), False),
        ((DEAD, BAD, "parked"), (DEAD, BAD), True),  # a parked worker is not waited for
    ],
)
def test_a_request_is_refused_at_once_only_when_every_worker_that_may_run_failed_to_start(
    gpu: tuple[WorkerState, str | None] | tuple[WorkerState, str, str] | None,
    cpu: tuple[WorkerState, str | None],
    refused: bool,
) -> None:
    g = _sup("gpu", gpu[0], gpu[1], parked=len(gpu) == 3) if gpu else None
    svc = _service(g, _sup("cpu", cpu[0], cpu[1]))
    if not refused:
        svc.hold_place("r1")
        assert svc.promised == {"r1"}
        return
    with pytest.raises(NoWorkerReady) as got:
        svc.hold_place("r1")
    assert got.value.status == 503 and got.value.code == "model_load_failed" and 3.9 < got.value.retry_after_s <= 4.0
    failed = [s for s in (g, svc.cpu) if s is not None and not s.parked]
    for s in failed:
        assert f"{s.worker.spec.lane} worker: {s.start_failure}" in str(got.value)
    assert not svc.promised


def test_requests_queued_before_the_last_worker_failed_are_failed_with_why() -> None:
    async def main() -> None:
        g, c = _sup("gpu", DEAD, BAD), _sup("cpu", STARTING, None)
        svc = _service(g, c)
        tasks = [asyncio.create_task(svc._dispatch(f"r{i}", MIB, 1.0, avoid_gpu=False)) for i in range(2)]
        await asyncio.sleep(0)
        assert len(svc.queue) == 2 and not any(t.done() for t in tasks)
        c.worker.state, c.start_failure = DEAD, BAD
        svc.pump_once()
        for t in tasks:
            with pytest.raises(NoWorkerReady, match="cpu worker: load_failed"):
                await t
        assert not svc.queue
        c.worker.state, c.start_failure = READY, None  # a later start succeeded: requests are taken again
        svc.hold_place("r9")

    asyncio.run(main())


ABORTED = "exited: worker exited with code -6 (SIGABRT): ggml-backend.cpp:205: GGML_ASSERT(buffer) failed"


def _chat(memory: MemoryModel, gpu: SimpleNamespace, cpu: SimpleNamespace) -> Scheduler:
    """A chat model's scheduler, its refusal hook over its supervisors as the chat model sets it."""
    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, 0.0)
    s = Scheduler(
        gpu_lane=LaneConfig(slots=1, ctx_cap_tokens=512, queue_max_age_s=30.0),
        cpu_lane=LaneConfig(slots=1),
        ledger=ledger,
        policy=AdmissionPolicy(memory=memory, delay_max_s=2.0, allow_cpu_route=True),
    )
    s.gpu_workers.append(gpu.worker)
    s.cpu_workers.append(cpu.worker)
    s.cannot_start = lambda: cannot_start("chat model 'deci'", [gpu, cpu])  # type: ignore[list-item]
    return s


@pytest.mark.parametrize("lane", [None, "cpu"])
def test_a_chat_model_whose_workers_abort_at_load_refuses_with_why_not_gpu_full(
    memory: MemoryModel, lane: str | None
) -> None:
    async def main() -> None:
        g, c = _sup("gpu", STARTING, None), _sup("cpu", DEAD, ABORTED)
        s = _chat(memory, g, c)
        queued = Job(rid="q", prompt_tokens=20, max_tokens=8, arrived_s=0.0)
        s.submit_nowait(queued, lane=lane)  # the GPU worker is still starting: it waits
        assert not queued.future.done()
        g.worker.state, g.start_failure = DEAD, ABORTED  # its start aborted too
        s.hold_place("r1", lane)  # a place is still promised: the request's own errors come first (prepare)
        with pytest.raises(NoWorkerReady) as got:
            s.submit_nowait(Job(rid="r1", prompt_tokens=20, max_tokens=8, arrived_s=0.0), lane=lane)
        assert (
            got.value.code == "model_load_failed" and got.value.status == 503 and 3.9 < got.value.retry_after_s <= 4.0
        )
        assert (
            str(got.value)
            == f"chat model 'deci' has no worker that can start (gpu worker: {ABORTED}; cpu worker: {ABORTED})"
        )
        with pytest.raises(NoWorkerReady):
            s.submit_nowait(Job(rid="r2", prompt_tokens=20, max_tokens=8, arrived_s=0.0), lane=lane)
        s.pump_once()  # the queued one is failed with why, at once
        with pytest.raises(NoWorkerReady, match="GGML_ASSERT"):
            await queued.future
        assert not (s.gpu and s.gpu.queue) and not s.cpu.queue
        c.worker.state, c.start_failure = READY, None  # a later start succeeded: requests are taken again
        taken = Job(rid="r3", prompt_tokens=20, max_tokens=8, arrived_s=0.0)
        s.submit_nowait(taken, lane=lane)
        assert (await asyncio.wait_for(taken.future, 1)).route == "cpu"

    asyncio.run(main())
