"""A client's deadline (``deadline_ms`` / ``X-Spillover-Deadline-Ms``) on the GPU lane: the
lane a request would start on must be able to finish it in time, and a busy device's delay
never carries it past the last moment the CPU lane could still make it (round 49b: a 200 ms
deadline got a 200 after 2.06 s, and refusals came after the 2 s delay)."""

from __future__ import annotations

import asyncio

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import CapacityError
from spillover.runtime.lanes import Dispatch
from spillover.runtime.scheduler import Job, Scheduler
from spillover.runtime.worker_client import WorkerClient
from spillover.testing import FakeClock
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024
T0 = 100.0


def _scheduler(memory: MemoryModel) -> tuple[Scheduler, FakeClock, WorkerClient]:
    """One GPU slot and one CPU slot on a 1 GiB device; the lanes at their first estimates
    (prefill 400 tok/s, decode 40 tok/s)."""
    clock = FakeClock(T0)
    ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, clock())
    s = Scheduler(
        gpu_lane=LaneConfig(slots=1, queue_depth=4),
        cpu_lane=LaneConfig(slots=1, queue_depth=4),
        ledger=ledger,
        policy=AdmissionPolicy(memory=memory, delay_max_s=2.0),
        clock=clock,
    )
    gpu = ready_worker("gpu0", "gpu")
    s.gpu_workers.append(gpu)
    s.cpu_workers.append(ready_worker("cpu0", "cpu"))
    return s, clock, gpu


def _job(rid: str, max_tokens: int, deadline_in_s: float) -> Job:
    return Job(rid=rid, prompt_tokens=8, max_tokens=max_tokens, arrived_s=T0, deadline_s=T0 + deadline_in_s)


def test_a_busy_device_and_a_deadline_the_cpu_cannot_meet_is_refused_at_once(memory: MemoryModel) -> None:
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


def test_a_deadline_ends_the_devices_delay_while_the_cpu_can_still_meet_it(memory: MemoryModel) -> None:
    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        gpu.claim_slot("running")
        job = _job("a", max_tokens=8, deadline_in_s=1.0)  # about 0.2 s on the CPU lane
        s.submit_nowait(job)
        assert not job.future.done()  # the device may free in time: it waits
        last = T0 + 1.0 - s.cpu.job_seconds(8, 8) - 0.1
        assert s._delay_due <= last + 1e-9, "no pass before the deadline's last CPU start"
        clock.advance(last - T0)
        s.pump_once()
        assert job.future.done()
        d = job.future.result()
        assert isinstance(d, Dispatch) and d.route == "cpu"

    asyncio.run(main())


def test_the_lane_it_starts_on_must_meet_the_deadline(memory: MemoryModel) -> None:
    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        job = _job("a", max_tokens=8, deadline_in_s=0.001)  # an idle device, but 0.2 s of work
        s.submit_nowait(job)
        with pytest.raises(CapacityError) as refused:
            job.future.result()
        assert refused.value.code == "deadline_exceeded" and "GPU lane" in str(refused.value)
        ok = _job("b", max_tokens=8, deadline_in_s=60.0)
        s.submit_nowait(ok)
        assert ok.future.result().route == "gpu"

    asyncio.run(main())
