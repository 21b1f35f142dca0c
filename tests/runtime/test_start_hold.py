"""A chat job that arrives while its model's workers are still starting (the gateway's start, a
restart) waits for them (``Scheduler._coming``): it was refused at once with "The GPU is full
and the CPU path is not available". What cannot come is still refused at once."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import CapacityError
from spillover.runtime.scheduler import Job, Scheduler
from spillover.runtime.worker_client import WorkerClient, WorkerState
from spillover.testing import FakeClock
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024
STARTING, READY, DEAD = WorkerState.STARTING, WorkerState.READY, WorkerState.DEAD


def _scheduler(
    memory: MemoryModel, clock: FakeClock, gpu: WorkerState, cpu: WorkerState, *, allow_cpu_route: bool = True
) -> tuple[Scheduler, WorkerClient, WorkerClient]:
    ledger = DeviceLedger("sim", 4096 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, clock())
    s = Scheduler(
        gpu_lane=LaneConfig(slots=1, ctx_cap_tokens=512, queue_max_age_s=30.0),
        cpu_lane=LaneConfig(slots=1),
        ledger=ledger,
        policy=AdmissionPolicy(memory=memory, delay_max_s=2.0, allow_cpu_route=allow_cpu_route),
        clock=clock,
    )
    g, c = ready_worker("gpu0", "gpu"), ready_worker("cpu0", "cpu")
    g.state, c.state = gpu, cpu
    s.gpu_workers.append(g)
    s.cpu_workers.append(c)
    return s, g, c


def _job(clock: FakeClock, rid: str = "a", prompt_tokens: int = 20) -> Job:
    return Job(rid=rid, prompt_tokens=prompt_tokens, max_tokens=16, arrived_s=clock())


async def _one_long_request_running(
    memory: MemoryModel, clock: FakeClock, room_bytes: int
) -> tuple[Scheduler, WorkerClient]:
    """A GPU worker of 2 slots (the GPU lane's cap 2048 tokens, the CPU lane's 1024) on a device
    with ``room_bytes`` usable, running one 1500-token request ("a", 16 tokens to answer)."""
    s, _, _ = _scheduler(memory, clock, READY, READY)
    gpu = s.gpu_workers[0] = ready_worker("gpu0", "gpu", slots=2)
    s.gpu_ctx_cap_tokens = 2048
    s.cpu.cfg = dataclasses.replace(s.cpu.cfg, ctx_cap_tokens=1024)
    assert s.ledger is not None
    s.ledger.capacity_bytes = s.ledger.margin_bytes + room_bytes
    first = Job(rid="a", prompt_tokens=1500, max_tokens=16, arrived_s=clock())
    s.submit_nowait(first)
    d1 = await asyncio.wait_for(first.future, 1)
    assert d1.worker is gpu and s.ledger.holds("a")
    return s, gpu


def _waited(memory: MemoryModel, cpu: WorkerState, wait_s: float) -> tuple[Scheduler, WorkerClient, Job]:
    """A job submitted while the GPU worker starts, and a pass ``wait_s`` later."""
    clock = FakeClock(100.0)
    s, gpu, _ = _scheduler(memory, clock, STARTING, cpu)
    job = _job(clock)
    s.submit_nowait(job)
    clock.advance(wait_s)
    s.pump_once()
    return s, gpu, job


@pytest.mark.parametrize("cpu", [STARTING, DEAD])
def test_a_job_waits_for_a_starting_gpu_worker_and_runs_there(memory: MemoryModel, cpu: WorkerState) -> None:
    async def main() -> None:
        s, gpu, job = _waited(memory, cpu, 5.0)
        assert not job.future.done() and s.gpu is not None and list(s.gpu.queue) == [job]
        assert s._due(s.clock()) <= job.enqueued_s + 30.0  # bounded: the lane's queue age
        gpu.state = READY  # the supervisor's READY kicks a pass
        s.pump_once()
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, d.worker) == ("gpu", gpu)

    asyncio.run(main())


def test_a_job_the_gpu_cannot_take_waits_for_a_starting_cpu_worker(memory: MemoryModel) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, cpu = _scheduler(memory, clock, READY, STARTING)
        long = _job(clock, prompt_tokens=600)  # past the GPU lane's 512-token cap
        s.submit_nowait(long)
        assert not long.future.done()
        cpu.state = READY
        s.pump_once()
        d = await asyncio.wait_for(long.future, 1)
        assert (d.route, str(d.reason), d.worker) == ("cpu", "too_long_for_gpu", cpu)

    asyncio.run(main())


def test_a_job_too_long_for_the_ready_cpu_lane_waits_for_the_starting_gpu_worker(memory: MemoryModel) -> None:
    """Round 30: the CPU worker is up first; a job within the GPU lane's cap but past the CPU
    lane's (1024) was refused at once (``gpu_unavailable+too_long_for_cpu``) while the GPU
    worker still loaded. It waits for it, as a job with no CPU path does."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, _ = _scheduler(memory, clock, STARTING, READY)
        s.gpu_ctx_cap_tokens = 2048  # the GPU lane's cap above the CPU lane's
        s.cpu.cfg = dataclasses.replace(s.cpu.cfg, ctx_cap_tokens=1024)
        long = Job(rid="long", prompt_tokens=1500, max_tokens=16, arrived_s=clock())
        s.submit_nowait(long)
        clock.advance(5.0)
        s.pump_once()
        assert not long.future.done()
        gpu.state = READY
        s.pump_once()
        d = await asyncio.wait_for(long.future, 1)
        assert (d.route, d.worker) == ("gpu", gpu)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("gpu", "cpu", "allow_cpu_route"),
    [
        (DEAD, DEAD, True),  # nothing is starting (a restart's back-off)
        (DEAD, STARTING, False),  # the CPU worker comes, but the policy routes nothing there
    ],
)
def test_a_job_nothing_coming_could_take_is_refused_at_once(
    memory: MemoryModel, gpu: WorkerState, cpu: WorkerState, allow_cpu_route: bool
) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, _ = _scheduler(memory, clock, gpu, cpu, allow_cpu_route=allow_cpu_route)
        job = _job(clock)
        s.submit_nowait(job)
        with pytest.raises(CapacityError) as got:
            await asyncio.wait_for(job.future, 1)
        assert got.value.code == "cpu_unavailable"

    asyncio.run(main())


