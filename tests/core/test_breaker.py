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
