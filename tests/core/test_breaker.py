"""The circuit breaker's transition table with a fake clock; each row pinned by a state written out by
hand (not derived from the table under test)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.breaker import (
    ATTEMPT_OUTCOMES,
    TABLE,
    BreakerEvent,
    BreakerPolicy,
    BreakerState,
    Circuit,
    advance,
    allows,
    attempt_ended,
    probe_started,
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


def test_a_success_with_nothing_to_clear_keeps_the_state() -> None:
    """Every request a healthy worker finishes is a success: with no failure counted it
    changes nothing, and makes no new state (issue 13 item 5: a copy per request)."""
    b = BreakerState()
    assert advance(b, E.SUCCESS, 5, P) is b
    failed = advance(b, E.FAILURE, 1, P)
    assert advance(failed, E.SUCCESS, 2, P) == replace(failed, failures=0, first_failure_s=0.0)


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


# -- the table, row by row -------------------------------------------------------------------
# Every expected state below is written out in full, so a deleted row (advance raises), a row
# pointing at the wrong step, or a step that sets one field wrong all fail.

R = BreakerPolicy(
    failure_threshold=3,
    window_s=10,
    cooldown_s=2,
    cooldown_max_s=8,
    flap_window_s=60,
    half_open_probes=1,
    close_after_successes=2,
    probe_timeout_s=30,
)
CL, OP, HO = Circuit.CLOSED, Circuit.OPEN, Circuit.HALF_OPEN
B = BreakerState

CLOSED_WITH_HISTORY = B(CL, failures=1, first_failure_s=3.0, opened_at_s=1.0, cooldown_s=2.0, opens=1)
OPEN_TWICE = B(OP, opened_at_s=10.0, cooldown_s=4.0, opens=2)
HALF_OPEN_IDLE = B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2)
HALF_OPEN_PROBING = B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=1, probe_started_s=14.0)

ROWS: list[tuple[str, BreakerState, BreakerEvent, float, BreakerState]] = [
    # CLOSED
    (
        "closed success clears the count and the window start",
        B(CL, failures=2, first_failure_s=5.0, opened_at_s=1.0, cooldown_s=2.0, opens=1),
        E.SUCCESS,
        7.0,
        B(CL, failures=0, first_failure_s=0.0, opened_at_s=1.0, cooldown_s=2.0, opens=1),
    ),
    ("closed first failure starts a window", B(), E.FAILURE, 4.0, B(CL, failures=1, first_failure_s=4.0)),
    (
        "closed failure inside a window that starts at t=5",
        B(CL, failures=1, first_failure_s=5.0),
        E.FAILURE,
        12.0,
        B(CL, failures=2, first_failure_s=5.0),
    ),
    (
        "closed failure exactly window_s after the first still counts",
        B(CL, failures=1, first_failure_s=5.0),
        E.FAILURE,
        15.0,
        B(CL, failures=2, first_failure_s=5.0),
    ),
    (
        "closed failure after the window starts a new one",
        B(CL, failures=2, first_failure_s=5.0),
        E.FAILURE,
        15.5,
        B(CL, failures=1, first_failure_s=15.5),
    ),
    (
        "closed third failure in the window opens",
        B(CL, failures=2, first_failure_s=5.0),
        E.FAILURE,
        14.0,
        B(OP, opened_at_s=14.0, cooldown_s=2.0, opens=1),
    ),
    (
        "closed severe failure opens at once",
        B(CL, failures=1, first_failure_s=3.0),
        E.SEVERE_FAILURE,
        4.0,
        B(OP, opened_at_s=4.0, cooldown_s=2.0, opens=1),
    ),
    ("closed tick changes nothing", CLOSED_WITH_HISTORY, E.TICK, 100.0, CLOSED_WITH_HISTORY),
    ("closed probe release changes nothing", CLOSED_WITH_HISTORY, E.PROBE_RELEASED, 4.0, CLOSED_WITH_HISTORY),
    # OPEN
    ("open success changes nothing", OPEN_TWICE, E.SUCCESS, 11.0, OPEN_TWICE),
    ("open failure changes nothing", OPEN_TWICE, E.FAILURE, 11.0, OPEN_TWICE),
    ("open severe failure changes nothing", OPEN_TWICE, E.SEVERE_FAILURE, 11.0, OPEN_TWICE),
    ("open probe release changes nothing", OPEN_TWICE, E.PROBE_RELEASED, 11.0, OPEN_TWICE),
    ("open tick before the cooldown waits", OPEN_TWICE, E.TICK, 13.9, OPEN_TWICE),
    ("open tick at the cooldown goes half-open", OPEN_TWICE, E.TICK, 14.0, HALF_OPEN_IDLE),
    # HALF_OPEN
    (
        "half-open probe takes a place and starts the clock",
        HALF_OPEN_IDLE,
        E.PROBE,
        14.5,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=1, probe_started_s=14.5),
    ),
    (
        "half-open second probe keeps the oldest start",
        HALF_OPEN_PROBING,
        E.PROBE,
        20.0,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=2, probe_started_s=14.0),
    ),
    (
        "half-open first success gives the probe's place back",
        HALF_OPEN_PROBING,
        E.SUCCESS,
        15.0,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probe_successes=1, probe_started_s=14.0),
    ),
    (
        "half-open success with two in flight frees one place",
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=2, probe_started_s=14.0),
        E.SUCCESS,
        15.0,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=1, probe_successes=1, probe_started_s=14.0),
    ),
    (
        "half-open success without a probe in flight stays at zero",
        HALF_OPEN_IDLE,
        E.SUCCESS,
        15.0,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probe_successes=1),
    ),
    (
        "half-open second success closes, keeping the open history",
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=1, probe_successes=1, probe_started_s=16.0),
        E.SUCCESS,
        17.0,
        B(CL, opened_at_s=10.0, cooldown_s=4.0, opens=2),
    ),
    (
        "half-open failure re-opens with a doubled cooldown",
        HALF_OPEN_PROBING,
        E.FAILURE,
        15.0,
        B(OP, opened_at_s=15.0, cooldown_s=8.0, opens=3),
    ),
    (
        "half-open severe failure re-opens the same way",
        HALF_OPEN_PROBING,
        E.SEVERE_FAILURE,
        15.0,
        B(OP, opened_at_s=15.0, cooldown_s=8.0, opens=3),
    ),
    ("half-open tick at exactly the probe timeout waits", HALF_OPEN_PROBING, E.TICK, 44.0, HALF_OPEN_PROBING),
    (
        "half-open tick past the probe timeout re-opens",
        HALF_OPEN_PROBING,
        E.TICK,
        44.5,
        B(OP, opened_at_s=44.5, cooldown_s=8.0, opens=3),
    ),
    ("half-open tick with no probe waits", HALF_OPEN_IDLE, E.TICK, 1000.0, HALF_OPEN_IDLE),
    (
        "half-open probe release frees the place, keeps the clock",
        HALF_OPEN_PROBING,
        E.PROBE_RELEASED,
        15.0,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probe_started_s=14.0),
    ),
    (
        "half-open probe release with two in flight frees one",
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=2, probe_started_s=14.0),
        E.PROBE_RELEASED,
        15.0,
        B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=2, probes_in_flight=1, probe_started_s=14.0),
    ),
    (
        "half-open probe release with none in flight stays at zero",
        HALF_OPEN_IDLE,
        E.PROBE_RELEASED,
        15.0,
        HALF_OPEN_IDLE,
    ),
]


@pytest.mark.parametrize(("why", "start", "event", "now", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_breaker_row(why: str, start: BreakerState, event: BreakerEvent, now: float, expected: BreakerState) -> None:
    """Each row: a state, an event at a time, and the whole resulting state written out by hand."""
    assert advance(start, event, now, R) == expected, why


@pytest.mark.parametrize("circuit", [Circuit.CLOSED, Circuit.OPEN])
def test_probe_outside_half_open_raises(circuit: Circuit) -> None:
    """PROBE is only an event of HALF_OPEN; elsewhere it raises a ValueError naming both."""
    with pytest.raises(ValueError, match=f"^breaker: probe is not allowed in {circuit.value}$"):
        advance(BreakerState(circuit=circuit), E.PROBE, 0.0, R)


def test_table_lists_exactly_sixteen_rows() -> None:
    """The table has the 16 (state, event) rows written here: every pair but PROBE outside HALF_OPEN."""
    expected = {
        (CL, E.SUCCESS),
        (CL, E.FAILURE),
        (CL, E.SEVERE_FAILURE),
        (CL, E.TICK),
        (CL, E.PROBE_RELEASED),
        (OP, E.SUCCESS),
        (OP, E.FAILURE),
        (OP, E.SEVERE_FAILURE),
        (OP, E.TICK),
        (OP, E.PROBE_RELEASED),
        (HO, E.SUCCESS),
        (HO, E.FAILURE),
        (HO, E.SEVERE_FAILURE),
        (HO, E.TICK),
        (HO, E.PROBE),
        (HO, E.PROBE_RELEASED),
    }
    assert set(TABLE) == expected


@pytest.mark.parametrize(
    ("opened_at", "cooldown", "now", "new_cooldown"),
    [
        (10.0, 2.0, 69.99, 4.0),  # re-opened inside the flap window: doubled
        (10.0, 2.0, 70.0, 2.0),  # exactly flap_window_s later: not flapping, back to the base
        (10.0, 4.0, 200.0, 2.0),  # long after: back to the base whatever it was
        (50.0, 2.0, 55.0, 4.0),  # a window that does not start at t=0
        (10.0, 8.0, 12.0, 8.0),  # doubling stops at cooldown_max_s
        (10.0, 6.0, 12.0, 8.0),  # ... and is clipped to it
    ],
)
def test_reopen_cooldown_hysteresis(opened_at: float, cooldown: float, now: float, new_cooldown: float) -> None:
    """A re-open within flap_window_s of the last one doubles the cooldown (capped); later ones reset it."""
    start = B(HO, opened_at_s=opened_at, cooldown_s=cooldown, opens=1)
    assert advance(start, E.FAILURE, now, R) == B(OP, opened_at_s=now, cooldown_s=new_cooldown, opens=2)


def test_flapping_counts_across_a_close() -> None:
    """Closing does not forget the last opening: failing again soon after re-opens with a doubled cooldown."""
    closed = B(CL, opened_at_s=50.0, cooldown_s=4.0, opens=2)
    assert advance(closed, E.SEVERE_FAILURE, 60.0, R) == B(OP, opened_at_s=60.0, cooldown_s=8.0, opens=3)


@pytest.mark.parametrize(
    ("state", "now", "retry_after"),
    [
        (B(CL), 5.0, 0.0),
        (B(HO, opened_at_s=10.0, cooldown_s=4.0, opens=1), 11.0, 0.0),
        (B(OP, opened_at_s=10.0, cooldown_s=4.0, opens=1), 11.0, 3.0),
        (B(OP, opened_at_s=10.0, cooldown_s=4.0, opens=1), 14.0, 0.0),
        (B(OP, opened_at_s=10.0, cooldown_s=4.0, opens=1), 20.0, 0.0),
    ],
)
def test_retry_after(state: BreakerState, now: float, retry_after: float) -> None:
    """Only an OPEN breaker asks to wait, for what is left of its cooldown, never less than zero."""
    assert state.retry_after_s(now) == pytest.approx(retry_after)


def test_successful_probe_gives_its_place_back() -> None:
    """With one probe place, a successful probe frees it, so the next probe is let through."""
    b = advance(advance(BreakerState(), E.SEVERE_FAILURE, 0, P), E.TICK, 2.0, P)
    b = advance(b, E.PROBE, 2.0, P)
    assert not allows(b, P)
    b = advance(b, E.SUCCESS, 2.5, P)
    assert b.circuit is Circuit.HALF_OPEN and allows(b, P)


@pytest.mark.parametrize(
    ("circuit", "in_flight", "allowed"),
    [
        (Circuit.CLOSED, 0, True),
        (Circuit.OPEN, 0, False),
        (Circuit.HALF_OPEN, 0, True),
        (Circuit.HALF_OPEN, 1, True),
        (Circuit.HALF_OPEN, 2, False),
        (Circuit.HALF_OPEN, 3, False),
    ],
)
def test_allows(circuit: Circuit, in_flight: int, allowed: bool) -> None:
    """CLOSED lets work through, OPEN does not, HALF_OPEN while probes are below half_open_probes (2)."""
    two = BreakerPolicy(half_open_probes=2)
    assert allows(BreakerState(circuit=circuit, probes_in_flight=in_flight), two) is allowed


# Rule 7: an attempt's start and end. (circuit, opens, probes_in_flight) before; the attempt's
# outcome and probe round; the (circuit, probes_in_flight, probe_successes) after.
HALF = BreakerState(circuit=Circuit.HALF_OPEN, opens=2, opened_at_s=0.0, cooldown_s=2.0, probes_in_flight=1)


@pytest.mark.parametrize(
    ("why", "start", "outcome", "probe_round", "after"),
    [
        ("a probe of this round succeeds", HALF, "ok", 2, (Circuit.HALF_OPEN, 0, 1)),
        ("a probe of this round is released", HALF, "cancelled", 2, (Circuit.HALF_OPEN, 0, 0)),
        ("a client's own fault releases the probe", HALF, "client", 2, (Circuit.HALF_OPEN, 0, 0)),
        ("an older round's success says nothing", HALF, "ok", 1, (Circuit.HALF_OPEN, 1, 0)),
        ("an attempt from before half-open says nothing", HALF, "ok", None, (Circuit.HALF_OPEN, 1, 0)),
        ("an older round's release says nothing", HALF, "cancelled", 1, (Circuit.HALF_OPEN, 1, 0)),
        ("any failure re-opens, probe or not", HALF, "failed", None, (Circuit.OPEN, 0, 0)),
        ("a severe failure re-opens", HALF, "severe", 1, (Circuit.OPEN, 0, 0)),
        ("closed: a success clears", BreakerState(failures=2, first_failure_s=4.0), "ok", None, (Circuit.CLOSED, 0, 0)),
        ("closed: a severe failure opens", BreakerState(), "severe", None, (Circuit.OPEN, 0, 0)),
    ],
)
def test_attempt_ended(
    why: str, start: BreakerState, outcome: str, probe_round: int | None, after: tuple[Circuit, int, int]
) -> None:
    """Each row: how an attempt's end moves the breaker (rule 7)."""
    b = attempt_ended(start, outcome, probe_round, 5.0, P)
    assert (b.circuit, b.probes_in_flight, b.probe_successes) == after, why
    if outcome == "ok" and start.circuit is Circuit.CLOSED:
        assert b.failures == 0


def test_an_unknown_outcome_is_a_bug() -> None:
    """Only the listed outcomes feed the breaker."""
    assert set(ATTEMPT_OUTCOMES) == {"ok", "failed", "severe", "cancelled", "client"}
    with pytest.raises(KeyError):
        attempt_ended(BreakerState(), "maybe", None, 0.0, P)


def test_probe_started_only_while_half_open() -> None:
    """A start while half-open is a probe of round ``opens``; otherwise nothing changes."""
    b, round_ = probe_started(replace(HALF, probes_in_flight=0), 5.0, P)
    assert (round_, b.probes_in_flight, b.probe_started_s) == (2, 1, 5.0)
    for state in (BreakerState(), BreakerState(circuit=Circuit.OPEN, opens=1)):
        same, none = probe_started(state, 5.0, P)
        assert (same, none) == (state, None)
