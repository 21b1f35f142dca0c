"""How soon a dead device worker is expected back (``runtime.supervisor`` rule 9), and the
Retry-After of a deadline refusal meanwhile: the soonest lane, the device's return included
(round 65: a refusal while the device restarted in 2 s said 16 s, the CPU lane's queue)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.core.breaker import Circuit
from spillover.core.memory import MemoryModel
from spillover.errors import CapacityError
from spillover.runtime.scheduler import Job
from spillover.runtime.supervisor import back_in_s
from spillover.runtime.worker_client import WorkerState
from tests.runtime.test_deadlines import T0, _job, _scheduler

NOW = 1000.0


def _sup(state: WorkerState = WorkerState.DEAD, waiting: str | None = None, **kw: Any) -> SimpleNamespace:
    """A supervisor stand-in: its worker ``state``, its last start 3 s long and begun at 900,
    restarting, its back-off 0.5 s."""
    fields = {
        "start_took_s": 3.0,
        "restarting": state is not WorkerState.READY,
        "start_failure": None,
        "starting": False,
        "start_began_s": 900.0,
        "next_start_s": 950.0,
        "backoff_s": 0.5,
    }
    return SimpleNamespace(worker=SimpleNamespace(state=state, waiting=waiting), **(fields | kw))


@pytest.mark.parametrize(
    ("sups", "back"),
    [
        ([_sup(WorkerState.READY)], 0.0),
        ([_sup(next_start_s=NOW + 1.5)], 4.5),  # its back-off's rest, then a start as long as its last
        ([_sup(next_start_s=NOW - 9.0)], 3.0),  # its back-off over, its start about to begin
        ([_sup(next_start_s=800.0)], 3.5),  # just died: the back-off it is about to sleep, then a start
        ([_sup(WorkerState.STARTING, starting=True, start_began_s=NOW - 1.0)], 2.0),  # a second into its start
        ([_sup(WorkerState.STARTING, starting=True, start_began_s=NOW - 5.0)], math.inf),  # slower than its last
        ([_sup(waiting="room on the device for its weights")], math.inf),  # waits for memory: no telling when
        ([_sup(start_took_s=None)], math.inf),  # no start measured yet
        ([_sup(restarting=False)], math.inf),  # parked or stopped
        ([_sup(start_failure="exited with code -6")], math.inf),  # its starts fail: rule 8 answers
        ([_sup(next_start_s=NOW + 1.5), _sup(WorkerState.STARTING, starting=True, start_began_s=NOW - 2.5)], 0.5),
        ([], math.inf),
    ],
)
def test_a_dead_worker_is_expected_back_after_its_back_off_and_a_start_as_long_as_its_last(
    sups: list[SimpleNamespace], back: float
) -> None:
    """Rule 9: 0 with one ready; else the soonest of the restarting ones; none expected without
    a measured start, parked, failing its starts, waiting for the device's memory, or starting
    for longer than its last start took (round 66: it read 0)."""
    assert back_in_s(sups, NOW) == pytest.approx(back)  # type: ignore[arg-type]


def _refused(memory: MemoryModel, *, device: WorkerState, back_s: float) -> CapacityError:
    """The device's worker in ``device``, expected back in ``back_s``; the CPU lane's one slot
    running 400 tokens and as many queued: a job with a 4 s deadline, refused."""

    async def main() -> CapacityError:
        s, _clock, gpu = _scheduler(memory)
        gpu.state = device
        if device is WorkerState.READY:
            gpu.claim_slot("running")
        s.device_back_in_s = lambda: back_s
        for rid in ("run", "queued"):
            s.submit_nowait(Job(rid=rid, prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        job = _job("a", max_tokens=8, deadline_in_s=4.0)
        if device is WorkerState.READY:
            job = _job("a", max_tokens=8, deadline_in_s=0.3)  # past the device's wait at once
        try:
            s.submit_nowait(job)
            s.pump_once()
            job.future.result()
        except CapacityError as exc:
            assert exc.code == "deadline_exceeded"
            return exc
        raise AssertionError(f"not refused: {job.future}")

    return asyncio.run(main())


def test_a_deadline_refusal_while_the_device_restarts_says_when_it_is_back(memory: MemoryModel) -> None:
    """The device's worker dead, expected back in 2 s: Retry-After is then, and the job's time
    on the device (0.22 s), not the CPU lane's 20 s; the message says why."""
    exc = _refused(memory, device=WorkerState.DEAD, back_s=2.0)
    assert exc.retry_after_s == pytest.approx(2.22, abs=0.01)
    assert exc.message.endswith("in about 20.3s, after its deadline; the device is expected back in about 2.0s")


