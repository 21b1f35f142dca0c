"""A client's deadline (``deadline_ms`` / ``X-Spillover-Deadline-Ms``) on the GPU lane: the
lane a request would start on (the device's too, the split's too) must be able to finish it in
time, and a wait for the device lasts only while the CPU lane could still make it, or, once it
cannot, while the device still could (round 49b: a 200 ms deadline got a 200 after 2.06 s, and
refusals came after the 2 s delay; round 50: a GPU ten times faster than the CPU was not waited
for, a job waiting for a split slot past its wait woke the scheduler every millisecond)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.breaker import Circuit
from spillover.core.hostguard import HostView
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import CapacityError
from spillover.runtime.lanes import Dispatch
from spillover.runtime.scheduler import DEADLINE_SLACK_S, DEVICE_ESTIMATE_FRESH_S, Job, Scheduler
from spillover.runtime.worker_client import WorkerClient, WorkerState
from spillover.testing import FakeClock
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024
GIB = 1024 * MIB
T0 = 100.0


def _scheduler(
    memory: MemoryModel, *, split: bool = False, resident: bool | None = None, cpu_depth: int = 4
) -> tuple[Scheduler, FakeClock, WorkerClient]:
    """One device slot (the resident's, or only a split worker's; with ``resident`` as well,
    the resident's is ``gpu_workers[0]``) and one CPU slot on a 1 GiB device; the lanes at
    their first estimates (prefill 400 tok/s, decode 40 tok/s)."""
    clock = FakeClock(T0)
    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, clock())
    s = Scheduler(
        gpu_lane=LaneConfig(slots=1, queue_depth=4),
        cpu_lane=LaneConfig(slots=1, queue_depth=cpu_depth),
        ledger=ledger,
        policy=AdmissionPolicy(memory=memory, delay_max_s=2.0),
        clock=clock,
    )
    device = ready_worker("split0", "split") if split else ready_worker("gpu0", "gpu")
    if split:
        s.split_workers.append(device)
        s.split_memory = dataclasses.replace(memory, n_batch=128, n_gpu_layers=10)
        s.split_ctx_cap_tokens = 1024
    if not split or resident:
        s.gpu_workers.append(device if not split else ready_worker("gpu0", "gpu"))
    s.cpu_workers.append(ready_worker("cpu0", "cpu"))
    return s, clock, device


def _job(rid: str, max_tokens: int, deadline_in_s: float) -> Job:
    return Job(rid=rid, prompt_tokens=8, max_tokens=max_tokens, arrived_s=T0, deadline_s=T0 + deadline_in_s)


def test_a_busy_device_and_a_deadline_the_cpu_cannot_meet_is_refused_at_once(memory: MemoryModel) -> None:
    """Both lanes at 40 tokens a second: 400 tokens cannot be done in 0.2 s anywhere, and the
    busy device's delay is not waited out first."""

    async def main() -> None:
        s, _clock, gpu = _scheduler(memory)
        gpu.claim_slot("running")
        job = _job("a", max_tokens=400, deadline_in_s=0.2)  # 10 s on the CPU lane
        s.submit_nowait(job)
        assert job.future.done(), "waited for the device past its deadline"
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded" and "CPU lane" in str(refused.value)

    asyncio.run(main())


@pytest.mark.parametrize("device_faster", [1.0, 10.0])
def test_a_deadline_ends_the_devices_delay_while_the_cpu_can_still_meet_it(
    memory: MemoryModel, device_faster: float
) -> None:
    """A 1 s deadline, 0.2 s of work on the CPU lane: the job waits for the busy device until
    the last moment the CPU lane can still finish it with half its estimate to spare (a tick
    early), then goes there, however much faster the device is measured (round 51: a faster
    device kept it waiting past that moment, and the CPU lane then refused it)."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu.prefill_tps, s.gpu.decode_tps = 400.0 * device_faster, 40.0 * device_faster
        gpu.claim_slot("running")
        job = _job("a", max_tokens=8, deadline_in_s=1.0)  # about 0.2 s on the CPU lane
        s.submit_nowait(job)
        assert not job.future.done()  # the device may free in time: it waits
        last = T0 + 1.0 - 1.5 * s.cpu.job_seconds(8, 8) - 0.1  # half the CPU lane's estimate to spare
        assert T0 < s._delay_due <= last + 1e-9, "no pass before the deadline's last CPU start"
        clock.advance(last - T0 + 0.05)  # the pass half a tick late
        s.pump_once()
        assert job.future.done()
        d = job.future.result()
        assert isinstance(d, Dispatch) and d.route == "cpu"

    asyncio.run(main())


def test_a_deadline_no_lane_can_meet_is_refused_on_an_idle_device(memory: MemoryModel) -> None:
    """An idle device admits at once, but 0.2 s of work finishes in 1 ms on no lane: a 503;
    a minute is plenty."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        job = _job("a", max_tokens=8, deadline_in_s=0.001)  # an idle device, but 0.2 s of work
        s.submit_nowait(job)
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded" and "no lane would finish" in str(refused.value)
        ok = _job("b", max_tokens=8, deadline_in_s=60.0)
        s.submit_nowait(ok)
        assert ok.future.result().route == "gpu"

    asyncio.run(main())


def test_a_faster_device_is_waited_for_while_it_can_still_make_the_deadline(memory: MemoryModel) -> None:
    """The device measured ten times faster than the CPU lane: 100 tokens in a 1 s deadline are
    2.5 s on the CPU lane but 0.27 s on the device, so the job waits for the busy device (not
    a 503 at once), and takes its slot when it frees."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 400.0
        gpu.claim_slot("running")
        job = _job("a", max_tokens=100, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert not job.future.done()
        end = T0 + 1.0 - s.gpu.job_seconds(8, 100) - 0.1
        assert T0 < s._delay_due <= end + 1e-9
        gpu.release_slot("running")
        clock.advance(0.05)
        s.pump_once()
        assert job.future.result().route == "gpu"
        late = _job("b", max_tokens=100, deadline_in_s=1.0)
        s.submit_nowait(late)  # "a" holds the slot now
        assert not late.future.done()
        clock.advance(end - clock() + 0.01)  # the device never freed in time
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            late.future.result()
        assert refused.value.code == "deadline_exceeded"

    asyncio.run(main())


def test_without_a_cpu_path_a_deadline_waits_for_the_device_and_says_why_it_ends(memory: MemoryModel) -> None:
    """No ready CPU worker: the job waits for the busy device while the device could still
    finish it, and its refusal after that is ``deadline_exceeded`` (it said
    ``cpu_unavailable`` at once)."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.cpu_workers[0].state = WorkerState.DEAD
        gpu.claim_slot("running")
        job = _job("a", max_tokens=8, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert not job.future.done()
        clock.advance(1.0)
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded", refused.value

    asyncio.run(main())


def test_a_split_slot_is_waited_for_only_within_the_deadline_and_must_meet_it(memory: MemoryModel) -> None:
    """Only the split worker on the device: a job waiting for its slot past its wait is
    decided (no pass scheduled in the past: the scheduler woke every millisecond), and the
    split must finish it in time too."""

    async def main() -> None:
        s, clock, split = _scheduler(memory, split=True)
        split.claim_slot("running")
        job = _job("a", max_tokens=8, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert not job.future.done()
        clock.advance(1.0)  # past the CPU lane's last start, the split still busy
        s.pump_once()
        assert s._delay_due > clock(), "a pass scheduled in the past"
        split.release_slot("running")
        late = _job("b", max_tokens=8, deadline_in_s=0.001)
        s.submit_nowait(late)
        with pytest.raises(CapacityError) as refused:
            late.future.result()
        assert refused.value.code == "deadline_exceeded" and "no lane would finish" in str(refused.value)
        assert not split.claimed and s.ledger is not None and not s.ledger.holds("b")

    asyncio.run(main())


def test_past_its_delay_a_job_the_cpu_cannot_finish_waits_for_the_device_that_still_could(
    memory: MemoryModel,
) -> None:
    """Round 52: the device measured far faster and busy, a 10.5 s deadline, 400 tokens:
    13.4 s on the CPU lane, 0.32 s on the device. Past the 2 s delay admission sends it to the CPU
    lane, which cannot make it: it waits on for the device (it was refused at 2 s), takes the
    slot when it frees, and is refused only once the device could not make it either."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 1800.0
        s.cpu.prefill_tps, s.cpu.decode_tps = 400.0, 30.0
        gpu.claim_slot("running")
        job = _job("a", max_tokens=400, deadline_in_s=10.5)
        s.submit_nowait(job)
        clock.advance(2.05)
        s.pump_once()
        assert not job.future.done(), job.future.exception() if job.future.done() else None
        assert clock() < s._delay_due < T0 + 10.5
        gpu.release_slot("running")
        clock.advance(3.0)
        s.pump_once()
        assert job.future.result().route == "gpu"
        late = _job("b", max_tokens=400, deadline_in_s=10.5)
        s.submit_nowait(late)  # "a" holds the slot now, and never frees it in time
        clock.advance(T0 + 10.5 - clock())
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            late.future.result()
        assert refused.value.code == "deadline_exceeded"

    asyncio.run(main())


def test_an_unmeasured_device_does_not_refuse_what_the_cpu_lane_would_finish(memory: MemoryModel) -> None:
    """Round 52: the CPU lane measured at 200 tokens a second, the device not yet (its first
    guess, 40): an idle device admits a 64-token job with a 1 s deadline (the CPU lane would
    take 0.36 s) instead of refusing it on the device's guess of 1.6 s."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        s.cpu.prefill_tps, s.cpu.decode_tps = 2000.0, 200.0
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert job.future.result().route == "gpu"

    asyncio.run(main())


def test_a_split_workers_runs_feed_the_devices_estimate_not_the_cpu_lanes(memory: MemoryModel) -> None:
    """Round 52: the split's timings went into the CPU lane's estimate, and the device's stayed
    its first guess for good."""
    s, _clock, _split = _scheduler(memory, split=True)
    s.record_timing("split", 100, 50, 0.1, 0.6)
    assert (s.gpu.samples, s.cpu.samples) == (1, 0)


def test_a_job_the_device_would_never_take_does_not_wait_for_it(memory: MemoryModel) -> None:
    """Too long for the device's context and too slow on the CPU lane for its deadline: a 503
    at once, not a wait for a device that would never take it."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 1000.0  # the device could, were it to take it
        s.gpu_ctx_cap_tokens = 64
        job = _job("a", max_tokens=400, deadline_in_s=1.0)
        s.submit_nowait(job)
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded"

    asyncio.run(main())


@pytest.mark.parametrize("cpu_lane", ["dead", "starting"])
def test_a_cpu_lane_that_cannot_take_it_leaves_the_wait_to_the_device(memory: MemoryModel, cpu_lane: str) -> None:
    """Round 53: a dead or starting CPU worker's estimate decided the wait: the job was refused
    when the CPU lane's moment passed, though the device (ten times faster) could still make
    it, and its slot freed in time."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.cpu_workers[0].state = WorkerState.DEAD if cpu_lane == "dead" else WorkerState.STARTING
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 400.0
        gpu.claim_slot("running")
        job = _job("a", max_tokens=8, deadline_in_s=1.0)  # CPU lane 0.22 s, the device 0.022 s
        s.submit_nowait(job)
        clock.advance(0.6)
        s.pump_once()
        assert not job.future.done()
        gpu.release_slot("running")
        clock.advance(0.1)
        s.pump_once()
        assert job.future.result().route == "gpu"

    asyncio.run(main())


def test_a_job_queued_on_the_cpu_lane_does_not_start_past_its_deadline(memory: MemoryModel) -> None:
    """Round 53: queued behind a long running job, a 1 s deadline for 0.2 s of work started
    four seconds late; it is refused once it could no longer finish in time, and a pass is
    due then."""

    async def main() -> None:
        s, clock, _gpu = _scheduler(memory)
        s.cpu_workers[0].claim_slot("long")
        job = _job("a", max_tokens=8, deadline_in_s=1.0)
        s.submit_nowait(job, "cpu")
        assert not job.future.done()
        last = T0 + 1.0 - s.cpu.job_seconds(8, 8)
        assert clock() < s._delay_due <= last + 0.1 + 1e-9
        clock.advance(s._delay_due - clock())
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded" and not s.cpu.queue

    asyncio.run(main())


def test_a_shrinkable_job_is_timed_at_what_it_would_run_on_the_cpu_lane(memory: MemoryModel) -> None:
    """Round 53: a shrinkable 8 + 6000-token job, the device busy past its delay, a 100 s
    deadline: the CPU lane runs it cut to its 2048-token context (about 51 s), but its whole
    6000 tokens (150 s) were timed and it was refused."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu_ctx_cap_tokens = 8192
        gpu.claim_slot("running")
        job = Job(rid="a", prompt_tokens=8, max_tokens=6000, arrived_s=T0, deadline_s=T0 + 100.0, allow_shrink=True)
        s.submit_nowait(job)
        clock.advance(2.05)
        s.pump_once()
        d = job.future.result()
        assert (d.route, d.max_tokens) == ("cpu", s.cpu.cfg.ctx_cap_tokens - 8)

    asyncio.run(main())


def test_a_dead_device_is_not_waited_for(memory: MemoryModel) -> None:
    """Round 53: with the CPU lane too slow, a job waited for a dead GPU worker (only the
    deadline ended the wait); no lane can finish it: a 503 at once."""

    async def main() -> None:
        s, _clock, gpu = _scheduler(memory)
        gpu.state = WorkerState.DEAD
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 400.0
        job = _job("a", max_tokens=400, deadline_in_s=5.0)  # 10 s on the CPU lane
        s.submit_nowait(job)
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded"

    asyncio.run(main())


@pytest.mark.parametrize("split", [False, True])
def test_an_idle_device_measured_too_slow_leaves_the_job_to_the_cpu_lane_that_meets_it(
    memory: MemoryModel, split: bool
) -> None:
    """Round 53: the device (the resident, or only a split worker) measured at 10 tokens a
    second, the CPU lane at 200: a 64-token job with a 1 s deadline (6.4 s on the device,
    0.36 s on the CPU lane) was given to the idle device and answered five seconds late. It
    goes to the CPU lane (``cpu_meets_deadline``), and late binding leaves it there while it
    waits for a CPU slot."""

    async def main() -> None:
        s, clock, _device = _scheduler(memory, split=split)
        s.record_timing("split" if split else "gpu", 8, 11, 8 / 400, 8 / 400 + 1.0)  # 10 tokens a second
        s.cpu.prefill_tps, s.cpu.decode_tps = 2000.0, 200.0
        cpu = s.cpu_workers[0]
        cpu.claim_slot("running")  # it queues on the CPU lane, where late binding could move it
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert not job.future.done() and list(s.cpu.queue) == [job]
        clock.advance(0.05)
        s.pump_once()
        assert not job.future.done(), "moved to the device that would be late"
        cpu.release_slot("running")
        s.pump_once()
        d = job.future.result()
        assert (d.route, d.reason) == ("cpu", "cpu_meets_deadline")
        unhurried = _job("b", max_tokens=64, deadline_in_s=60.0)  # the device makes this one
        s.submit_nowait(unhurried)
        assert unhurried.future.result().route == ("split" if split else "gpu")

    asyncio.run(main())


def test_a_job_too_long_for_the_cpu_lane_waits_for_the_device_as_long_as_the_device_could_make_it(
    memory: MemoryModel,
) -> None:
    """A job longer than the CPU lane's context (not shrinkable) on a busy device measured fast
    (3 s of work), the CPU lane as fast: its wait ended when the CPU lane's last start passed
    (5.4 s of a 10 s deadline), though the CPU lane could never take it, and it was refused
    while the device could still finish in time. It waits until the device's own last start."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu_ctx_cap_tokens = 8192
        for lane in (s.gpu, s.cpu):
            lane.prefill_tps, lane.decode_tps = 4000.0, 1000.0
        gpu.claim_slot("running")
        job = _job("a", max_tokens=3000, deadline_in_s=10.0)  # 8 + 3000 > the CPU lane's 2048
        s.submit_nowait(job)
        clock.advance(6.0)
        s.pump_once()
        assert not job.future.done(), "refused while the device could still finish it"
        gpu.release_slot("running")
        s.pump_once()
        assert job.future.result().route == "gpu"

    asyncio.run(main())


def _measured_slow(s: Scheduler) -> None:
    """The device measured at 10 tokens a second, the CPU lane at 200 (64 tokens: 6.4 s there,
    0.36 s on the CPU lane)."""
    s.record_timing("gpu", 8, 11, 8 / 400, 8 / 400 + 1.0)
    s.cpu.prefill_tps, s.cpu.decode_tps = 2000.0, 200.0


def test_a_busy_device_measured_too_slow_is_not_waited_for(memory: MemoryModel) -> None:
    """Round 54b: free or not, a device measured too slow leaves the job to the CPU lane at once
    (it waited out the busy device's delay, then went as ``gpu_busy``, movable)."""

    async def main() -> None:
        s, _clock, gpu = _scheduler(memory)
        _measured_slow(s)
        gpu.claim_slot("running")
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(job)
        d = job.future.result()
        assert (d.route, d.reason) == ("cpu", "cpu_meets_deadline")

    asyncio.run(main())


@pytest.mark.parametrize("where", ["gpu", "split", "spilled"])
def test_late_binding_does_not_move_a_job_onto_a_device_that_would_miss_its_deadline(
    memory: MemoryModel, where: str
) -> None:
    """Round 54b: a deadline job waiting on the CPU lane (its slot busy) was moved onto the
    freed device (the resident, a split counted at the device's speed, or after a spill-over)
    that needs 6.4 s for its 1 s deadline."""

    async def main() -> None:
        s, clock, device = _scheduler(memory, split=where == "split", resident=where != "split" or None)
        _measured_slow(s)
        cpu = s.cpu_workers[0]
        cpu.claim_slot("running-cpu")
        device.claim_slot("running")
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        if where == "spilled":
            job.movable = True
            s.submit_nowait(job, lane="cpu")
        else:
            s.submit_nowait(job)
        clock.advance(0.45)  # past the wait for the device (0.36 s): on the CPU queue, as gpu_busy before
        s.pump_once()
        assert not job.future.done() and list(s.cpu.queue) == [job]
        device.release_slot("running")
        s.pump_once()
        assert not job.future.done() and list(s.cpu.queue) == [job]
        cpu.release_slot("running-cpu")
        s.pump_once()
        assert job.future.result().route == "cpu"

    asyncio.run(main())


def test_a_cpu_queued_job_moves_to_a_device_that_frees_before_its_last_cpu_start(memory: MemoryModel) -> None:
    """Round 54b: the device ten times faster than the CPU lane; a job routed to the CPU queue
    (its slot busy) is moved by late binding when the device frees before its last CPU start
    (0.48 s), and refused at the pass its last start brings when it has not (a job whose last
    start passed is refused even if a device frees in that same pass: rounds 55 and 56 found
    that sparing it kept its place from a request without a deadline)."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.record_timing("gpu", 8, 101, 8 / 4000, 8 / 4000 + 0.25)  # 400 tokens a second
        s.cpu_workers[0].claim_slot("running-cpu")
        gpu.claim_slot("running")
        job = _job("a", max_tokens=20, deadline_in_s=1.0)  # 0.52 s on the CPU lane, 0.05 s on the device
        s.submit_nowait(job)
        clock.advance(0.3)  # past the wait for the device: the CPU queue
        s.pump_once()
        assert list(s.cpu.queue) == [job]
        assert s._delay_due == pytest.approx(T0 + 0.48 + DEADLINE_SLACK_S)  # a pass at its last start
        clock.advance(0.1)
        gpu.release_slot("running")
        s.pump_once()
        assert job.future.result().route == "gpu"
        other = _job("b", max_tokens=20, deadline_in_s=1.0)
        other.arrived_s = other.enqueued_s = clock()
        other.deadline_s = clock() + 1.0
        s.submit_nowait(other)  # "a" holds the device now
        clock.advance(0.3)
        s.pump_once()
        assert list(s.cpu.queue) == [other]
        clock.advance(s._delay_due - clock())
        s.pump_once()
        assert other.future.exception() is not None

    asyncio.run(main())


@pytest.mark.parametrize("cause", ["gpu_busy", "cpu_meets_deadline"])
def test_a_job_queued_on_the_cpu_lane_in_a_pass_gets_a_pass_at_its_last_start(memory: MemoryModel, cause: str) -> None:
    """Round 54b: a job the pass itself put on the CPU queue (its slot busy) got no pass at its
    last CPU start: the next came from the 0.5 s safety net, after its deadline."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        if cause == "cpu_meets_deadline":
            _measured_slow(s)
        else:
            s.cpu.prefill_tps, s.cpu.decode_tps = 2000.0, 200.0
        s.cpu_workers[0].claim_slot("running-cpu")
        gpu.claim_slot("running")
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(job)
        clock.advance(0.6)
        s.pump_once()
        assert list(s.cpu.queue) == [job] and job.last_reason == cause
        last = job.deadline_s - s.cpu.job_seconds(8, 64)  # type: ignore[operator]
        assert clock() < s._delay_due <= last + DEADLINE_SLACK_S + 1e-9

    asyncio.run(main())


def test_a_shrinkable_jobs_wait_for_the_device_is_timed_at_what_the_device_runs(memory: MemoryModel) -> None:
    """Round 54b: a shrinkable 8 + 3000-token job on a busy device whose context is 1024 (1.0 s
    of work there, 3.0 s whole), the CPU lane too slow: its wait ended at 1.9 s and it was
    refused, though the device could finish it until 3.9 s."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu_ctx_cap_tokens = 1024
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 1000.0
        gpu.claim_slot("running")
        job = Job(rid="a", prompt_tokens=8, max_tokens=3000, arrived_s=T0, deadline_s=T0 + 5.0, allow_shrink=True)
        s.submit_nowait(job)
        clock.advance(2.5)
        s.pump_once()
        assert not job.future.done(), "refused while the device could still finish it"
        gpu.release_slot("running")
        s.pump_once()
        d = job.future.result()
        assert (d.route, d.max_tokens) == ("gpu", 1024 - 8)

    asyncio.run(main())


def test_a_busy_split_beside_the_resident_is_waited_for_within_the_deadline(memory: MemoryModel) -> None:
    """Round 54b: a job only the split can take (too long for the resident), the split busy
    past the delay, the CPU lane too slow: refused at 2 s beside a resident (the reason stayed
    ``too_long_for_gpu``), though the split could finish it until 9.1 s."""

    async def main() -> None:
        s, clock, split = _scheduler(memory, split=True, resident=True)
        s.gpu_ctx_cap_tokens = 512
        s.gpu.prefill_tps, s.gpu.decode_tps = 4000.0, 1000.0
        split.claim_slot("running")
        job = _job("a", max_tokens=800, deadline_in_s=10.0)  # 20 s on the CPU lane
        s.submit_nowait(job)
        clock.advance(2.01)
        s.pump_once()
        assert not job.future.done(), "refused while the split could still finish it"
        clock.advance(1.0)
        split.release_slot("running")
        s.pump_once()
        assert job.future.result().route == "split"

    asyncio.run(main())


def test_the_cpu_lane_held_by_the_host_guard_takes_no_deadline_job_past_its_depth(memory: MemoryModel) -> None:
    """Round 54b: the CPU queue full (depth 1) and held by the host-RAM guard, a slot free: a
    job the slow device would be late for was appended anyway (2 queued of 1)."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory, cpu_depth=1)
        _measured_slow(s)
        s.host_view = lambda running: _host(budget_bytes=GIB, predicted_bytes=GIB)  # over its budget: nothing starts
        held = _job("held", max_tokens=8, deadline_in_s=60.0)
        s.submit_nowait(held, lane="cpu")
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert len(s.cpu.queue) <= 1
        assert job.future.done() and job.future.exception() is not None

    asyncio.run(main())


def test_the_cpu_lanes_wait_counts_a_shrinkable_job_at_its_cut(memory: MemoryModel) -> None:
    """Round 54b: a shrinkable 8000-token job queued on the CPU lane runs 2040 tokens there
    (51 s), but the lane's wait counted 8000 (200 s): a 90 s deadline behind it was refused."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.gpu_ctx_cap_tokens = 8192
        gpu.claim_slot("running")
        s.cpu_workers[0].claim_slot("running-cpu")
        ahead = Job(rid="ahead", prompt_tokens=8, max_tokens=8000, arrived_s=T0, allow_shrink=True)
        s.submit_nowait(ahead)
        clock.advance(2.01)
        s.pump_once()
        assert list(s.cpu.queue) == [ahead]
        assert s.cpu.estimated_delay_s(clock()) == pytest.approx(s.cpu.job_seconds(8, 2040))
        late = Job(rid="b", prompt_tokens=8, max_tokens=8, arrived_s=clock(), deadline_s=clock() + 90.0)
        s.submit_nowait(late, lane="cpu")
        assert not late.future.done()

    asyncio.run(main())


@pytest.mark.parametrize("device", ["dead", "breaker_open"])
def test_a_cpu_job_past_its_deadline_leaves_its_place_before_the_gpu_lane_is_decided(
    memory: MemoryModel, device: str
) -> None:
    """Rounds 55 and 56 (regressions of round 54b's fix): a CPU-queued job past its last start
    held the one place in the CPU queue while the pass decided the GPU lane (also when it was
    spared for a free device measured in time whose breaker was open), so a request with no
    deadline, sent to the CPU lane, was refused ``cpu_queue_full``."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory, cpu_depth=1)
        s.cpu_workers[0].claim_slot("running-cpu")
        late = _job("d", max_tokens=8, deadline_in_s=1.0)  # 0.22 s on the CPU lane: last start 0.78 s
        late.movable = True
        gpu.claim_slot("running")
        s.submit_nowait(late, lane="cpu")
        if device == "dead":
            gpu.state = WorkerState.DEAD
        else:  # ready, a free slot, fast: but its breaker sends nothing there
            s.record_timing("gpu", 8, 101, 8 / 4000, 8 / 4000 + 0.25)
            s.breaker = dataclasses.replace(s.breaker, circuit=Circuit.OPEN, opened_at_s=clock(), cooldown_s=60.0)
            gpu.release_slot("running")
        clock.advance(0.8)
        plain = Job(rid="n", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(plain)
        assert late.future.exception() is not None
        assert not plain.future.done() and list(s.cpu.queue) == [plain]

    asyncio.run(main())


def test_the_host_guard_is_asked_afresh_whether_the_cpu_lane_can_take_a_deadline_job(memory: MemoryModel) -> None:
    """Round 55: the last pass's hold was read after host memory came back (no event between),
    and a job the CPU lane would finish in time (the device measured too slow) was refused."""

    async def main() -> None:
        s, clock, _gpu = _scheduler(memory)
        _measured_slow(s)
        views = {"held": _host(budget_bytes=GIB, predicted_bytes=GIB), "free": _host(budget_bytes=8 * GIB)}
        now = {"view": views["held"]}
        s.host_view = lambda running: now["view"]
        waiting = _job("c", max_tokens=8, deadline_in_s=60.0)
        s.submit_nowait(waiting, lane="cpu")
        assert not waiting.future.done()
        now["view"] = views["free"]
        clock.advance(0.05)
        job = Job(rid="a", prompt_tokens=8, max_tokens=64, arrived_s=clock(), deadline_s=clock() + 1.0)
        s.submit_nowait(job)
        assert waiting.future.done(), "the pass found the host fine"
        assert not job.future.done() and job.last_reason == "cpu_meets_deadline"  # behind it, not refused

    asyncio.run(main())


def _host(*, budget_bytes: int, predicted_bytes: int = 0, running: int = 0) -> HostView:
    """What the host-RAM guard sees: one CPU slot, ``running`` of it taken, a GiB a context."""
    return HostView(
        running=running,
        contexts=0,
        slots=1,
        predicted_bytes=predicted_bytes,
        observed_bytes=predicted_bytes,
        slot_bytes=GIB,
        budget_bytes=budget_bytes,
        available_bytes=8 * GIB,
        min_free_bytes=0,
    )


@pytest.mark.parametrize("resident", ["dead", "breaker_open"])
def test_a_shrinkable_job_the_split_would_run_is_timed_at_the_splits_cut(memory: MemoryModel, resident: str) -> None:
    """Round 55: with the resident unable to take it, a shrinkable 8 + 2000-token job was timed
    at the resident's context (20 s at 100 tokens a second) and sent to the CPU lane (13 s),
    though the split would run it cut to 1016 tokens in 10 s, within its 14 s deadline."""

    async def main() -> None:
        s, clock, _split = _scheduler(memory, split=True, resident=True)
        s.gpu_ctx_cap_tokens = 8192
        s.record_timing("gpu", 8, 101, 8 / 400, 8 / 400 + 1.0)  # 100 tokens a second
        s.cpu.prefill_tps, s.cpu.decode_tps = 2000.0, 150.0
        if resident == "dead":
            s.gpu_workers[0].state = WorkerState.DEAD
        else:
            s.breaker = dataclasses.replace(s.breaker, circuit=Circuit.OPEN, opened_at_s=clock(), cooldown_s=60.0)
        job = Job(rid="a", prompt_tokens=8, max_tokens=2000, arrived_s=T0, deadline_s=T0 + 14.0, allow_shrink=True)
        s.submit_nowait(job)
        d = job.future.result()
        assert (d.route, d.max_tokens) == ("split", 1024 - 8)

    asyncio.run(main())


def test_a_job_sent_to_the_cpu_lane_for_its_deadline_moves_to_a_device_measured_in_time_again(
    memory: MemoryModel,
) -> None:
    """Round 55: a ``cpu_meets_deadline`` job was pinned to the CPU lane; the device's later
    runs were fast and the CPU worker died, and the free device never took it."""

    async def main() -> None:
        s, clock, _gpu = _scheduler(memory)
        _measured_slow(s)
        cpu = s.cpu_workers[0]
        cpu.claim_slot("running-cpu")
        job = _job("a", max_tokens=64, deadline_in_s=3.0)
        s.submit_nowait(job)
        assert job.last_reason == "cpu_meets_deadline" and list(s.cpu.queue) == [job]
        for _ in range(12):
            s.record_timing("gpu", 8, 401, 8 / 4000, 8 / 4000 + 1.0)  # about 400 tokens a second now
        cpu.state = WorkerState.DEAD
        clock.advance(0.5)
        s.pump_once()
        assert job.future.result().route == "gpu"

    asyncio.run(main())


def test_a_deadline_job_goes_to_the_cpu_lane_only_with_room_for_its_least_answer(memory: MemoryModel) -> None:
    """Round 55: a shrinkable 2040-token prompt on the CPU lane's 2048-token context (the device
    measured too slow) was sent there with ``max_tokens`` 8, under admission's 16."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        s.gpu_ctx_cap_tokens = 8192
        _measured_slow(s)
        job = Job(rid="a", prompt_tokens=2040, max_tokens=100, arrived_s=T0, deadline_s=T0 + 2.0, allow_shrink=True)
        s.submit_nowait(job)
        assert not (job.future.done() and job.future.exception() is None and job.future.result().route == "cpu")

    asyncio.run(main())


def test_a_slow_measurement_stops_sending_deadline_work_away_once_it_is_old(memory: MemoryModel) -> None:
    """Round 55: one slow run kept an idle device from every request with a deadline for good
    (nothing else measured it again); past ``DEVICE_ESTIMATE_FRESH_S`` the device gets the next."""

    async def main() -> None:
        s, clock, _gpu = _scheduler(memory)
        _measured_slow(s)
        first = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(first)
        assert first.future.result().reason == "cpu_meets_deadline"
        s.cpu_workers[0].release_slot("a")
        clock.advance(DEVICE_ESTIMATE_FRESH_S + 1.0)
        later = Job(rid="b", prompt_tokens=8, max_tokens=64, arrived_s=clock(), deadline_s=clock() + 1.0)
        s.submit_nowait(later)
        assert later.future.result().route == "gpu"

    asyncio.run(main())


def test_a_cpu_only_model_refuses_a_late_cpu_job_and_serves_the_next(memory: MemoryModel) -> None:
    """Round 56: on a model with no GPU lane, a CPU-queued job past its last start made every
    pass raise (the device's estimate was asked for), and the jobs behind it never started."""

    async def main() -> None:
        clock = FakeClock(T0)
        s = Scheduler(gpu_lane=None, cpu_lane=LaneConfig(slots=1, queue_depth=4), ledger=None, policy=None, clock=clock)
        cpu = ready_worker("cpu0", "cpu")
        s.cpu_workers.append(cpu)
        cpu.claim_slot("running")
        late = _job("d", max_tokens=8, deadline_in_s=1.0)
        s.submit_nowait(late, lane="cpu")
        plain = Job(rid="n", prompt_tokens=8, max_tokens=8, arrived_s=T0)
        s.submit_nowait(plain, lane="cpu")
        clock.advance(0.9)
        cpu.release_slot("running")
        s.pump_once()
        assert late.future.exception() is not None
        assert plain.future.result().route == "cpu"

    asyncio.run(main())


@pytest.mark.parametrize("guard", [True, False])
def test_a_busy_cpu_slot_is_a_queue_not_a_hold(memory: MemoryModel, guard: bool) -> None:
    """Round 56: with every CPU slot busy, the host guard's "slots busy" read as a hold, so the
    CPU lane never counted: a job the device (measured too slow) would be late for and the
    CPU lane would finish in time behind its running request was refused."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        _measured_slow(s)
        s.host_guard = guard
        s.host_view = lambda running: _host(budget_bytes=8 * GIB, running=running)
        s.cpu_workers[0].claim_slot("running-cpu")
        job = _job("a", max_tokens=64, deadline_in_s=1.0)
        s.submit_nowait(job)
        assert not job.future.done() and job.last_reason == "cpu_meets_deadline"

    asyncio.run(main())


def test_a_job_too_long_for_the_resident_is_timed_at_the_splits_cut(memory: MemoryModel) -> None:
    """Round 56: a shrinkable 300-token prompt beside a resident of 256 tokens was timed at one
    token (the resident's cut), so late binding moved it onto a split measured too slow for
    its deadline, in the pass that had sent it to the CPU lane for that."""

    async def main() -> None:
        s, _clock, _split = _scheduler(memory, split=True, resident=True)
        s.gpu_ctx_cap_tokens = 256
        s.record_timing("gpu", 8, 11, 8 / 400, 8 / 400 + 1.0)  # 10 tokens a second
        s.cpu.prefill_tps, s.cpu.decode_tps = 4000.0, 200.0
        job = Job(rid="a", prompt_tokens=300, max_tokens=2000, arrived_s=T0, deadline_s=T0 + 15.0, allow_shrink=True)
        s.submit_nowait(job)
        d = job.future.result()
        assert (d.route, d.reason) == ("cpu", "cpu_meets_deadline")

    asyncio.run(main())


def test_a_busy_split_is_not_waited_for_when_the_cpu_lane_cannot_take_the_job(memory: MemoryModel) -> None:
    """Round 56: another process held the device, leaving room for half the split's
    reservation; a job only the split could take waited out the queue's 60 s for its busy slot
    and ended ``queue_timeout`` (a wait round 55 had added, which round 57 found holding the
    GPU queue's places from the idle resident's requests: refused after the delay, as before)."""

    async def main() -> None:
        s, clock, split = _scheduler(memory, split=True, resident=True)
        s.gpu_ctx_cap_tokens = 512
        split.claim_slot("running")
        s.cpu_workers[0].state = WorkerState.DEAD
        assert s.ledger is not None and s.split_memory is not None
        need = s.split_memory.request_footprint(8, 900).total_bytes
        s.ledger.observe(s.ledger.capacity_bytes - s.ledger.margin_bytes - need // 2, clock())  # a tenant's
        job = Job(rid="a", prompt_tokens=8, max_tokens=900, arrived_s=T0)
        s.submit_nowait(job)
        clock.advance(2.01)
        s.pump_once()
        assert job.future.done() and job.future.exception() is not None

    asyncio.run(main())


def test_a_refusal_for_the_splits_breaker_beside_a_resident_waits_out_its_cooldown(memory: MemoryModel) -> None:
    """Round 56: a job only the split can take, its breaker open for 60 s, the CPU worker
    dead: the 503 said to retry in a second."""

    async def main() -> None:
        s, clock, _split = _scheduler(memory, split=True, resident=True)
        s.gpu_ctx_cap_tokens = 512
        s.split_breaker = dataclasses.replace(
            s.split_breaker, circuit=Circuit.OPEN, opened_at_s=clock(), cooldown_s=60.0
        )
        s.cpu_workers[0].state = WorkerState.DEAD
        job = Job(rid="a", prompt_tokens=8, max_tokens=900, arrived_s=T0)
        s.submit_nowait(job)
        clock.advance(2.01)
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.retry_after_s >= 57.0

    asyncio.run(main())


def test_a_shrinkable_job_waiting_for_a_starting_split_is_timed_at_its_cut(memory: MemoryModel) -> None:
    """Round 57: the split-only profile, its worker starting: a shrinkable 8 + 2000-token job
    was timed at 2000 tokens (50 s) and refused for its 30 s deadline, though the split runs it
    cut to 1016 (25 s)."""

    async def main() -> None:
        s, clock, split = _scheduler(memory, split=True)
        s.gpu_ctx_cap_tokens = 8192
        split.state = WorkerState.STARTING
        s.cpu_workers[0].state = WorkerState.DEAD
        job = Job(rid="a", prompt_tokens=8, max_tokens=2000, arrived_s=T0, deadline_s=T0 + 30.0, allow_shrink=True)
        s.submit_nowait(job)
        assert not job.future.done(), "refused on the GPU lane's context"
        split.state = WorkerState.READY
        clock.advance(1.0)
        s.pump_once()
        d = job.future.result()
        assert (d.route, d.max_tokens) == ("split", 1024 - 8)

    asyncio.run(main())


def test_late_binding_times_a_move_onto_the_split_at_the_splits_tokens(memory: MemoryModel) -> None:
    """Round 58: a shrinkable 8 + 900-token job, the measured device too slow for it on the free
    split (900 tokens) and the CPU lane in time, went to the CPU lane, and late binding moved it
    onto the split in the same pass, timing it at the busy resident's 248 tokens."""

    async def main() -> None:
        s, _clock, _split = _scheduler(memory, split=True, resident=True)
        s.gpu_ctx_cap_tokens = 256
        s.record_timing("gpu", 8, 50, 0.2, 3.0)  # about 18 tokens a second
        s.gpu_workers[0].claim_slot("running")
        job = Job(rid="a", prompt_tokens=8, max_tokens=900, arrived_s=T0, deadline_s=T0 + 30.0, allow_shrink=True)
        assert s.gpu.job_seconds(8, 900) > 30.0 > s.gpu.job_seconds(8, 248)
        s.submit_nowait(job)
        d = job.future.result()
        assert (d.route, d.reason) == ("cpu", "cpu_meets_deadline")

    asyncio.run(main())


def test_late_binding_does_not_start_a_job_no_lane_would_finish_in_time(memory: MemoryModel) -> None:
    """Round 58: a job queued on the CPU lane whose worker then died, the device back with a
    first estimate past the deadline: late binding started it on the device, where a new job
    in the same state is refused (rule 3); it stays until its last CPU start refuses it."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        s.record_timing("cpu", 8, 50, 0.01, 0.3)  # the CPU lane measured faster than the device's guess
        gpu.state = WorkerState.DEAD
        cpu = s.cpu_workers[0]
        cpu.claim_slot("running")
        job = Job(rid="a", prompt_tokens=100, max_tokens=16, arrived_s=T0, deadline_s=T0 + 0.6)
        s.submit_nowait(job)
        assert list(s.cpu.queue) == [job]
        gpu.state = WorkerState.READY
        cpu.state = WorkerState.DEAD
        s.pump_once()
        assert not job.future.done() or job.future.exception() is not None
        clock.advance(s._delay_due - clock())
        s.pump_once()
        assert job.future.exception() is not None

    asyncio.run(main())


def test_the_cpu_lanes_running_work_counts_for_its_wait_not_for_a_deadline(memory: MemoryModel) -> None:
    """No device worker, and the CPU lane's one slot runs a request with at most 25 s of work
    left: the lane's estimated wait and Retry-After count it (round 59: they left it out), but
    a job with a 5 s deadline (0.2 s of its own) is queued, not refused at once, as the running
    one may end at its next token (round 60: counted at its ``max_tokens``, it had such jobs
    refused that it would have let through in time). It ends a second later and the job is
    taken; one queued behind a request that outlasts its last start is refused then."""

    async def main() -> None:
        s, clock, _gpu = _scheduler(memory)
        s.gpu_workers.clear()  # the GPU lane hands its jobs to the CPU lane
        long = Job(rid="long", prompt_tokens=8, max_tokens=1000, arrived_s=T0)  # at most 25 s
        s.submit_nowait(long, lane="cpu")
        d = long.future.result()
        assert d.route == "cpu" and s.cpu.estimated_delay_s(clock()) == pytest.approx(s.cpu.job_seconds(8, 1000))
        clock.advance(0.5)
        assert s._retry_after_s(s.cpu) == pytest.approx(s.cpu.job_seconds(8, 1000) - 0.5)
        assert abs(s.statistics()[-1].estimated_delay_ms - 1000 * (s.cpu.job_seconds(8, 1000) - 0.5)) <= 1
        for lane in ("cpu", "gpu"):
            job = Job(rid=f"early-{lane}", prompt_tokens=8, max_tokens=8, arrived_s=clock(), deadline_s=clock() + 5.0)
            s.submit_nowait(job, lane=lane)
            assert not job.future.done(), f"{lane}: refused on work that may end at its next token"
        own = Job(rid="own", prompt_tokens=8, max_tokens=400, arrived_s=clock(), deadline_s=clock() + 5.0)
        with pytest.raises(CapacityError) as too_long:  # 10 s of its own: refused at once, and told
            s.submit_nowait(own, lane="cpu")  # to come back once the running and queued work is done
        waits = s.cpu.estimated_delay_s(clock()) + s.cpu.job_seconds(8, 400)
        assert too_long.value.code == "deadline_exceeded" and too_long.value.retry_after_s == pytest.approx(waits)
        assert waits > s.cpu.job_seconds(8, 1000)  # round 61: the running one's 24.5 s were left out
        clock.advance(0.5)
        s.cpu_workers[0].release_slot("long")
        s.finished("long", d, "ok")
        s.pump_once()
        taken = s.cpu.queue[0] if s.cpu.queue else None
        assert set(s.cpu.running) == {"early-cpu"} and taken is not None and taken.rid == "early-gpu"
        late_by = s.cpu.job_seconds(8, 8)
        clock.advance(5.0 - 0.5 - late_by + 0.01)  # early-cpu still runs past early-gpu's last start
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            taken.future.result()
        assert refused.value.code == "deadline_exceeded"

    asyncio.run(main())


def test_a_request_with_a_deadline_is_never_the_cpu_canary() -> None:
    """The canary pins a request to the CPU lane: one with a deadline is never taken for it
    (round 59: a canary the CPU lane would finish late was refused while the idle device would
    have finished it in time), nor counted, so the others keep the configured share."""
    from spillover.config import CpuLaneConfig
    from spillover.runtime.chat import ChatModel

    chat = ChatModel("m", (), "normal", "m.gguf", LaneConfig(), CpuLaneConfig(canary_ratio=0.5))
    picks = [chat.canary_due(True, deadline=i % 2 == 0) for i in range(8)]
    assert picks == [False, False, False, True, False, False, False, True]
    assert not ChatModel("m", (), "normal", "m.gguf", LaneConfig(), CpuLaneConfig(canary_ratio=1.0)).canary_due(
        True, deadline=True
    )


def test_the_gpu_lanes_wait_counts_its_running_requests(memory: MemoryModel) -> None:
    """A request running on the device's one slot: the GPU lane's estimated wait (``/v1/status``,
    a GPU-queued job's ``estimated_delay_ms``, Retry-After of its full queue) is its remaining
    work, as the CPU lane's is (round 60: it read 0 with every device slot busy); it is 0 once
    the request ended, or once its worker let go of it without an end (a worker that died)."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        first = Job(rid="first", prompt_tokens=8, max_tokens=400, arrived_s=T0)
        s.submit_nowait(first)
        d = first.future.result()
        assert d.route == "gpu" and set(s.gpu.running) == {"first"}
        clock.advance(1.0)
        assert abs(s.statistics()[0].estimated_delay_ms - 1000 * (s.gpu.job_seconds(8, 400) - 1.0)) <= 1
        gpu.release_slot("first")
        s.finished("first", d, "ok")
        assert s.gpu.running == {} and s.statistics()[0].estimated_delay_ms == 0
        again = Job(rid="again", prompt_tokens=8, max_tokens=400, arrived_s=clock())
        s.submit_nowait(again)
        assert again.future.result().route == "gpu" and set(s.gpu.running) == {"again"}
        gpu.release_slot("again")  # its worker died: the slot went back, no ``finished`` yet
        s.pump_once()
        assert s.gpu.running == {} and s.gpu.estimated_delay_s(clock()) == 0.0

    asyncio.run(main())
