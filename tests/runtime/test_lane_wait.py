"""A lane's estimated wait (``Lane.estimated_delay_s``: Retry-After, ``/v1/status``, a queued
job's ``X-Spillover-Estimated-Delay-Ms``) on the slots of the workers that take its jobs, with
its running requests at the tokens its requests have been writing (round 62: the GPU lane's
configured slots left the split's out; a held lane read 0 with a job queued; an open-ended
running request counted its whole context)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from spillover.core.memory import MemoryModel
from spillover.runtime.scheduler import Job
from tests.runtime.fakes import ready_worker
from tests.runtime.test_deadlines import T0, _host, _scheduler


def _close(ms: int, seconds: float) -> bool:
    return abs(ms - 1000 * seconds) <= 1


def test_the_split_workers_slot_is_one_of_the_gpu_lanes(memory: MemoryModel) -> None:
    """Split-only (its one slot; ``[gpu_lane]`` says two, the resident's, which this profile
    does not run): a request running there is the lane's whole wait (round 62: 0)."""

    async def main() -> None:
        s, _clock, _split = _scheduler(memory, split=True)
        s.gpu.cfg = dataclasses.replace(s.gpu.cfg, slots=2)
        job = Job(rid="a", prompt_tokens=8, max_tokens=400, arrived_s=T0)
        s.submit_nowait(job)
        assert job.future.result().route == "split" and s.statistics()[0].slots == 1
        assert _close(s.statistics()[0].estimated_delay_ms, s.gpu.job_seconds(8, 400))

    asyncio.run(main())


def test_a_free_resident_slot_beside_a_busy_split_is_no_wait(memory: MemoryModel) -> None:
    """A resident with two slots and the split's one: a request running on the split and one
    on the resident leave a resident slot free, so the GPU lane's wait is 0 (round 62: its
    configured one slot made it 3.7 s)."""

    async def main() -> None:
        s, _clock, split = _scheduler(memory, split=True, resident=True)
        s.gpu_workers[0] = resident = ready_worker("gpu0", "gpu", slots=2)
        for worker, rid in ((resident, "on-resident"), (split, "on-split")):
            worker.claim_slot(rid)
            s.gpu.started(Job(rid=rid, prompt_tokens=8, max_tokens=400, arrived_s=T0), T0, 400)
        s.pump_once()
        stats = s.statistics()[0]
        assert (stats.running, stats.slots, stats.estimated_delay_ms) == (2, 3, 0)
        resident.claim_slot("third")
        s.gpu.started(Job(rid="third", prompt_tokens=8, max_tokens=40, arrived_s=T0), T0, 40)
        assert _close(s.statistics()[0].estimated_delay_ms, s.gpu.job_seconds(8, 40))  # the soonest to end

    asyncio.run(main())


def test_a_held_lane_waits_its_queued_work(memory: MemoryModel) -> None:
    """Two CPU slots, both free, held by the host-RAM guard with one job queued: nothing
    starts, so the wait is the queued work over the slots, not 0 (round 62: 0 ms in
    ``/v1/status``, Retry-After a second)."""

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        s.cpu_workers[0] = ready_worker("cpu0", "cpu", slots=2)
        s.host_view = lambda running: _host(budget_bytes=1)  # no room for a context
        held = Job(rid="held", prompt_tokens=8, max_tokens=400, arrived_s=T0)
        s.submit_nowait(held, lane="cpu")
        assert not held.future.done() and list(s.cpu.queue) == [held]
        assert _close(s.statistics()[-1].estimated_delay_ms, s.cpu.job_seconds(8, 400) / 2)
        assert s._retry_after_s(s.cpu) == pytest.approx(s.cpu.job_seconds(8, 400) / 2)

    asyncio.run(main())


def test_a_running_request_is_timed_at_what_the_lanes_requests_write(memory: MemoryModel) -> None:
    """An open-ended request (2,040 tokens of room) runs on the CPU lane's slot: before any
    request ended, its wait is that whole room; once requests have been ending after about 20
    tokens, it is 20 tokens' time; past that it is a long answer, timed at its whole room again
    (round 63: it counted as done, so Retry-After said a second while it held the slot); 0 once
    past that too."""

    async def main() -> None:
        s, clock, _gpu = _scheduler(memory)
        s.gpu_workers.clear()
        long = Job(rid="open", prompt_tokens=8, max_tokens=2040, arrived_s=T0)
        s.submit_nowait(long, lane="cpu")
        assert long.future.result().route == "cpu"

        def whole() -> float:  # its room's time at the lane's speed now
            return s.cpu.job_seconds(8, 2040)

        assert s.cpu.estimated_delay_s(clock()) == pytest.approx(whole())
        s.record_timing("cpu", prompt_tokens=8, completion_tokens=20, prefill_s=0.02, total_s=0.5)
        assert s.cpu.estimated_delay_s(clock()) == pytest.approx(s.cpu.job_seconds(8, 20))
        clock.advance(s.cpu.job_seconds(8, 20) + 0.01)
        assert s.cpu.estimated_delay_s(clock()) == pytest.approx(whole() - (clock() - T0))
        s.record_timing("cpu", prompt_tokens=8, completion_tokens=0, prefill_s=0.02, total_s=0.02)
        clock.advance(30.0)  # past any typical length: what is left of its room
        assert s._retry_after_s(s.cpu) == pytest.approx(whole() - (clock() - T0))
        clock.advance(whole())
        assert s.cpu.estimated_delay_s(clock()) == 0.0 and s._retry_after_s(s.cpu) == 1.0

    asyncio.run(main())