@pytest.mark.parametrize("device", [WorkerState.DEAD, WorkerState.READY])
def test_without_a_device_coming_back_the_refusal_waits_for_the_cpu_lane(
    memory: MemoryModel, device: WorkerState
) -> None:
    """No restart expected (``inf``), or a ready device (its own estimates decide): Retry-After
    is the CPU lane's, its running and queued work (20 s) and the job's own."""
    exc = _refused(memory, device=device, back_s=math.inf if device is WorkerState.DEAD else 2.0)
    assert exc.retry_after_s > 20.0 and "expected back" not in exc.message


def test_a_cpu_queued_job_refused_at_its_last_start_is_told_when_the_device_is_back(memory: MemoryModel) -> None:
    """The device's worker dead, expected back in 2 s; a job with a 4 s deadline spilled onto
    the CPU lane behind 10 s of running work is refused at its last start: Retry-After is the
    device's return and the job's time there, not the running work's 6 s left."""

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        gpu.state = WorkerState.DEAD
        s.device_back_in_s = lambda: 2.0
        s.submit_nowait(Job(rid="run", prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        job = _job("a", max_tokens=8, deadline_in_s=4.0)
        job.movable = True  # spilled over (the GPU queue full): not pinned to the CPU lane
        s.submit_nowait(job, lane="cpu")
        assert job in s.cpu.queue
        clock.advance(4.0 - s.cpu.job_seconds(8, 8) + 0.01)
        s.pump_once()
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded"
        assert refused.value.retry_after_s == pytest.approx(2.0 + s.gpu.job_seconds(8, 8))

    asyncio.run(main())


def _refusal(s: Any, job: Job) -> CapacityError:
    """``job`` submitted to its lane (``Job.lane``) and a pass: its refusal (at once on the CPU
    lane, or decided in the pass)."""
    with pytest.raises(CapacityError) as refused:
        s.submit_nowait(job, lane=job.lane)
        s.pump_once()
        job.future.result()
    assert refused.value.code == "deadline_exceeded"
    return refused.value


def test_the_split_only_profiles_return_waits_out_the_splits_breaker(memory: MemoryModel) -> None:
    """The split-only profile, its worker dead and expected back in 2 s, its own breaker open
    for 10 s: the device takes requests again once that is over (round 66: the resident's
    closed breaker was read, 2.2 s)."""

    async def main() -> None:
        s, clock, split = _scheduler(memory, split=True)
        split.state = WorkerState.DEAD
        s.split_breaker = dataclasses.replace(
            s.split_breaker, circuit=Circuit.OPEN, opened_at_s=clock(), cooldown_s=10.0
        )
        s.device_back_in_s = lambda: 2.0
        for rid in ("run", "queued"):
            s.submit_nowait(Job(rid=rid, prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        refused = _refusal(s, _job("a", max_tokens=8, deadline_in_s=4.0))
        assert refused.retry_after_s == pytest.approx(10.0 + s.gpu.job_seconds(8, 8))  # the CPU lane: 20.3 s

    asyncio.run(main())


@pytest.mark.parametrize("why", ["pinned", "too long"])
def test_a_job_the_device_would_not_take_is_not_told_of_its_return(memory: MemoryModel, why: str) -> None:
    """A ``prefer: cpu`` request (pinned to the CPU lane: its retry comes back there), or one
    longer than the device's context, refused for its deadline while the device restarts: its
    Retry-After is the CPU lane's wait, and the device is not named (round 66)."""

    async def main() -> None:
        s, _clock, gpu = _scheduler(memory)
        gpu.state = WorkerState.DEAD
        s.device_back_in_s = lambda: 2.0
        for rid in ("run", "queued"):
            s.submit_nowait(Job(rid=rid, prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        job = _job("a", max_tokens=8, deadline_in_s=4.0)
        if why == "pinned":
            job.lane = "cpu"
        else:
            s.gpu_ctx_cap_tokens = 12  # 8 + 8 tokens do not fit the device's context
        refused = _refusal(s, job)
        assert refused.retry_after_s > 20.0 and "expected back" not in refused.message

    asyncio.run(main())