def test_a_worker_that_does_not_come_in_time_ends_the_wait(memory: MemoryModel) -> None:
    async def main() -> None:
        _, _, job = _waited(memory, STARTING, 31.0)
        with pytest.raises(CapacityError) as got:
            await asyncio.wait_for(job.future, 1)
        assert got.value.code == "queue_timeout"

    asyncio.run(main())


@pytest.mark.parametrize(("cpu", "allow_cpu_route"), [(DEAD, True), (READY, False)])
def test_a_job_that_fits_a_busy_gpu_the_cpu_cannot_take_waits_for_a_slot(
    memory: MemoryModel, cpu: WorkerState, allow_cpu_route: bool
) -> None:
    """Round 16: every GPU slot taken past ``delay_max_s``, and the CPU path cannot take the job
    (its worker waits out a restart's back-off, or the job is too long for it): it was refused
    ``gpu_busy+cpu_unavailable`` while the GPU was healthy (and so with no CPU path at all,
    ``cpu = "none"`` or ``allow_cpu_route`` off, whose requests wait or are refused). It now
    waits for the slot, which comes back when the running request ends, and runs on the GPU;
    still bounded by the GPU lane's queue age."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, _ = _scheduler(memory, clock, READY, cpu, allow_cpu_route=allow_cpu_route)
        first, second = _job(clock, "a"), _job(clock, "b")
        s.submit_nowait(first)
        d1 = await asyncio.wait_for(first.future, 1)
        assert d1.worker is gpu and gpu.free_slots == 0
        s.submit_nowait(second)
        clock.advance(5.0)  # past delay_max_s: its slot is still taken
        s.pump_once()
        assert not second.future.done(), second.future
        assert s._due(s.clock()) <= second.enqueued_s + 30.0  # bounded: the lane's queue age
        gpu.release_slot("a")  # the running request ends; its release kicks a pass
        s.pump_once()
        d2 = await asyncio.wait_for(second.future, 1)
        assert (d2.route, d2.worker) == ("gpu", gpu)
        clock.advance(40.0)  # a job that waits past the queue's age is still refused
        late = Job(rid="c", prompt_tokens=100, max_tokens=400, arrived_s=clock())  # seconds of work
        s.submit_nowait(late)
        clock.advance(31.0)
        s.pump_once()
        with pytest.raises(CapacityError) as got:
            await asyncio.wait_for(late.future, 1)
        assert got.value.code == "queue_timeout"
        # Its Retry-After counts its own work (it was the only job queued): not "a second".
        assert s.gpu is not None
        assert got.value.retry_after_s == s.gpu.job_seconds(late.prompt_tokens, late.max_tokens) > 1.0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("max_tokens", "allow_shrink"),
    [
        (16, False),  # within the GPU lane's cap, past the CPU lane's
        (900, True),  # past both caps, shrinkable: it runs cut to the GPU lane's cap
    ],
)
def test_a_job_the_cpu_cannot_take_waits_for_memory_our_running_requests_hold(
    memory: MemoryModel, max_tokens: int, allow_shrink: bool
) -> None:
    """Round 30, left then: on a device just too small for two long requests, a request the CPU
    lane cannot hold (past its 1024-token cap) found the memory taken by a running request past
    ``delay_max_s`` and was refused (a 503, ``kv_pages_exhausted+too_long_for_cpu``), though that
    memory comes back when the running request ends. It waits for it, as for a slot, and runs on
    the GPU; memory someone else holds is still refused at once."""

    async def main() -> None:
        clock = FakeClock(100.0)
        tokens = min(max_tokens, 2048 - 1500)
        need = memory.request_footprint(1500, tokens).total_bytes
        s, gpu = await _one_long_request_running(memory, clock, need + 10 * MIB)  # one long request at a time
        assert s.ledger is not None
        second = Job(rid="b", prompt_tokens=1500, max_tokens=max_tokens, arrived_s=clock(), allow_shrink=allow_shrink)
        s.submit_nowait(second)
        clock.advance(5.0)  # past delay_max_s: the first still holds its memory
        s.pump_once()
        assert not second.future.done(), second.future
        assert s._due(s.clock()) <= second.enqueued_s + 30.0  # bounded: the lane's queue age
        s.ledger.release("a")  # the first request ends
        gpu.release_slot("a")
        s.pump_once()
        d2 = await asyncio.wait_for(second.future, 1)
        assert (d2.route, d2.worker, d2.max_tokens) == ("gpu", gpu, tokens)
        # Memory a tenant holds does not come back with our requests: refused at once.
        s.ledger.release("b")
        gpu.release_slot("b")
        s.ledger.observe(s.ledger.usable_bytes - need // 2, clock())
        third = Job(rid="c", prompt_tokens=1500, max_tokens=max_tokens, arrived_s=clock(), allow_shrink=allow_shrink)
        s.submit_nowait(third)
        clock.advance(5.0)
        s.ledger.observe(s.ledger.usable_bytes - need // 2, clock())
        s.pump_once()
        with pytest.raises(CapacityError) as got:
            await asyncio.wait_for(third.future, 1)
        assert got.value.code == "too_long_for_cpu"

    asyncio.run(main())


def test_a_job_that_waited_for_memory_to_its_maximum_age_says_what_it_waited_out(memory: MemoryModel) -> None:
    """Round 32, left then: a job waiting for the memory our running requests hold ended
    ``queue_timeout`` saying only "waited 30s in the gpu queue"; it names the refusal it waited
    out, as the CPU lane's timeout names its hold."""

    async def main() -> None:
        clock = FakeClock(100.0)
        need = memory.request_footprint(1500, 16).total_bytes
        s, _ = await _one_long_request_running(memory, clock, need + 10 * MIB)  # one long request at a time
        assert s.gpu is not None
        second = Job(rid="b", prompt_tokens=1500, max_tokens=16, arrived_s=clock())
        s.submit_nowait(second)
        clock.advance(5.0)  # past delay_max_s: it waits for the first's memory
        s.pump_once()
        assert not second.future.done() and second.waits_for.endswith("+too_long_for_cpu"), second.waits_for
        clock.advance(s.gpu.cfg.queue_max_age_s)  # the first never ends
        s.pump_once()
        said = re.escape(f"in the gpu queue (waiting out: {second.waits_for})")
        with pytest.raises(CapacityError, match=said) as got:
            second.future.result()
        assert got.value.code == "queue_timeout"

    asyncio.run(main())


