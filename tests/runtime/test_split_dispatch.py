"""The scheduler's split route: a job the resident profile cannot take runs on a split worker
(its own reservation, released like a GPU one) instead of the CPU lane, when it fits there."""

from __future__ import annotations

import asyncio
import dataclasses

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.runtime.scheduler import Job, Scheduler
from spillover.runtime.worker_client import WorkerClient
from spillover.testing import FakeClock
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024


def _scheduler(
    memory: MemoryModel, clock: FakeClock, *, resident: bool, capacity_mib: int = 4096
) -> tuple[Scheduler, WorkerClient | None, WorkerClient, WorkerClient]:
    ledger = DeviceLedger("sim", capacity_mib * MIB, 16 * MIB, freshness_s=1e9)
    ledger.observe(0, clock())
    s = Scheduler(
        gpu_lane=LaneConfig(slots=1),
        cpu_lane=LaneConfig(slots=1),
        ledger=ledger,
        policy=AdmissionPolicy(memory=memory, delay_max_s=2.0),
        clock=clock,
    )
    gpu = ready_worker("gpu0", "gpu") if resident else None
    if gpu is not None:
        s.gpu_workers.append(gpu)
    split, cpu = ready_worker("split0", "split"), ready_worker("cpu0", "cpu")
    s.split_workers.append(split)
    s.cpu_workers.append(cpu)
    s.split_memory = dataclasses.replace(memory, n_batch=128, n_gpu_layers=10)
    s.split_ctx_cap_tokens = 1024
    return s, gpu, split, cpu


def test_only_a_split_on_the_device_serves_every_device_job_there(memory: MemoryModel) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, _ = _scheduler(memory, clock, resident=False)
        job = Job(rid="a", prompt_tokens=100, max_tokens=50, arrived_s=clock())
        s.submit_nowait(job)
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, str(d.reason), d.worker) == ("split", "resident_does_not_fit", split)
        assert s.split_memory is not None and s.ledger is not None
        fp = s.split_memory.request_footprint(100, 50)
        assert (d.reserve_bytes, d.kv_tokens) == (fp.total_bytes, fp.kv_tokens)
        assert s.ledger.held_bytes("a") == fp.total_bytes and split.claimed == {"a"}
        assert s.split_total == 1 and s.decisions[-1]["route"] == "split"
        split.release_slot("a")
        s.finished("a", d, "ok")
        assert not s.ledger.holds("a")  # released exactly like a GPU reservation

    asyncio.run(main())


