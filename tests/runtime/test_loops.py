"""The LoopGroup: every gateway task has one owner; a loop restarts or takes the gateway down."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from spillover.runtime.loops import LoopGroup

Loop = Callable[[], Awaitable[None]]


def forever(stopped: list[str], name: str) -> Loop:
    """A healthy loop that records its cancellation (its cleanup ran)."""

    async def run() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(name)

    return run


def failing(times: int, calls: list[int]) -> Loop:
    """A loop that raises ``times`` times, then runs healthily."""

    async def run() -> None:
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError(f"boom {len(calls)}")
        await asyncio.Event().wait()

    return run


async def settle(n: int = 50) -> None:
    """Let the ready tasks run (restart back-offs are 0 in these tests)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_failing_loop_is_restarted_and_counted_and_the_others_run_on() -> None:
    """A loop that raises twice is restarted twice (counted); a healthy sibling is untouched."""

    async def go() -> None:
        fatal: list[str] = []
        stopped: list[str] = []
        calls: list[int] = []
        group = LoopGroup(on_fatal=fatal.append, restart_s=0.0, max_failures=5)
        group.add("flaky", failing(2, calls))
        group.add("healthy", forever(stopped, "healthy"))
        await group.start()
        await settle()
        assert len(calls) == 3
        assert group.restarts == {"flaky": 2}
        assert stopped == [] and fatal == [] and group.fatal is None
        await group.stop()
        assert stopped == ["healthy"]

    asyncio.run(go())


def test_a_loop_that_keeps_failing_takes_the_gateway_down_loudly() -> None:
    """The max_failures-th failure within the window is fatal: on_fatal hears which loop,
    every other loop is cancelled (its cleanup ran), and no task is left."""

    async def go() -> None:
        fatal: list[str] = []
        stopped: list[str] = []
        calls: list[int] = []
        group = LoopGroup(on_fatal=fatal.append, restart_s=0.0, max_failures=3)
        group.add("broken", failing(100, calls))
        group.add("healthy", forever(stopped, "healthy"))
        await group.start()
        await settle()
        assert len(calls) == 3
        assert fatal == ["gateway loop broken failed 3 times in 300s"]
        assert group.fatal == fatal[0]
        assert stopped == ["healthy"]
        assert group.statistics().restarts == {"broken": 2}
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        await group.stop()

    asyncio.run(go())


def test_failures_spread_beyond_the_window_are_not_fatal() -> None:
    """Only failures within window_s count: one failure per window never adds up."""

    async def go() -> None:
        now = [0.0]
        fatal: list[str] = []
        calls: list[int] = []

        async def flaky() -> None:
            calls.append(1)
            now[0] += 100.0  # each failure comes 100 s after the last
            if len(calls) <= 6:
                raise RuntimeError("boom")
            await asyncio.Event().wait()

        group = LoopGroup(on_fatal=fatal.append, restart_s=0.0, max_failures=3, window_s=150.0, clock=lambda: now[0])
        group.add("flaky", flaky)
        await group.start()
        await settle()
        assert len(calls) == 7 and fatal == [] and group.restarts == {"flaky": 6}
        await group.stop()

    asyncio.run(go())


def test_a_loop_that_returns_is_restarted_too() -> None:
    """Returning is not an ending: the loop is restarted and counted like a failure."""

    async def go() -> None:
        calls: list[int] = []

        async def once() -> None:
            calls.append(1)
            if len(calls) > 1:
                await asyncio.Event().wait()

        group = LoopGroup(on_fatal=lambda why: None, restart_s=0.0)
        group.add("once", once)
        await group.start()
        await settle()
        assert len(calls) == 2 and group.restarts == {"once": 1}
        await group.stop()

    asyncio.run(go())


def test_a_failed_one_off_task_is_counted_not_fatal_and_stop_cancels_the_rest() -> None:
    """A spawned task that raises is counted and the group runs on; stop() cancels a
    spawned task that is still running (its cleanup runs)."""

    async def go() -> None:
        fatal: list[str] = []
        stopped: list[str] = []
        group = LoopGroup(on_fatal=fatal.append, restart_s=0.0)
        group.add("healthy", forever(stopped, "healthy"))
        await group.start()

        async def bad() -> None:
            raise ValueError("replay failed")

        group.spawn("bad", bad())
        group.spawn("slow", forever(stopped, "slow")())
        await settle()
        assert group.tasks_failed == 1 and fatal == [] and stopped == []
        await group.stop()
        assert sorted(stopped) == ["healthy", "slow"]
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(go())
