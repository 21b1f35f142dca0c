"""Places promised while requests are accepted: a request that finds every place of its lane
taken or promised is refused at once (before tokenizing or journaling), and a promise ends
exactly when its job is queued or its request ends."""

from __future__ import annotations

import asyncio

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import CapacityError, QueueFull
from spillover.runtime.lanes import places_promised
from spillover.runtime.scheduler import Job, Scheduler
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState
from spillover.testing import FakeClock
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024


def _cpu_only(depth: int, slots: int) -> tuple[Scheduler, WorkerClient]:
    s = Scheduler(gpu_lane=None, cpu_lane=LaneConfig(slots=slots, queue_depth=depth), ledger=None, policy=None)
    w = WorkerClient(WorkerSpec("cpu0", "cpu", "cpu", "", "", slots, 4096, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    s.cpu_workers.append(w)
    return s, w


@pytest.mark.parametrize(
    ("depth", "queued", "promised", "takers", "full"),
    [
        (3, 0, 3, 1, False),  # the fourth place is the free slot
        (3, 0, 4, 1, True),
        (3, 3, 0, 0, True),
        (3, 2, 0, 0, False),
        (0, 0, 0, 1, False),  # no queue, one free slot
        (0, 0, 1, 1, True),
        (3, 1, 1, 0, False),
    ],
)
def test_places_promised_counts_queue_promises_and_free_slots(
    depth: int, queued: int, promised: int, takers: int, full: bool
) -> None:
    assert places_promised(depth, queued, promised, takers) is full


def test_concurrent_acceptances_are_promised_exactly_queue_plus_free_slots() -> None:
    """Depth 3, one free slot: four requests being accepted at once hold every place; the
    fifth is refused at once (counted as shed). Queuing a job ends its promise; a request
    that ends before queuing gives its place back."""

    async def main() -> None:
        s, _w = _cpu_only(depth=3, slots=1)
        for i in range(4):
            s.hold_place(f"r{i}")
        with pytest.raises(QueueFull):
            s.hold_place("r4")
        assert s.cpu.shed_total == 1 and s.cpu.promised == {"r0", "r1", "r2", "r3"}
        s.release_place("r3")  # it failed validation while tokenizing
        s.release_place("r3")  # idempotent
        s.hold_place("r5")
        jobs = [Job(rid=r, prompt_tokens=8, max_tokens=8, arrived_s=0.0) for r in ("r0", "r1", "r2", "r5")]
        for j in jobs:
            s.submit_nowait(j)
        assert not s.cpu.promised
        assert jobs[0].future.done() and len(s.cpu.queue) == 3  # one runs, three wait: exact
        with pytest.raises(QueueFull):
            s.hold_place("r6")
        assert s.cpu.shed_total == 2

    asyncio.run(main())


def test_a_promise_does_not_count_against_its_own_job() -> None:
    """The last promised place: its own job is queued, not refused by its own promise."""

    async def main() -> None:
        s, w = _cpu_only(depth=1, slots=1)
        w.claim_slot("busy")
        s.hold_place("a")
        with pytest.raises(QueueFull):
            s.hold_place("b")
        s.submit_nowait(Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=0.0))
        assert [j.rid for j in s.cpu.queue] == ["a"] and not s.cpu.promised

    asyncio.run(main())


def test_the_cpu_profiles_gpu_lane_sheds_with_the_cpu_lanes_eta_and_each_lane_counts_its_own(
    memory: MemoryModel,
) -> None:
    """The ``cpu`` profile: a GPU lane without a worker of its own hands every job to the CPU
    lane. When its places run out its refusal's Retry-After is the CPU lane's ETA (it said 1 s
    while the CPU lane needed 6 to 9), and a job refused because the CPU queue is full counts
    as the CPU lane's shed (the GPU lane counted all of them)."""

    async def main() -> None:
        clock = FakeClock(100.0)
        ledger = DeviceLedger("sim", 60 * MIB, 16 * MIB, freshness_s=1e9)  # not one layer fits
        ledger.observe(0, clock())
        s = Scheduler(
            gpu_lane=LaneConfig(slots=1, queue_depth=1),
            cpu_lane=LaneConfig(slots=1, queue_depth=2),
            ledger=ledger,
            policy=AdmissionPolicy(memory=memory, delay_max_s=2.0),
            clock=clock,
        )
        cpu = ready_worker("cpu0", "cpu")
        s.cpu_workers.append(cpu)
        cpu.claim_slot("running")
        for rid in ("q1", "q2"):  # the CPU queue full, with minutes of work ahead
            queued = Job(rid=rid, prompt_tokens=64, max_tokens=1000, arrived_s=clock())
            queued.enqueued_s = clock()
            s.cpu.append(queued, clock())
        eta = s.cpu.estimated_delay_s(clock())
        assert eta > 5
        job = Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(job)  # the GPU lane: admission routes it to the full CPU lane
        with pytest.raises(CapacityError) as refused:
            await asyncio.wait_for(job.future, 1)
        assert refused.value.code == "cpu_queue_full"
        assert (s.cpu.shed_total, s.gpu.shed_total) == (1, 0)
        s.hold_place("b")  # the GPU lane's one place
        with pytest.raises(QueueFull) as full:
            s.hold_place("c")
        assert full.value.retry_after_s >= eta and s.gpu.shed_total == 1

    asyncio.run(main())


def _gpu_and_cpu(
    memory: MemoryModel, gpu_lane: LaneConfig, cpu_lane: LaneConfig
) -> tuple[Scheduler, WorkerClient, WorkerClient]:
    """A scheduler on a 1 GiB device with a ready GPU worker and a ready CPU worker."""
    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    policy = AdmissionPolicy(memory=memory, delay_max_s=2.0)
    s = Scheduler(gpu_lane=gpu_lane, cpu_lane=cpu_lane, ledger=ledger, policy=policy)
    gpu, cpu = ready_worker("gpu0", "gpu"), ready_worker("cpu0", "cpu")
    s.gpu_workers.append(gpu)
    s.cpu_workers.append(cpu)
    return s, gpu, cpu


def test_a_full_gpu_queue_spills_over_to_the_cpu_lane_before_it_refuses(memory: MemoryModel) -> None:
    """Round 45b: 22 of 40 requests got 503 queue_full at once while the CPU lane stood idle.
    A request that finds no place on the GPU lane is promised one on the CPU lane (it starts
    there, ``gpu_queue_full``, movable to the GPU by late binding); with no place there either
    it is refused as before. A client's own ``prefer: cpu`` is not a spill."""

    async def main() -> None:
        s, gpu, cpu = _gpu_and_cpu(memory, LaneConfig(slots=1, queue_depth=1), LaneConfig(slots=1, queue_depth=1))
        gpu.claim_slot("running")
        s.hold_place("a")
        assert not s.spills_over("a")  # the GPU lane's place (its queue, or the CPU beside it)
        waiting = Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=0.0)
        waiting.enqueued_s = 0.0
        s.gpu.append(waiting, 0.0)  # the GPU queue full: admission holds it there for the GPU
        s.release_place("a")
        s.hold_place("b")
        s.hold_place("c")  # the CPU lane's free slot and its queue's place
        assert s.spills_over("b") and s.spills_over("c") and s.cpu.promised == {"b", "c"}
        with pytest.raises(QueueFull):
            s.hold_place("d")
        assert s.gpu.shed_total == 1 and s.cpu.shed_total == 0
        s.release_place("c")
        s.hold_place("e", "cpu")  # asked for the CPU: not a spill, but the same place
        assert s.cpu.promised == {"b", "e"}
        with pytest.raises(QueueFull):  # the spill that turned out too long for the CPU lane
            s.refuse_spill()
        assert s.gpu.shed_total == 2
        s.release_place("e")
        cpu.state = WorkerState.STARTING  # no ready CPU worker: nowhere to spill to
        with pytest.raises(QueueFull):
            s.hold_place("f")
        cpu.state = WorkerState.READY
        s.off_device = True  # the cpu profile's GPU lane hands every job to the CPU lane anyway
        with pytest.raises(QueueFull):
            s.hold_place("g")

    asyncio.run(main())


def test_the_gpu_lanes_places_are_the_devices_own(memory: MemoryModel) -> None:
    """Round 48: the GPU lane's promises counted the CPU room admission may route to; such a
    request went to the GPU queue all the same, admission held it there for the GPU, and the
    queue refused one after it was journaled (every burst: 1-2 of 12-25, 4 of 12 with the CPU
    worker dead). Its places are its queue and the device's free slots; past them a request
    spills over to a ready CPU worker, or is refused before anything is journaled."""

    async def main() -> None:
        s, _gpu, cpu = _gpu_and_cpu(memory, LaneConfig(slots=1, queue_depth=2), LaneConfig(slots=2, queue_depth=8))
        cpu.state = WorkerState.DEAD  # its queue room is no place while it is down
        s.hold_place("a")  # the device's free slot
        s.hold_place("b")
        s.hold_place("c")  # the GPU queue's two places
        assert not s.has_place()
        with pytest.raises(QueueFull):
            s.hold_place("d")
        assert s.gpu.promised == {"a", "b", "c"} and not s.cpu.promised

    asyncio.run(main())
