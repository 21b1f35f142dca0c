"""The scheduler's late binding and its Retry-After: a job admission sent to the CPU lane
that has not started runs on the GPU as soon as the GPU can take it (pinned jobs stay), and a
full queue's Retry-After is the lane's ETA, not a constant second."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import QueueFull
from spillover.runtime.scheduler import Job, Scheduler
from spillover.runtime.worker_client import WorkerClient
from spillover.testing import FakeClock
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024


def _scheduler(
    memory: MemoryModel, clock: FakeClock, cpu_depth: int = 8
) -> tuple[Scheduler, WorkerClient, WorkerClient]:
    ledger = DeviceLedger("sim", 4096 * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, clock())
    s = Scheduler(
        gpu_lane=LaneConfig(slots=1),
        cpu_lane=LaneConfig(slots=1, queue_depth=cpu_depth),
        ledger=ledger,
        policy=AdmissionPolicy(memory=memory, delay_max_s=2.0),
        clock=clock,
    )
    gpu, cpu = ready_worker("gpu0", "gpu"), ready_worker("cpu0", "cpu")
    s.gpu_workers.append(gpu)
    s.cpu_workers.append(cpu)
    return s, gpu, cpu


def test_a_job_routed_to_a_busy_cpu_lane_goes_back_to_the_gpu_when_it_frees(memory: MemoryModel) -> None:
    """GPU busy past the delay bound: B is routed to the CPU lane, where it waits (CPU busy
    too). When the GPU frees first, B starts there (route gpu); a job pinned to the CPU stays."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, cpu = _scheduler(memory, clock)
        a = Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(a)
        assert (await a.future).route == "gpu"
        cpu.claim_slot("someone")  # the CPU lane is busy as well
        b = Job(rid="b", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        pinned = Job(rid="p", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(b)
        s.submit_nowait(pinned, lane="cpu")
        clock.advance(3.0)  # past the delay bound: B is routed to the CPU lane
        s.pump_once()
        assert sorted(j.rid for j in s.cpu.queue) == ["b", "p"] and not b.future.done()
        gpu.release_slot("a")
        s.finished("a", a.dispatch, "ok")  # type: ignore[arg-type]
        s.pump_once()
        d = await asyncio.wait_for(b.future, 1)
        assert d.route == "gpu" and d.reserve_bytes > 0
        assert [j.rid for j in s.cpu.queue] == ["p"] and not pinned.future.done()
        assert s.rebound_total == 1
        assert s.decisions[-1]["rid"] == "b" and s.decisions[-1]["route"] == "gpu"

    asyncio.run(main())


def test_a_failover_waiting_on_a_busy_cpu_lane_goes_back_to_the_device_after_the_delay_bound(
    memory: MemoryModel,
) -> None:
    """Round 19: a request that failed over from the GPU waited on a busy CPU lane until its
    queue_timeout (a 503) while the restarted GPU worker stood ready and idle. A failover's job
    goes to the CPU replica first, and once the CPU lane has not started it within
    ``delay_max_s`` the device takes it back through admission; before that it stays, and a
    job the client pinned to the CPU stays whatever the wait."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _gpu, cpu = _scheduler(memory, clock)
        cpu.claim_slot("someone")  # the CPU lane is busy
        failover = Job(rid="f", prompt_tokens=8, max_tokens=8, arrived_s=clock(), returns=True)
        pinned = Job(rid="p", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(failover, lane="cpu")
        s.submit_nowait(pinned, lane="cpu")
        s.pump_once()
        assert not failover.future.done()  # the replica first, while the GPU is free
        assert s._delay_due == pytest.approx(clock() + 2.0)  # a pass when the bound is reached
        clock.advance(1.9)
        s.pump_once()
        assert not failover.future.done()
        clock.advance(0.2)
        s.pump_once()
        d = await asyncio.wait_for(failover.future, 1)
        assert d.route == "gpu" and d.reserve_bytes > 0 and s.rebound_total == 1
        assert [j.rid for j in s.cpu.queue] == ["p"] and not pinned.future.done()
        clock.advance(30.0)
        s.pump_once()
        assert [j.rid for j in s.cpu.queue] == ["p"] and not pinned.future.done()

    asyncio.run(main())


def test_a_failover_returns_only_as_sized_and_after_a_cpu_pass(memory: MemoryModel) -> None:
    """Round 22: a returning failover that admission would shrink stays (sized for the CPU
    lane, a shrunk continuation could end inside what its client already has), where a job
    admission routed there moves shrunk; and with ``delay_max_s`` 0 a failover still meets the
    CPU lane first (it went straight back to the GPU)."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _gpu, cpu = _scheduler(memory, clock)
        cpu.claim_slot("someone")
        big = Job(rid="f", prompt_tokens=8, max_tokens=10**6, arrived_s=clock(), allow_shrink=True, returns=True)
        s.submit_nowait(big, lane="cpu")
        clock.advance(5.0)
        s.pump_once()
        assert not big.future.done() and s.rebound_total == 0
        big.returns, big.movable = False, True  # the same job, routed there by admission: it moves
        s.pump_once()
        assert (await asyncio.wait_for(big.future, 1)).shrunk

        clock2 = FakeClock(100.0)
        s2, _gpu2, cpu2 = _scheduler(memory, clock2)
        assert s2.policy is not None
        s2.policy = dataclasses.replace(s2.policy, delay_max_s=0.0)
        cpu2.claim_slot("someone")
        f = Job(rid="f", prompt_tokens=8, max_tokens=8, arrived_s=clock2(), returns=True)
        s2.submit_nowait(f, lane="cpu")
        s2.pump_once()
        assert not f.future.done()  # the CPU lane's pass first
        clock2.advance(0.5)
        s2.pump_once()
        assert (await asyncio.wait_for(f.future, 1)).route == "gpu"

    asyncio.run(main())


def test_a_continuation_goes_back_only_to_a_worker_of_the_failed_ones_fingerprint(memory: MemoryModel) -> None:
    """Round 21: a greedy stream that had sent tokens went back to the split worker, whose
    numerics (its batch) differ from the failed GPU worker's: nothing proved the continuation
    token-identical. A continuation (``Job.fingerprint``) moves only to device workers with the
    failed worker's compatibility and numerics, as the CPU replica must have them."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, cpu = _scheduler(memory, clock)
        cpu.claim_slot("someone")
        gpu.info = {"fingerprint": {"compat": "c1", "numerics": "n-batch-128"}}
        job = Job(rid="f", prompt_tokens=8, max_tokens=8, arrived_s=clock(), returns=True)
        job.fingerprint = ("c1", "n-batch-512")
        s.submit_nowait(job, lane="cpu")
        clock.advance(5.0)
        s.pump_once()
        assert not job.future.done() and s.rebound_total == 0  # other numerics: it waits for the CPU
        gpu.info = {"fingerprint": {"compat": "c1", "numerics": "n-batch-512"}}  # the failed one, restarted
        s.pump_once()
        assert (await asyncio.wait_for(job.future, 1)).route == "gpu"

    asyncio.run(main())


def test_a_chat_rows_why_says_the_host_guard_holds_its_cpu_work(memory: MemoryModel) -> None:
    """Round 19: while a request waited on the CPU lane held by the host-RAM guard, the chat
    model's /v1/status row, where its requests start on the CPU lane, did not say so; only the
    document's reasons said ``host_budget``. The row says they wait and why, as a service's
    does; where they start on the device, the row says that (round 21)."""
    from spillover.config import CpuLaneConfig
    from spillover.core.routing import Reason
    from spillover.runtime.chat import ChatModel

    async def main() -> None:
        clock = FakeClock(100.0)
        gpu_s, _gpu, gpu_cpu = _scheduler(memory, clock)
        cpu_only = Scheduler(gpu_lane=None, cpu_lane=LaneConfig(slots=1), ledger=None, policy=None, clock=clock)
        cpu_only.cpu_workers.append(cpu := ready_worker("cpu0", "cpu"))
        for s, worker, starts in ((gpu_s, gpu_cpu, ("gpu", "fits")), (cpu_only, cpu, ("cpu", "cpu_lane"))):
            chat = ChatModel("m", (), "normal", "m.gguf", LaneConfig(), CpuLaneConfig(), scheduler=s)
            row = chat.status_row(None, primary=True)
            assert (row["where"], row["why"]) == starts
            worker.claim_slot("someone")  # (the guard holds a free slot; a busy one keeps the job queued here)
            s.submit_nowait(Job(rid="p", prompt_tokens=8, max_tokens=8, arrived_s=clock()), lane="cpu")
            s.cpu_blocked = Reason.HOST_BUDGET  # as the last pass found it
            row = chat.status_row(None, primary=True)
            # a request that starts on the device does not wait for the guard (round 21)
            held = ("none", "host_budget") if starts[0] == "cpu" else starts
            assert (row["where"], row["why"], row["queued"]) == (*held, 1)
            s.cpu_blocked = Reason.CPU_SLOTS_BUSY  # held by its slots: the row is as before
            assert chat.status_row(None, primary=True)["why"] != "host_budget"

    asyncio.run(main())


def test_a_full_queue_says_retry_after_its_eta(memory: MemoryModel) -> None:
    """Retry-After of a full CPU queue is when its queued work is likely done (from the lane's
    measured speed), growing with the backlog, not a constant second."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _gpu, cpu = _scheduler(memory, clock, cpu_depth=3)
        cpu.claim_slot("someone")
        s.record_timing("cpu", prompt_tokens=100, completion_tokens=100, prefill_s=1.0, total_s=11.0)
        for i in range(3):
            s.submit_nowait(Job(rid=f"j{i}", prompt_tokens=100, max_tokens=100, arrived_s=clock()), lane="cpu")
        with pytest.raises(QueueFull) as e:
            s.check_room_nowait("cpu")
        eta = s.cpu.estimated_delay_s(clock())
        assert eta > 10 and e.value.retry_after_s == pytest.approx(eta)

    asyncio.run(main())


def test_a_job_waits_while_an_earlier_attempt_of_its_request_still_holds_its_reservation(
    memory: MemoryModel,
) -> None:
    """Round 26: a failover's return to the device, while the failed attempt's worker had not
    let go of the request yet (its reservation still out under the request's id), raised
    ``KeyError`` from the ledger inside the pass: a 500. The job now waits until that
    reservation is back, then takes the device."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _gpu, cpu = _scheduler(memory, clock)
        assert s.ledger is not None
        s.ledger.force_reserve("f", 8 * MIB, clock(), "request")  # the failed attempt's, not back yet
        cpu.claim_slot("someone")  # the CPU lane is busy
        failover = Job(rid="f", prompt_tokens=8, max_tokens=8, arrived_s=clock(), returns=True)
        s.submit_nowait(failover, lane="cpu")
        clock.advance(2.1)  # past the delay bound: it may return
        s.pump_once()
        assert not failover.future.done() and [j.rid for j in s.cpu.queue + s.gpu.queue] == ["f"]
        s.ledger.release("f", clock())  # its worker let go
        s.pump_once()
        d = await asyncio.wait_for(failover.future, 1)
        assert d.route == "gpu" and s.ledger.holds("f")

    asyncio.run(main())