def test_a_shrinkable_job_waits_for_memory_its_least_form_fits(memory: MemoryModel) -> None:
    """Round 32, left then: a shrinkable job the CPU cannot take was sized at its capped form to
    decide whether the memory our running requests hold would make room; where only its shrunk
    form ever fits, it was refused at once, though admission shrinks it to the room once that
    memory comes back. It waits, and runs shrunk; with no room even for its least form once our
    requests end, it is still refused at once."""

    async def main() -> None:
        clock = FakeClock(100.0)
        least = memory.request_footprint(1500, 16).total_bytes
        capped = memory.request_footprint(1500, 548).total_bytes
        assert capped > least + 10 * MIB  # the capped form is past the room below
        s, gpu = await _one_long_request_running(memory, clock, least + 5 * MIB)
        assert s.ledger is not None
        second = Job(rid="b", prompt_tokens=1500, max_tokens=900, arrived_s=clock(), allow_shrink=True)
        s.submit_nowait(second)
        clock.advance(5.0)  # past delay_max_s: the first holds the memory
        s.pump_once()
        assert not second.future.done(), second.future
        s.ledger.release("a")
        gpu.release_slot("a")
        s.pump_once()
        d2 = await asyncio.wait_for(second.future, 1)
        assert d2.worker is gpu and 16 <= d2.max_tokens < 548, d2
        # the device holds less than its least form even with ours back: refused at once
        s.ledger.release("b")
        gpu.release_slot("b")
        s.ledger.capacity_bytes = s.ledger.margin_bytes + least - MIB
        third = Job(rid="c", prompt_tokens=1500, max_tokens=900, arrived_s=clock(), allow_shrink=True)
        s.submit_nowait(third)
        clock.advance(5.0)
        s.pump_once()
        with pytest.raises(CapacityError) as got:
            await asyncio.wait_for(third.future, 1)
        assert got.value.code == "too_long_for_cpu"

    asyncio.run(main())
