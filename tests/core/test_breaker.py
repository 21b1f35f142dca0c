"""The circuit breaker's transition table with a fake clock."""

from __future__ import annotations

import pytest

from spillover.core.breaker import (
    TABLE,
    BreakerEvent,
    BreakerPolicy,
    BreakerState,
    Circuit,
    advance,
    allows,
)

P = BreakerPolicy(
    failure_threshold=3,
    window_s=10,
    cooldown_s=2,
    cooldown_max_s=8,
    flap_window_s=60,
    half_open_probes=1,
    close_after_successes=2,
)
E = BreakerEvent


def test_threshold_failures_within_window_open() -> None:
    """Three failures inside the window open the breaker; fewer do not."""
    b = BreakerState()
    b = advance(b, E.FAILURE, 0.0, P)
    b = advance(b, E.FAILURE, 1.0, P)
    assert b.circuit is Circuit.CLOSED and allows(b, P)
    b = advance(b, E.FAILURE, 2.0, P)
    assert b.circuit is Circuit.OPEN and not allows(b, P)


def test_failures_outside_window_do_not_open() -> None:
    """Failures spread beyond window_s restart the count."""
    b = BreakerState()
    for t in (0.0, 11.0, 22.0, 33.0):
        b = advance(b, E.FAILURE, t, P)
    assert b.circuit is Circuit.CLOSED


def test_success_clears_failures() -> None:
    """A success in CLOSED resets the failure count."""
    b = advance(advance(BreakerState(), E.FAILURE, 0, P), E.FAILURE, 1, P)
    b = advance(b, E.SUCCESS, 2, P)
    assert b.failures == 0


def test_severe_failure_opens_at_once() -> None:
    """A classified OOM/crash opens the breaker on the first occurrence."""
    assert advance(BreakerState(), E.SEVERE_FAILURE, 0, P).circuit is Circuit.OPEN


def test_open_goes_half_open_after_cooldown_and_closes_after_probes() -> None:
    """OPEN -> HALF_OPEN after cooldown; probes are bounded; successes close it."""
    b = advance(BreakerState(), E.SEVERE_FAILURE, 0, P)
    assert advance(b, E.TICK, 1.9, P).circuit is Circuit.OPEN
    b = advance(b, E.TICK, 2.0, P)
    assert b.circuit is Circuit.HALF_OPEN and allows(b, P)
    b = advance(b, E.PROBE, 2.0, P)
    assert not allows(b, P)  # one probe at a time
    b = advance(b, E.SUCCESS, 2.5, P)
    assert b.circuit is Circuit.HALF_OPEN
    b = advance(b, E.PROBE, 2.6, P)
    b = advance(b, E.SUCCESS, 3.0, P)
    assert b.circuit is Circuit.CLOSED


def test_half_open_failure_reopens_with_longer_cooldown() -> None:
    """A probe failure re-opens; re-opening within the flap window doubles the cooldown."""
    b = advance(BreakerState(), E.SEVERE_FAILURE, 0, P)
    b = advance(b, E.TICK, 2.0, P)
    b = advance(b, E.FAILURE, 2.1, P)
    assert b.circuit is Circuit.OPEN and b.cooldown_s == 4
    b = advance(advance(b, E.TICK, 6.1, P), E.FAILURE, 6.2, P)
    assert b.cooldown_s == 8
    b = advance(advance(b, E.TICK, 14.2, P), E.FAILURE, 14.3, P)
    assert b.cooldown_s == 8  # capped
    assert b.retry_after_s(15.3) == pytest.approx(7.0)


@pytest.mark.parametrize("circuit", list(Circuit))
@pytest.mark.parametrize("event", list(BreakerEvent))
def test_table_is_total_or_raises(circuit: Circuit, event: BreakerEvent) -> None:
    """Each (state, event) either has a row or raises without changing anything."""
    b = BreakerState(circuit=circuit)
    if (circuit, event) in TABLE:
        assert isinstance(advance(b, event, 0.0, P), BreakerState)
    else:
        with pytest.raises(ValueError):
            advance(b, event, 0.0, P)


def test_released_probe_frees_its_place_without_counting() -> None:
    """A cancelled probe (PROBE_RELEASED) lets the next probe in and neither closes nor opens."""
    b = advance(advance(BreakerState(), E.SEVERE_FAILURE, 0, P), E.TICK, 2.0, P)
    b = advance(b, E.PROBE, 2.0, P)
    assert not allows(b, P)
    b = advance(b, E.PROBE_RELEASED, 2.5, P)
    assert b.circuit is Circuit.HALF_OPEN
    assert b.probes_in_flight == 0 and b.probe_successes == 0
    assert allows(b, P)


def test_lost_probe_reopens_after_probe_timeout() -> None:
    """HALF_OPEN is bounded: a probe in flight past probe_timeout_s re-opens on tick, not before."""
    p = BreakerPolicy(cooldown_s=2, probe_timeout_s=30)
    b = advance(advance(BreakerState(), E.SEVERE_FAILURE, 10, p), E.TICK, 12, p)
    b = advance(b, E.PROBE, 13, p)
    assert advance(b, E.TICK, 43, p).circuit is Circuit.HALF_OPEN  # exactly the bound: still waiting
    reopened = advance(b, E.TICK, 43.01, p)
    assert reopened.circuit is Circuit.OPEN and reopened.opened_at_s == 43.01


def test_half_open_tick_without_probe_waits() -> None:
    """HALF_OPEN with no probe in flight does not time out, whatever the clock says."""
    p = BreakerPolicy(cooldown_s=2, probe_timeout_s=30)
    b = advance(advance(BreakerState(), E.SEVERE_FAILURE, 0, p), E.TICK, 2, p)
    assert advance(b, E.TICK, 1000, p).circuit is Circuit.HALF_OPEN


def test_probe_timeout_counts_from_the_oldest_probe() -> None:
    """A second probe does not extend the first one's deadline."""
    p = BreakerPolicy(cooldown_s=2, probe_timeout_s=30, half_open_probes=2)
    b = advance(advance(BreakerState(), E.SEVERE_FAILURE, 0, p), E.TICK, 2, p)
    b = advance(advance(b, E.PROBE, 5, p), E.PROBE, 20, p)
    assert b.probe_started_s == 5
    assert advance(b, E.TICK, 36, p).circuit is Circuit.OPEN


@pytest.mark.parametrize("circuit", [Circuit.CLOSED, Circuit.OPEN])
def test_probe_released_outside_half_open_changes_nothing(circuit: Circuit) -> None:
    """A cancelled request admitted while closed (or finishing after a trip) leaves the breaker as it was."""
    b = BreakerState(circuit=circuit, failures=2, first_failure_s=1.0, opened_at_s=3.0, cooldown_s=2.0)
    assert advance(b, E.PROBE_RELEASED, 4.0, P) == b
