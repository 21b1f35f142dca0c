"""Periodic sleeps on the shared grid (``runtime.ticks``): where each ends, one timer per grid
point whoever waits for it, and cancellation of one sleeper only."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

from spillover.runtime import ticks
from spillover.runtime.ticks import TICK_S
from tests.runtime.fakes import watch_timers

T = TypeVar("T")
LOOPS: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop, uvloop.new_event_loop]


def run(make_loop: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, T]) -> T:
    loop = make_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def on_grid(t: float) -> bool:
    return math.isclose(t / TICK_S, round(t / TICK_S), abs_tol=1e-6)


@pytest.mark.parametrize("make_loop", LOOPS, ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("period", [0.0, 0.01, TICK_S / 2, TICK_S, 0.25, 0.3, 1.0])
def test_a_sleep_ends_on_the_grid_within_half_a_tick_of_its_period(
    make_loop: Callable[[], asyncio.AbstractEventLoop], period: float
) -> None:
    async def body() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        due = await ticks.sleep(period)
        return t0, due, loop.time()

    t0, due, woke = run(make_loop, body())
    assert on_grid(due)
    assert due > t0  # always a grid point to come, never one gone by
    if period >= TICK_S / 2:
        assert period - TICK_S / 2 <= due - t0 <= period + TICK_S / 2 + 1e-9
    else:  # the next grid point
        assert due - t0 <= TICK_S + 1e-9
    assert woke >= due - 0.002  # uvloop's timers have a millisecond's resolution


@pytest.mark.parametrize("make_loop", LOOPS, ids=["asyncio", "uvloop"])
def test_loops_of_different_periods_share_one_timer_per_grid_point(
    make_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """Three periodic loops (every tick, every two ticks, every five) over ten ticks set one
    timer per grid point reached, not one per sleep."""

    async def body() -> tuple[list[float], dict[float, list[str]], float]:
        loop = asyncio.get_running_loop()
        whens = watch_timers(loop)
        woken: dict[float, list[str]] = {}
        late = [0.0]
        await ticks.sleep(0)  # start on a grid point, as the loops do after their first wake

        async def periodic(name: str, period: float, until: float) -> None:
            while True:
                due = await ticks.sleep(period)
                late[0] = max(late[0], loop.time() - due)
                woken.setdefault(round(due, 6), []).append(name)
                if due >= until - 1e-9:
                    return

        start = loop.time()
        end = math.floor(start / TICK_S + 0.5) * TICK_S + 10 * TICK_S
        await asyncio.gather(
            periodic("one", TICK_S, end), periodic("two", 2 * TICK_S, end), periodic("five", 5 * TICK_S, end)
        )
        return whens, woken, late[0]

    # A loop woken half a tick late (a loaded machine) counts its next sleep from then and skips a
    # grid point; the body runs again then (as the test below does), the assertions unchanged.
    for _ in range(3):
        whens, woken, late = run(make_loop, body())
        if late < TICK_S / 2:
            break
    sleeps = sum(len(names) for names in woken.values())
    assert sleeps == 10 + 5 + 2
    assert len(whens) == 1 + len(woken) == 1 + 10  # the first sleep's, then one a grid point
    assert all(on_grid(w) for w in whens)
    assert sorted(n for names in woken.values() for n in names if n == "five") == ["five", "five"]
    for due, names in woken.items():  # a slower loop always wakes with the faster one
        assert "one" in names, (due, names)


@pytest.mark.parametrize("make_loop", LOOPS, ids=["asyncio", "uvloop"])
def test_a_cancelled_sleep_leaves_the_others_of_its_grid_point(
    make_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def body() -> tuple[bool, float, float]:
        loop = asyncio.get_running_loop()
        await ticks.sleep(0)
        gone = asyncio.ensure_future(ticks.sleep(TICK_S))
        kept = asyncio.ensure_future(ticks.sleep(TICK_S))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        due = await kept
        return gone.cancelled(), due, loop.time()

    cancelled, due, woke = run(make_loop, body())
    assert cancelled
    assert on_grid(due) and woke >= due - 0.002


def test_each_event_loop_has_its_own_grid_points() -> None:
    """A sleep in one loop never waits for (or wakes) another loop's timer."""
    for make_loop in LOOPS * 2:
        due = run(make_loop, ticks.sleep(TICK_S))
        assert on_grid(due)


@pytest.mark.parametrize("make_loop", LOOPS, ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("period", [0.0, TICK_S / 3, TICK_S, 0.5])
def test_a_timeout_at_the_grid_point_fires_with_the_sleeps_of_that_point(
    make_loop: Callable[[], asyncio.AbstractEventLoop], period: float
) -> None:
    """Rule 4: ``at(period)`` is where ``sleep(period)`` ends; a safety net's
    ``timeout_at(at(period))`` sets its timer for that very time, so it fires in the turn in which
    the grid point's timer wakes the periodic sleeps (turns counted on asyncio's loop)."""

    async def body() -> tuple[float, float, list[float], list[int], float]:
        loop = asyncio.get_running_loop()
        await ticks.sleep(0)
        turn = [0]
        fired: list[int] = []  # the turn each timer's callback ran in
        real_once = getattr(loop, "_run_once", None)
        if real_once is not None:  # asyncio's loop: count its turns

            def run_once() -> None:
                turn[0] += 1
                real_once()

            loop._run_once = run_once  # type: ignore[attr-defined]
        whens = watch_timers(loop, on_fire=lambda: fired.append(turn[0]))
        when = ticks.at(period)
        sleeping = asyncio.ensure_future(ticks.sleep(period))
        entered = loop.time()  # a deadline already past when the safety net enters sets no timer
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(ticks.at(period)):
                await asyncio.Event().wait()
        return when, await sleeping, whens, fired, entered

    # The test's own setup races a loaded machine: the grid point may pass between ``at`` and
    # the sleep's start, or before the safety net enters (asyncio then calls it soon, no timer).
    # Either way the body runs again; the assertions below are unchanged.
    for _ in range(3):
        when, due, whens, fired, entered = run(make_loop, body())
        if when == due and entered < due:
            break
    assert when == due and on_grid(due)
    assert whens == [due, due]  # the grid point's one timer, and the safety net's at the same time
    assert len(fired) == 2
    if make_loop is asyncio.new_event_loop:
        assert fired[0] == fired[1] > 0