def test_what_the_resident_cannot_take_goes_to_the_split_with_the_admissions_reason(memory: MemoryModel) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, split, _ = _scheduler(memory, clock, resident=True)
        assert gpu is not None
        first = Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(first)
        assert (await first.future).route == "gpu"
        busy = Job(rid="b", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(busy)
        clock.advance(3.0)  # past the delay bound: admission routes it off the GPU
        s.pump_once()
        d = await asyncio.wait_for(busy.future, 1)
        assert (d.route, str(d.reason), d.worker) == ("split", "gpu_busy", split)
        row = s.statistics()[0]  # the GPU lane's: both take its jobs, both count (it left the split out)
        assert (row.lane, row.running, row.slots) == ("gpu", 2, gpu.spec.slots + split.spec.slots)

    asyncio.run(main())


def test_a_job_the_split_cannot_take_keeps_the_admissions_decision(memory: MemoryModel) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, cpu = _scheduler(memory, clock, resident=False)
        long = Job(rid="long", prompt_tokens=900, max_tokens=200, arrived_s=clock())  # past its 1024 cap
        s.submit_nowait(long)
        d = await asyncio.wait_for(long.future, 1)
        assert (d.route, str(d.reason), d.worker) == ("cpu", "too_long_for_gpu", cpu)  # the split's cap
        cpu.release_slot("long")
        split.claim_slot("someone")  # no free split slot: it waits, bounded as admission's delay
        busy = Job(rid="b", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(busy)
        assert not busy.future.done()
        clock.advance(2.1)  # past delay_max_s: the CPU lane, for want of a split slot (not "GPU unavailable")
        s.pump_once()
        d = await asyncio.wait_for(busy.future, 1)
        assert (d.route, str(d.reason)) == ("cpu", "gpu_busy")

    asyncio.run(main())


def test_a_split_reservation_that_does_not_fit_the_ledger_goes_to_the_cpu(memory: MemoryModel) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, _, _ = _scheduler(memory, clock, resident=False, capacity_mib=20)  # 4 MiB usable
        assert s.split_memory is not None
        assert s.split_memory.request_footprint(100, 50).total_bytes > 4 * MIB
        job = Job(rid="a", prompt_tokens=100, max_tokens=50, arrived_s=clock())
        s.submit_nowait(job)
        assert not job.future.done()  # it waits for room, bounded
        clock.advance(2.1)
        s.pump_once()
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, str(d.reason)) == ("cpu", "kv_pages_exhausted")  # no room on the device: not "unavailable"
        assert s.split_total == 0

    asyncio.run(main())


def test_a_split_slot_that_frees_within_the_delay_takes_the_job(memory: MemoryModel) -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, _ = _scheduler(memory, clock, resident=False)
        first = Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(first)
        d = await asyncio.wait_for(first.future, 1)
        waiting = Job(rid="b", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(waiting)
        assert not waiting.future.done()
        clock.advance(1.0)
        split.release_slot("a")
        s.finished("a", d, "ok")
        s.pump_once()
        d2 = await asyncio.wait_for(waiting.future, 1)
        assert (d2.route, d2.worker) == ("split", split)
        # only split decisions: a job waiting for the split records no route off it
        assert s.decision_counts == {"split:resident_does_not_fit": 2}

    asyncio.run(main())


def test_the_split_worker_has_its_own_breaker(memory: MemoryModel) -> None:
    """Failed split attempts open the split breaker (not the GPU's): the next job goes the
    admission's way (the CPU lane); after the cooldown one probe goes to the split again, and
    successful probes close it."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, split, cpu = _scheduler(memory, clock, resident=False)
        assert s.policy is not None
        for i in range(s.policy.breaker.failure_threshold):
            job = Job(rid=f"f{i}", prompt_tokens=8, max_tokens=8, arrived_s=clock())
            s.submit_nowait(job)
            d = await asyncio.wait_for(job.future, 1)
            assert d.route == "split"
            split.release_slot(job.rid)
            s.finished(job.rid, d, "failed")
        assert (s.split_breaker.circuit.value, s.breaker.circuit.value) == ("open", "closed")
        job = Job(rid="after", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(job)
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, str(d.reason), d.worker) == ("cpu", "breaker_open", cpu)
        cpu.release_slot("after")
        s.finished("after", d, "ok")
        clock.advance(s.split_breaker.cooldown_s + 0.1)
        s.pump_once()
        assert s.split_breaker.circuit.value == "half_open"
        for i in range(s.policy.breaker.close_after_successes):
            probe = Job(rid=f"p{i}", prompt_tokens=8, max_tokens=8, arrived_s=clock())
            s.submit_nowait(probe)
            d = await asyncio.wait_for(probe.future, 1)
            assert (d.route, d.probe_round) == ("split", s.split_breaker.opens)
            other = Job(rid=f"o{i}", prompt_tokens=8, max_tokens=8, arrived_s=clock())
            s.submit_nowait(other)  # one probe at a time: the next one goes the admission's way
            assert (await asyncio.wait_for(other.future, 1)).route == "cpu"
            cpu.release_slot(other.rid)
            split.release_slot(probe.rid)
            s.finished(probe.rid, d, "ok")
        assert s.split_breaker.circuit.value == "closed" and gpu is None

    asyncio.run(main())


def test_a_refusal_while_the_split_breaker_is_open_waits_for_its_cooldown(memory: MemoryModel) -> None:
    """Only the split on the device, no CPU route: while its breaker is open a job is refused
    naming the breaker, with a Retry-After of at least the breaker's cooldown."""
    from spillover.core.breaker import BreakerPolicy
    from spillover.errors import CapacityError

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, _ = _scheduler(memory, clock, resident=False)
        assert s.policy is not None
        s.policy = dataclasses.replace(s.policy, allow_cpu_route=False, breaker=BreakerPolicy(cooldown_s=20.0))
        for i in range(s.policy.breaker.failure_threshold):
            job = Job(rid=f"f{i}", prompt_tokens=8, max_tokens=8, arrived_s=clock())
            s.submit_nowait(job)
            d = await asyncio.wait_for(job.future, 1)
            split.release_slot(job.rid)
            s.finished(job.rid, d, "failed")
        assert s.split_breaker.circuit.value == "open"
        refused = Job(rid="x", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(refused)
        try:
            await asyncio.wait_for(refused.future, 1)
        except CapacityError as exc:
            assert "breaker_open" in str(exc) and exc.retry_after_s >= 20.0, (str(exc), exc.retry_after_s)
        else:
            raise AssertionError("served while the only device worker's breaker is open and no CPU route")

    asyncio.run(main())


def test_quiescence_counts_a_split_probe_still_in_flight() -> None:
    """The invariants' quiescence check sees the split breaker too: a probe never released is
    a violation, as it is on the GPU breaker."""
    from spillover.testing.invariants import violations

    probe = {"circuit": "half_open", "probes_in_flight": 1}
    assert violations({"workers": [], "split_breaker": probe}) == ["split breaker half-open with 1 probes in flight"]
    assert violations({"workers": [], "breaker": probe}) == ["breaker half-open with 1 probes in flight"]
    assert violations({"workers": [], "split_breaker": {"circuit": "closed", "probes_in_flight": 0}}) == []


def test_where_a_request_would_start_now_is_decided_as_a_pass_would_with_nothing_taken(memory: MemoryModel) -> None:
    """``where_now`` (/v1/status's service row while nothing waits) follows the state, not the
    last decision: a busy split says so, a free one takes small requests again."""
    clock = FakeClock(100.0)
    s, _, split, _ = _scheduler(memory, clock, resident=False)
    assert s.where_now() == ("split", "resident_does_not_fit")
    split.claim_slot("someone")
    assert s.where_now() == ("none", "gpu_busy")  # it waits for the split (bounded): not "GPU unavailable"
    split.release_slot("someone")
    assert s.where_now() == ("split", "resident_does_not_fit")
    assert s.ledger is not None and not s.ledger.holds("") and s.split_total == 0  # nothing taken
    small, _, _, _ = _scheduler(memory, clock, resident=False, capacity_mib=20)
    assert small.where_now() == ("none", "kv_pages_exhausted")  # it waits for room for the split's reservation
    resident, gpu, _, _ = _scheduler(memory, clock, resident=True)
    assert resident.where_now() == ("gpu", "fits")
    assert gpu is not None
    gpu.claim_slot("x")  # the resident busy: admission waits for it (bounded), nothing starts now
    assert resident.where_now() == ("none", "gpu_busy")


def test_where_now_counts_the_room_the_next_reading_gives_back(memory: MemoryModel) -> None:
    """Right after the split worker loads, its weights are in the reading and still counted as
    unconfirmed until the next one (``settling_bytes``): a pass would wait that one reading, so
    the row says ``split``, not that the device is full."""
    clock = FakeClock(100.0)
    s, _, _, _ = _scheduler(memory, clock, resident=False)
    assert s.split_memory is not None
    fp = s.split_memory.request_footprint(1, 1).total_bytes
    weights = 2 * fp
    s.ledger = DeviceLedger("sim", 16 * MIB + weights + fp + 4096, 16 * MIB, freshness_s=1e9)
    s.ledger.force_reserve("split0-weights", weights, clock(), kind="weights")
    s.ledger.observe(weights, clock())
    s.ledger.confirm("split0-weights", clock())  # after the reading was taken: counted twice
    assert s.ledger.headroom(clock()) == fp + 4096 - weights < fp
    assert s.where_now() == ("split", "resident_does_not_fit")
    clock.advance(0.1)
    s.ledger.observe(weights, clock())  # the next reading: nothing settling any more
    assert s.ledger.settling_bytes() == 0 and s.where_now() == ("split", "resident_does_not_fit")


def test_where_now_says_gpu_while_the_resident_only_waits_for_its_own_weights_to_settle(
    memory: MemoryModel,
) -> None:
    """The same for the resident: right after its load admission delays one reading
    (``kv_pages_exhausted`` on the double count), and the row says ``gpu``, not ``none``."""
    clock = FakeClock(100.0)
    s, gpu, _, _ = _scheduler(memory, clock, resident=True)
    assert s.policy is not None and gpu is not None
    fp = s.policy.memory.request_footprint(1, 1).total_bytes
    weights = 2 * fp
    s.split_workers.clear()  # the resident alone
    s.ledger = DeviceLedger("sim", 16 * MIB + weights + fp + 4096, 16 * MIB, freshness_s=1e9)
    s.ledger.force_reserve("gpu0-weights", weights, clock(), kind="weights")
    s.ledger.observe(weights, clock())
    s.ledger.confirm("gpu0-weights", clock())

    async def main() -> None:
        job = Job(rid="a", prompt_tokens=1, max_tokens=1, arrived_s=clock())
        s.submit_nowait(job)
        assert not job.future.done()  # a pass delays it: the double count leaves no room now
        assert s.decision_counts == {"delay:kv_pages_exhausted": 1}
        assert s.where_now() == ("gpu", "fits")
        assert gpu is not None
        gpu.claim_slot("x")  # no free slot: the delay is a real wait
        assert s.where_now() == ("none", "kv_pages_exhausted")

    asyncio.run(main())


def test_the_cpu_profile_says_the_model_does_not_fit_not_that_the_gpu_is_unavailable(memory: MemoryModel) -> None:
    """No worker on the device, by plan (``core.profiles``' cpu profile): a job goes to the CPU
    lane as ``resident_does_not_fit``, and /v1/status's row says the same; the GPU is not
    'unavailable', the model does not fit it."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, _ = _scheduler(memory, clock, resident=False)
        s.split_workers.remove(split)  # the cpu profile: nothing runs on the device, by plan
        s.off_device = True
        assert s.where_now() == ("cpu", "resident_does_not_fit")
        job = Job(rid="a", prompt_tokens=10, max_tokens=5, arrived_s=clock())
        s.submit_nowait(job)
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, str(d.reason)) == ("cpu", "resident_does_not_fit")

    asyncio.run(main())


def test_a_job_longer_than_the_split_runs_there_shrunk_when_the_client_allows_it(memory: MemoryModel) -> None:
    """Only the split runs (cap 1024): a job of 100 + 1500 tokens that allows shrinking runs on
    the idle split worker with max_tokens 924, flagged shrunk; one that does not goes to the
    CPU lane as too long for the device (before, both went to the CPU as 'GPU not available')."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, _ = _scheduler(memory, clock, resident=False)
        job = Job(rid="a", prompt_tokens=100, max_tokens=1500, arrived_s=clock(), allow_shrink=True)
        s.submit_nowait(job)
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, str(d.reason), d.worker, d.max_tokens, d.shrunk) == (
            "split",
            "resident_does_not_fit",
            split,
            924,
            True,
        )
        assert s.split_memory is not None
        assert d.kv_tokens == s.split_memory.request_footprint(100, 924).kv_tokens
        split.release_slot("a")
        s.finished("a", d, "ok")
        whole = Job(rid="b", prompt_tokens=100, max_tokens=1500, arrived_s=clock())
        s.submit_nowait(whole)
        d = await asyncio.wait_for(whole.future, 1)
        assert (d.route, str(d.reason)) == ("cpu", "too_long_for_gpu")

    asyncio.run(main())


def test_a_job_waiting_on_the_cpu_lane_runs_on_the_split_worker_once_it_frees(memory: MemoryModel) -> None:
    """Late binding onto the split, as onto the GPU: a job that left for the CPU lane (its wait
    for a busy split past ``delay_max_s``) and has not started there runs on the split worker
    when a slot frees, so the split does not idle while it waits behind slower CPU work (a
    helper's burst of 12: 11 went to the CPU and ended up to 28 s later, the split idle after
    4.4 s). A job pinned to the CPU (the client's choice) stays."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, _, split, cpu = _scheduler(memory, clock, resident=False)
        split.claim_slot("someone")
        cpu.claim_slot("other")  # both busy
        job = Job(rid="a", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        pinned = Job(rid="p", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(pinned, lane="cpu")
        s.submit_nowait(job)
        clock.advance(2.1)
        s.pump_once()  # past delay_max_s: the admission's way, the CPU lane, where it waits
        assert not job.future.done() and list(s.cpu.queue) == [pinned, job] and job.movable
        split.release_slot("someone")
        s.pump_once()
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, str(d.reason), d.worker) == ("split", "resident_does_not_fit", split)
        assert s.rebound_total == 1 and s.split_total == 1 and list(s.cpu.queue) == [pinned]
        assert s.ledger is not None and s.ledger.holds("a")  # its reservation was made
        split.release_slot("a")
        s.pump_once()
        assert not pinned.future.done() and list(s.cpu.queue) == [pinned]  # the client's choice stays

    asyncio.run(main())


def test_a_job_longer_than_the_split_moves_there_from_the_cpu_lane_shrunk(memory: MemoryModel) -> None:
    """Late binding shrinks as a new job's dispatch does: a request sent without
    ``max_tokens`` (open-ended, shrinkable, longer than the split's cap) that went to the CPU
    lane after its wait runs on the split once a slot frees, shrunk to the split's cap (a
    reviewer's case: it stayed behind CPU work while the split idled, and a newer identical
    job went to the split ahead of it)."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s, gpu, split, cpu = _scheduler(memory, clock, resident=True)
        assert gpu is not None
        gpu.claim_slot("g")
        split.claim_slot("someone")
        cpu.claim_slot("other")  # every lane busy
        job = Job(rid="a", prompt_tokens=48, max_tokens=2000, arrived_s=clock(), allow_shrink=True)
        s.submit_nowait(job)
        clock.advance(2.1)
        s.pump_once()  # past delay_max_s: the CPU lane, where it waits
        assert not job.future.done() and list(s.cpu.queue) == [job] and job.movable
        split.release_slot("someone")
        s.pump_once()
        d = await asyncio.wait_for(job.future, 1)
        assert (d.route, d.worker, d.max_tokens, d.shrunk) == ("split", split, 1024 - 48, True)
        assert s.rebound_total == 1 and not s.cpu.queue
        assert s.split_memory is not None and s.ledger is not None
        assert s.ledger.held_bytes("a") == s.split_memory.request_footprint(48, 1024 - 48).total_bytes

    asyncio.run(main())
