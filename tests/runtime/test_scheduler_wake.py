"""The scheduler wakes on events or at the earliest deadline a pass can act on, not on a
polling tick: a queued job's maximum age, the end of an admission delay, the breaker's
cooldown, the host-guard recheck; an idle scheduler sleeps the safety-net interval."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import replace

import pytest

from spillover.config import LaneConfig
from spillover.core.breaker import BreakerState, Circuit
from spillover.core.reasons import Reason
from spillover.errors import CapacityError
from spillover.runtime.scheduler import HOST_RECHECK_S, IDLE_WAKE_S, Job, Scheduler
from spillover.runtime.ticks import TICK_S
from spillover.testing import FakeClock
from tests.runtime.fakes import watch_timers


def scheduler(clock: FakeClock) -> Scheduler:
    return Scheduler(gpu_lane=None, cpu_lane=LaneConfig(queue_max_age_s=3.0), ledger=None, policy=None, clock=clock)


def test_idle_scheduler_wakes_only_for_the_safety_net() -> None:
    """Nothing queued, breaker closed: the next pass is the idle interval away."""
    clock = FakeClock(100.0)
    s = scheduler(clock)
    assert s._due(clock()) == 100.0 + IDLE_WAKE_S


def test_queued_job_wakes_the_scheduler_at_its_maximum_age() -> None:
    """A job waiting with no free slot: the pass that expires it is due at enqueued + max age
    (earlier than the idle interval when it is closer)."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s = scheduler(clock)  # no CPU worker: the job stays queued
        s.submit_nowait(Job(rid="a", prompt_tokens=4, max_tokens=4, arrived_s=clock()), lane="cpu")
        clock.advance(2.8)
        assert s._due(clock()) == 103.0
        s._delay_due = 102.9
        assert s._due(clock()) == 102.9  # an admission delay that ends sooner wins

    asyncio.run(main())


def test_a_device_change_wakes_the_pump_only_for_waiting_work() -> None:
    """``look_again`` (a reading changed, another service took or gave back bytes) wakes a scheduler
    with a queued job, and leaves one with empty queues asleep; ``kick`` always wakes it."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s = scheduler(clock)
        s.look_again()
        assert not s._wake.is_set()
        s.kick()
        assert s._wake.is_set()
        s._wake.clear()
        s.submit_nowait(Job(rid="a", prompt_tokens=4, max_tokens=4, arrived_s=clock()), lane="cpu")
        s._wake.clear()
        s.look_again()
        assert s._wake.is_set()

    asyncio.run(main())


def test_open_breaker_wakes_at_the_end_of_its_cooldown() -> None:
    """An open breaker: the pass that moves it to half-open is due when the cooldown ends."""
    clock = FakeClock(100.0)
    s = scheduler(clock)
    s.breaker = replace(BreakerState(), circuit=Circuit.OPEN, opened_at_s=100.0, cooldown_s=0.2)
    assert s._due(clock()) == 100.2


def test_work_held_by_the_host_guard_is_looked_at_again_soon() -> None:
    """CPU work blocked by the host-RAM guard is re-checked every HOST_RECHECK_S."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s = scheduler(clock)
        s.submit_nowait(Job(rid="a", prompt_tokens=4, max_tokens=4, arrived_s=clock()), lane="cpu")
        assert s._due(clock()) == 100.0 + IDLE_WAKE_S  # no worker: a worker's start is an event
        s._host_held = True  # as a pass sets it when the host guard refuses the job
        assert s._due(clock()) == 100.0 + HOST_RECHECK_S

    asyncio.run(main())


def test_a_cpu_job_that_waited_its_maximum_age_says_what_held_it() -> None:
    """The queue_timeout of CPU work the host-RAM guard (or full slots) held names that hold,
    not only "waited 3s": a failover the guard can never admit says why it was not run."""

    async def main() -> None:
        clock = FakeClock(100.0)
        s = scheduler(clock)
        job = Job(rid="a", prompt_tokens=4, max_tokens=4, arrived_s=clock())
        s.submit_nowait(job, lane="cpu")
        s.cpu_blocked = Reason.HOST_BUDGET  # as the last pass found it
        clock.advance(3.1)
        s.pump_once()
        with pytest.raises(CapacityError, match=r"waited 3s in the cpu queue \(held: host_budget\)") as err:
            job.future.result()
        assert err.value.code == "queue_timeout"

    asyncio.run(main())


def test_an_idle_pass_waits_on_the_shared_tick_and_a_deadline_exactly() -> None:
    """``run``: with nothing due, the next pass waits for the safety net, whose timer is a grid
    point of ``runtime.ticks`` (it wakes with the periodic loops, not on a wake-up of its own);
    a queued job's maximum age is waited for to the moment, off the grid."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        asked: list[float] = []  # the loop's time when each pass set its wait (a loaded machine runs them late)
        # the pass's wait, not this test's sleeps
        whens = watch_timers(
            loop, only=lambda cb: getattr(cb, "__qualname__", "").startswith("Timeout."), asked_at=asked
        )
        clock = FakeClock(100.0)
        s = scheduler(clock)
        task = asyncio.create_task(s.run())
        await asyncio.sleep(0.01)  # one pass: idle
        s.submit_nowait(Job(rid="a", prompt_tokens=4, max_tokens=4, arrived_s=clock()), lane="cpu")
        clock.advance(2.8)  # the job's maximum age (3 s) is 0.2 s away
        kicked_at = loop.time()
        s.kick()
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert len(whens) == 2
        (net, deadline), (idle_at, pass_at) = whens, asked
        assert abs(net - idle_at - IDLE_WAKE_S) <= TICK_S / 2 + 0.001
        assert math.isclose(net / TICK_S, round(net / TICK_S), abs_tol=1e-6)
        assert pass_at >= kicked_at  # the second pass is the kick's
        assert abs(deadline - pass_at - 0.2) <= 0.001  # the job's maximum age, to the moment
        return whens

    asyncio.run(main())