def test_the_chat_rows_eta_is_the_soonest_lane_with_workers(memory: MemoryModel) -> None:
    """The ``cpu`` profile (no device worker): the chat row's ``eta_s`` in ``/v1/status`` is
    the CPU lane's wait, not the empty GPU lane's 0 (round 63)."""
    from spillover.config import CpuLaneConfig, LaneConfig
    from spillover.runtime.chat import ChatModel

    async def main() -> None:
        s, _clock, _gpu = _scheduler(memory)
        s.gpu_workers.clear()
        s.off_device = True
        s.submit_nowait(Job(rid="long", prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        chat = ChatModel("m", (), "normal", "m.gguf", LaneConfig(), CpuLaneConfig(), scheduler=s)
        row = chat.status_row(None, primary=True)
        assert row["eta_s"] == pytest.approx(s.cpu.job_seconds(8, 400), abs=0.002)

    asyncio.run(main())


def test_the_chat_rows_eta_leaves_out_a_lane_whose_workers_are_down(memory: MemoryModel) -> None:
    """The device's worker dead and the CPU lane's one slot running a request: the chat row's
    ``eta_s`` is the CPU lane's wait, where a request starts now, not the dead device's empty
    lane's 0 (round 64); with the device back, its 0 again."""
    from spillover.config import CpuLaneConfig, LaneConfig
    from spillover.runtime.chat import ChatModel
    from spillover.runtime.worker_client import WorkerState

    async def main() -> None:
        s, _clock, gpu = _scheduler(memory)
        s.submit_nowait(Job(rid="long", prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        chat = ChatModel("m", (), "normal", "m.gguf", LaneConfig(), CpuLaneConfig(), scheduler=s)
        gpu.state = WorkerState.DEAD
        assert chat.status_row(None, primary=True)["eta_s"] == pytest.approx(s.cpu.job_seconds(8, 400), abs=0.002)
        gpu.state = WorkerState.READY
        assert chat.status_row(None, primary=True)["eta_s"] == 0

    asyncio.run(main())


@pytest.mark.parametrize("why", ["breaker open", "dead cpu worker"])
def test_the_chat_rows_eta_counts_only_the_slots_that_take_requests(memory: MemoryModel, why: str) -> None:
    """The device ready but its breaker open (its requests go to the CPU lane), or a second
    CPU worker dead beside the busy one: ``eta_s`` is the busy CPU slot's wait, not 0 (round
    66: the open breaker's device read as taking requests, the dead worker's slot as free)."""
    from spillover.config import CpuLaneConfig, LaneConfig
    from spillover.core.breaker import Circuit
    from spillover.runtime.chat import ChatModel
    from spillover.runtime.worker_client import WorkerState

    async def main() -> None:
        s, clock, gpu = _scheduler(memory)
        if why == "breaker open":
            s.breaker = dataclasses.replace(s.breaker, circuit=Circuit.OPEN, opened_at_s=clock(), cooldown_s=30.0)
        else:
            gpu.state = WorkerState.DEAD
            dead = ready_worker("cpu1", "cpu")
            dead.state = WorkerState.DEAD
            s.cpu_workers.append(dead)
        s.submit_nowait(Job(rid="long", prompt_tokens=8, max_tokens=400, arrived_s=T0), lane="cpu")
        chat = ChatModel("m", (), "normal", "m.gguf", LaneConfig(), CpuLaneConfig(), scheduler=s)
        assert chat.status_row(None, primary=True)["eta_s"] == pytest.approx(s.cpu.job_seconds(8, 400), abs=0.002)

    asyncio.run(main())


def test_the_typical_length_is_the_answers_not_the_attempts() -> None:
    """A continuation's attempt wrote 2 tokens of a 200-token answer: the lane's speed takes
    the 2, its typical answer length the 200 (round 63: it took the 2)."""
    from spillover.config import LaneConfig
    from spillover.runtime.lanes import Lane

    lane = Lane("cpu", LaneConfig())
    lane.record(8, 2, 0.02, 0.07, answer_tokens=200)
    assert lane.completion_tokens == 200 and lane.decode_tps == pytest.approx(1 / 0.05)
    lane.record(8, 100, 0.02, 2.5)  # a whole answer: its own tokens
    assert lane.completion_tokens == pytest.approx(200 + 0.3 * (100 - 200))
