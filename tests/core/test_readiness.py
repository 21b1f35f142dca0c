"""core.readiness: recovery times per mode, host cost per mode, and auto's pick."""

from __future__ import annotations

import pytest

from spillover.core.readiness import CHEAPEST_FIRST, Choice, Why, host_cost, initial_mode, pick, recovery_ms

T = {"load_ms": 300.0, "ctx_ms": 40.0, "first_ms": 60.0}
W, C, SLOTS = 100, 30, 2
COST = {m: host_cost(m, weights_bytes=W, context_bytes=C, slots=SLOTS) for m in CHEAPEST_FIRST}
ROOM = 10_000


def choose(budget: float, room: int = ROOM, current: str = "warm", configured: str = "auto") -> Choice:
    return pick(configured, budget, recovery_ms(T), COST, room, current=current, step_bytes=C)


def test_recovery_is_the_steps_a_mode_still_has_to_take() -> None:
    assert recovery_ms(T) == {"warm": 60.0, "mmap": 100.0, "on_demand": 400.0}


def test_without_a_gpu_lane_auto_keeps_the_model_loaded_whatever_the_budget() -> None:
    for budget in (1, 100, 100_000):
        c = pick("auto", budget, recovery_ms(T), COST, ROOM, current="on_demand", step_bytes=C, alone=True)
        assert (c.mode, c.why) == ("mmap", Why.NO_GPU_LANE)
    c = pick("auto", 1, recovery_ms(T), COST, W - 1, current="mmap", step_bytes=C, alone=True)
    assert (c.mode, c.why) == ("on_demand", Why.HOST_SHORT)  # the room still bounds it
    c = pick("warm", 1, recovery_ms(T), COST, ROOM, current="mmap", step_bytes=C, alone=True)
    assert (c.mode, c.why) == ("warm", Why.CONFIGURED)


@pytest.mark.parametrize("missing", ["load_ms", "ctx_ms", "first_ms"])
def test_no_prediction_until_every_step_is_measured(missing: str) -> None:
    assert recovery_ms({k: v for k, v in T.items() if k != missing}) == {}


def test_host_cost_per_mode() -> None:
    assert COST == {"warm": W + SLOTS * C, "mmap": W, "on_demand": 0}
    with pytest.raises(ValueError):
        host_cost("auto", weights_bytes=W, context_bytes=C, slots=SLOTS)


@pytest.mark.parametrize(
    ("budget", "mode", "why"),
    [
        (1000, "on_demand", Why.WITHIN_BUDGET),  # loose: the cheapest
        (400, "on_demand", Why.WITHIN_BUDGET),  # exactly the on_demand figure meets it
        (399.9, "mmap", Why.WITHIN_BUDGET),
        (100, "mmap", Why.WITHIN_BUDGET),
        (99, "warm", Why.WITHIN_BUDGET),  # tight: only warm meets it
        (60, "warm", Why.WITHIN_BUDGET),
        (10, "warm", Why.OVER_BUDGET),  # none meets it: the fastest, and says so
    ],
)
def test_auto_takes_the_cheapest_mode_that_meets_the_budget(budget: float, mode: str, why: Why) -> None:
    c = choose(budget)
    assert (c.mode, c.why, c.wanted) == (mode, why, mode)


def test_a_configured_mode_is_kept_whatever_the_budget() -> None:
    for mode in CHEAPEST_FIRST:
        assert choose(1, configured=mode) == Choice(mode, Why.CONFIGURED, mode)
        assert choose(100_000, configured=mode) == Choice(mode, Why.CONFIGURED, mode)


def test_host_room_bounds_a_configured_mode_too() -> None:
    assert choose(1, room=W, configured="warm") == Choice("mmap", Why.HOST_SHORT, "warm")
    assert choose(1, room=0, configured="mmap") == Choice("on_demand", Why.HOST_SHORT, "mmap")
    assert choose(1, room=0, configured="on_demand") == Choice("on_demand", Why.CONFIGURED, "on_demand")
    # room below nothing (the machine already past host_min_free_mib): on_demand keeps nothing to
    # shed, so it is what was configured, not host_short
    assert choose(1, room=-1, configured="on_demand") == Choice("on_demand", Why.CONFIGURED, "on_demand")
    assert choose(5000, room=-1) == Choice("on_demand", Why.WITHIN_BUDGET, "on_demand")


def test_a_replica_starts_in_the_cheapest_mode_its_configuration_allows() -> None:
    starts = [initial_mode(m) for m in ("auto", "warm", "mmap", "on_demand")]
    assert starts == ["on_demand", "mmap", "mmap", "on_demand"]


def test_not_measured_yet_keeps_warm() -> None:
    c = pick("auto", 1000, {}, COST, ROOM, current="on_demand", step_bytes=C)
    assert (c.mode, c.why) == ("warm", Why.NOT_MEASURED)


def test_host_short_steps_down_to_the_fastest_mode_the_room_holds() -> None:
    # the budget wants warm (160 bytes) but only the model fits: mmap, flagged host_short
    c = choose(99, room=W + C, current="warm")
    assert (c.mode, c.why, c.wanted) == ("mmap", Why.HOST_SHORT, "warm")
    # not even the model fits: on_demand
    c = choose(99, room=W - 1, current="warm")
    assert (c.mode, c.why, c.wanted) == ("on_demand", Why.HOST_SHORT, "warm")


def test_staying_needs_exactly_the_cost_moving_up_needs_one_more_context() -> None:
    warm = COST["warm"]
    # already warm: room for exactly warm keeps it
    assert choose(99, room=warm, current="warm").mode == "warm"
    # coming up from mmap: the same room is not enough (hysteresis), one more context is
    assert choose(99, room=warm, current="mmap").mode == "mmap"
    assert choose(99, room=warm + C - 1, current="mmap").mode == "mmap"
    assert choose(99, room=warm + C, current="mmap").mode == "warm"
    # up from on_demand to mmap likewise
    assert choose(100, room=W, current="on_demand").mode == "on_demand"
    assert choose(100, room=W + C, current="on_demand").mode == "mmap"


def test_moving_down_is_never_blocked_by_room() -> None:
    # a loose budget picks on_demand even with no room at all
    assert choose(5000, room=0, current="warm") == Choice("on_demand", Why.WITHIN_BUDGET, "on_demand")
