"""The per-token time bound (``runtime.watchdog``): as ``asyncio.timeout`` inside its block,
nothing outside it, and one timer for many blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from spillover.runtime.watchdog import Watchdog
from tests.runtime.fakes import watch_timers


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_a_block_still_waiting_at_its_bound_times_out() -> None:
    async def body() -> float:
        w = Watchdog()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with w.guard(0.05):
                await asyncio.sleep(5)
        w.close()
        return time.monotonic() - t0

    assert 0.04 <= run(body()) < 1.0  # type: ignore[operator]


def test_blocks_that_end_in_time_never_time_out_and_share_one_timer() -> None:
    """Many quick blocks under a long bound: no time-out, and the timer is set once."""

    async def body() -> int:
        w = Watchdog()
        loop = asyncio.get_running_loop()
        whens = watch_timers(loop)
        try:
            for _ in range(200):
                async with w.guard(10.0):
                    await asyncio.sleep(0)
        finally:
            w.close()
        return len(whens)

    assert run(body()) == 1


def test_it_never_cancels_outside_its_blocks() -> None:
    """A slow step between two guarded waits (a slow client) is not bounded; the next block
    gets its full bound again."""

    async def body() -> str:
        w = Watchdog()
        async with w.guard(0.05):
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)  # the old deadline passes here: nothing happens
        async with w.guard(0.5):  # room for a loaded machine's late wake: the old 0.05 is long past
            await asyncio.sleep(0.01)
        w.close()
        return "ok"

    assert run(body()) == "ok"


def test_a_timer_set_early_follows_a_later_deadline() -> None:
    """The timer set for a short bound fires before a later block's longer deadline: it
    waits on, and the later block times out at its own bound."""

    async def body() -> float:
        w = Watchdog()
        async with w.guard(0.05):
            pass
        async with w.guard(0.3):
            await asyncio.sleep(0.1)  # past the first bound, within the second
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with w.guard(0.1):
                await asyncio.sleep(5)
        w.close()
        return time.monotonic() - t0

    assert 0.09 <= run(body()) < 1.0  # type: ignore[operator]


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def body() -> bool:
        w = Watchdog()

        async def guarded() -> None:
            async with w.guard(10.0):
                await asyncio.sleep(5)

        task = asyncio.create_task(guarded())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        w.close()
        return True

    assert run(body())


def test_a_time_out_leaves_no_cancellation_behind() -> None:
    """After a time-out the task goes on: its next await is not cancelled."""

    async def body() -> str:
        w = Watchdog()
        with pytest.raises(TimeoutError):
            async with w.guard(0.01):
                await asyncio.sleep(1)
        await asyncio.sleep(0.02)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        w.close()
        return "ok"

    assert run(body()) == "ok"


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_bound_already_spent_guards_again_without_a_loop_turn_between(loop_name: str) -> None:
    """A bound of 0 (a request whose deadline passed) guarded twice in a row, with no loop turn
    in between (tokens already queued): the second guard found uvloop's timer for a time
    already past, a plain Handle without when(), and the request ended an internal error."""
    import uvloop

    async def body() -> str:
        w = Watchdog()
        for _ in range(3):
            async with w.guard(0):
                pass  # nothing awaited: the block ends before its bound is checked
        with pytest.raises(TimeoutError):
            async with w.guard(0):
                await asyncio.sleep(1)
        w.close()
        return "ok"

    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(body()) == "ok"


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_an_event_read_in_the_turn_its_bound_runs_out_is_not_lost(loop_name: str) -> None:
    """Rule 4: the loop was busy past the deadline, and the awaited event is read in the turn
    the expired timer fires (a worker's line that came in time). The block gets it; without
    the rule the timer ran first (uvloop: timers before the turn's callbacks; asyncio: before
    the block's wake-up) and the block timed out: a token read as a stall."""
    import uvloop

    async def body() -> int:
        w, q = Watchdog(), asyncio.Queue[int]()
        loop = asyncio.get_running_loop()

        async def consumer() -> int:
            async with w.guard(0.05):
                return await q.get()

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0)  # it waits, its bound set
        time.sleep(0.1)  # the loop is busy past the deadline
        loop.call_soon(q.put_nowait, 7)  # the line read in the turn the timer fires
        try:
            return await task
        finally:
            w.close()

    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(body()) == 7


def test_an_event_queued_at_the_second_look_holds_the_bound_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 4's ``pending``: the first look passed with nothing; the event is read in the
    turn of the second look, queued behind it (asyncio runs the turn's timers beside its I/O
    callbacks, before the block's wake-up). ``pending`` says it has come: no time-out. The
    same without ``pending`` times out (what the rule prevents is real)."""
    from spillover.runtime import watchdog

    monkeypatch.setattr(watchdog, "PENDING_GRACE_S", 0.3)  # the looks at 0.05 s and 0.35 s

    async def body(with_pending: bool) -> int:
        w, q = Watchdog(), asyncio.Queue[int]()
        loop = asyncio.get_running_loop()

        async def consumer() -> int:
            async with w.guard(0.05, (lambda: not q.empty()) if with_pending else None):
                return await q.get()

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0.15)  # after the first look, before the second
        assert not task.done()
        time.sleep(0.4)  # busy past the second look
        loop.call_soon(q.put_nowait, 7)  # read in the second look's turn, ahead of its timer
        try:
            return await task
        finally:
            w.close()

    assert run(body(True)) == 7
    with pytest.raises(TimeoutError):
        run(body(False))
