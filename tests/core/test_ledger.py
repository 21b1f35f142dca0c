"""Device ledger: never over-commits, releases once, trusts only fresh observations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.core.ledger import RELEASE_SETTLE_S, DeviceLedger, LedgerStatistics, Reservation

MIB = 1024 * 1024


def make(cap: int = 100 * MIB, margin: int = 10 * MIB) -> DeviceLedger:
    return DeviceLedger("sim:100", cap, margin, freshness_s=1.0)


def test_headroom_is_capacity_less_margin_less_max_of_predicted_and_observed() -> None:
    """headroom = capacity - margin - max(predicted, observed + unconfirmed)."""
    led = make()
    led.observe(30 * MIB, 0.0)
    assert led.headroom(0.0) == 60 * MIB
    led.force_reserve("w", 40 * MIB, 0.0, "weights")
    led.confirm("w", 0.5)
    led.observe(40 * MIB, 1.0)  # a reading taken after the allocation was made
    assert led.headroom(1.0) == 50 * MIB


def test_granted_but_unconfirmed_is_added_to_the_reading() -> None:
    """A grant whose allocation the reading cannot contain yet is counted on top of it,
    so a released-but-not-yet-freed block and an in-flight grant are both counted."""
    led = make()
    led.observe(0, 0.0)
    assert led.reserve_nowait("a", 30 * MIB, 0.0) is not None
    led.confirm("a", 0.1)
    led.observe(30 * MIB, 0.2)  # reading shows a
    assert led.reserve_nowait("b", 30 * MIB, 0.3) is not None  # in flight, not in the reading
    led.release("a", 0.4)  # a done, but the reading (taken at 0.2) still shows its bytes
    assert led.predicted_bytes == 30 * MIB
    assert led.headroom(0.5) == 90 * MIB - (30 + 30) * MIB
    led.confirm("b", 0.6)
    led.observe(30 * MIB, 0.7)  # a freed, b allocated
    assert led.headroom(0.8) == 60 * MIB


def test_weights_kept_for_a_restart_are_not_granted_to_another_weights_load() -> None:
    """Rule 6: a worker (40 MiB of weights) died and will restart. Its room is not another
    load's (it went to a waiting load, and the restart then waited behind it for good), while
    requests may still use it for now; it is taken back by its own load, or dropped."""
    led = make()
    led.force_reserve("w", 40 * MIB, 0.0, "weights")
    led.confirm("w", 0.1)
    led.observe(40 * MIB, 0.2)
    led.release("w", 0.3)
    led.keep("w", 40 * MIB)
    led.observe(0, 0.4)  # its memory is freed
    assert led.kept_bytes() == 40 * MIB and led.kept_bytes(but="w") == 0 and led.predicted_bytes == 0
    assert led.headroom(0.4) == 90 * MIB  # nothing counted twice
    assert led.reserve_nowait("other/weights", 60 * MIB, 0.4, kind="weights") is None  # 90 - 40 kept
    assert led.reserve_nowait("other/weights", 50 * MIB, 0.4, kind="weights") is not None
    led.release("other/weights")
    assert led.reserve_nowait("req", 60 * MIB, 0.4) is not None  # requests are not held back
    led.release("req")
    assert led.reserve_nowait("w", 40 * MIB, 0.5, kind="weights") is not None  # its own: taken back
    assert led.kept_bytes() == 0
    led.release("w")
    led.keep("w", 40 * MIB)
    led.force_reserve("w", 40 * MIB, 0.6, "weights")  # a start recorded without a wait takes it back too
    assert led.kept_bytes() == 0
    led.keep("x", 10 * MIB)
    led.drop_kept("x")  # it will not restart
    led.drop_kept("nobody")
    assert led.kept_bytes() == 0


def test_stale_observation_is_not_trusted() -> None:
    """An observation older than freshness_s gives no headroom at all (None)."""
    led = make()
    led.observe(0, 0.0)
    assert led.headroom(1.0) is not None
    assert led.headroom(1.01) is None
    assert led.reserve_nowait("r", 1, 1.01) is None


def test_reserve_returns_none_when_it_does_not_fit() -> None:
    """Running out is a value: reserve_nowait returns None and holds nothing."""
    led = make()
    led.observe(0, 0.0)
    assert led.reserve_nowait("a", 80 * MIB, 0.0) is not None
    assert led.reserve_nowait("b", 11 * MIB, 0.0) is None
    assert not led.holds("b")


def test_fits_is_what_reserve_nowait_grants_and_settling_adds_the_next_readings_room() -> None:
    """``fits``: the room reserve_nowait grants (never negative bytes, never on a stale reading);
    with ``settling``, a model confirmed after the last reading is counted once, not twice."""
    led = make()
    assert not led.fits(MIB, 0.0)  # no reading yet
    led.observe(0, 0.0)
    assert led.fits(90 * MIB, 0.0) and not led.fits(90 * MIB + 1, 0.0) and not led.fits(-1, 0.0)
    led.force_reserve("w", 40 * MIB, 0.0, kind="weights")
    led.observe(40 * MIB, 0.0)
    led.confirm("w", 0.0)  # at the reading: it shows them, and they are still unconfirmed
    assert led.headroom(0.0) == 10 * MIB
    assert not led.fits(11 * MIB, 0.0) and led.fits(11 * MIB, 0.0, settling=True)
    assert led.fits(50 * MIB, 0.0, settling=True) and not led.fits(50 * MIB + 1, 0.0, settling=True)
    assert led.reserve_nowait("r", 11 * MIB, 0.0) is None  # reserving never counts the settling room


def test_release_exactly_once() -> None:
    """A second release of the same holder raises KeyError."""
    led = make()
    led.observe(0, 0.0)
    led.reserve_nowait("a", MIB, 0.0)
    led.release("a")
    with pytest.raises(KeyError):
        led.release("a")


def test_held_bytes_is_what_a_holder_holds_now() -> None:
    """A holder's bytes while it holds them; 0 before and after (no KeyError)."""
    led = make()
    led.observe(0, 0.0)
    assert led.held_bytes("w") == 0
    led.force_reserve("w", 7 * MIB, 0.0, kind="weights")
    led.reserve_nowait("r", 3 * MIB, 0.0)
    assert (led.held_bytes("w"), led.held_bytes("r")) == (7 * MIB, 3 * MIB)
    led.release("w")
    assert led.held_bytes("w") == 0 and led.held_bytes("r") == 3 * MIB


def test_settling_bytes_are_confirmed_since_the_last_reading() -> None:
    """Confirmed at or after the last reading: counted twice until the next one (settling);
    unconfirmed ones are not settling (no reading shows them yet); a later reading ends it."""
    led = make()
    led.force_reserve("w", 7 * MIB, 0.0, kind="weights")
    led.confirm("w", 0.0)
    assert led.settling_bytes() == 0  # no reading yet: nothing can be counted twice
    led.observe(0, 0.0)
    assert led.reserve_nowait("r", 3 * MIB, 0.0) is not None
    assert led.settling_bytes() == 7 * MIB  # confirmed at the reading's own time
    led.observe(0, 0.5)
    assert led.settling_bytes() == 0  # w's confirmation is in this reading; r is unconfirmed
    led.observe(5 * MIB, 1.0)
    led.confirm("w", 1.0)  # at the reading's own time: it may or may not be in it
    assert led.settling_bytes() == 7 * MIB == led.unconfirmed_bytes() - 3 * MIB
    led.observe(10 * MIB, 1.5)
    assert led.settling_bytes() == 0
    led.confirm("r", 2.0)
    assert led.settling_bytes() == 3 * MIB


ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "release", "observe"]), st.integers(0, 120), st.integers(0, 9)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_property_never_overcommits_and_releases_once(seq: list[tuple[str, int, int]]) -> None:
    """Under any sequence, predicted <= capacity - margin, and each grant is released once."""
    led = make()
    led.observe(0, 0.0)
    live: set[str] = set()
    released: list[str] = []
    for op, mib, who in seq:
        holder = f"r{who}"
        if op == "reserve" and holder not in live:
            if led.reserve_nowait(holder, mib * MIB, 0.0) is not None:
                live.add(holder)
        elif op == "release" and holder in live:
            led.release(holder)
            live.discard(holder)
            released.append(holder)
        elif op == "observe":
            led.observe(min(mib, 100) * MIB, 0.0)
        assert led.predicted_bytes <= led.usable_bytes or not live
        assert led.predicted_bytes <= max(led.usable_bytes, 0)
    for h in sorted(live):
        led.release(h)
    stats = led.statistics(0.0)
    assert stats.granted_total == stats.released_total
    assert led.predicted_bytes == 0


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 100), st.integers(0, 100))
def test_property_tenant_pressure_reduces_headroom(tenant_mib: int, ours_mib: int) -> None:
    """Observed usage from a tenant lowers headroom below what our reservations alone leave."""
    led = make()
    led.observe(0, 0.0)
    ours = min(ours_mib, 90) * MIB
    assert led.reserve_nowait("ours", ours, 0.0) is not None
    led.confirm("ours", 0.0)
    led.observe(ours, 0.1)
    before = led.headroom(0.1)
    led.observe(ours + tenant_mib * MIB, 0.1)
    after = led.headroom(0.1)
    assert before is not None and after is not None
    assert after == before - tenant_mib * MIB


def test_grants_are_recorded_as_given() -> None:
    """reserve_nowait records a request by default and force_reserve the kind given, both at their time."""
    led = make()
    led.observe(0, 1.0)
    assert led.reserve_nowait("a", 5 * MIB, 1.5) == Reservation("a", 5 * MIB, "request", 1.5)
    assert led.force_reserve("w", 7 * MIB, 2.5, "weights") == Reservation("w", 7 * MIB, "weights", 2.5)
    assert (led.reserved_by_kind("request"), led.reserved_by_kind("weights")) == (5 * MIB, 7 * MIB)


@pytest.mark.parametrize("first", ["reserve_nowait", "force_reserve"])
@pytest.mark.parametrize("second", ["reserve_nowait", "force_reserve"])
def test_a_holder_holds_one_reservation(first: str, second: str) -> None:
    """A second grant to the same holder, by either method, raises KeyError naming the holder."""
    led = make()
    led.observe(0, 0.0)
    getattr(led, first)("a", MIB, 0.0, kind="request")
    with pytest.raises(KeyError, match="a already holds a reservation"):
        getattr(led, second)("a", MIB, 0.0, kind="request")


def test_exact_fit_is_granted_one_byte_more_is_not() -> None:
    """A grant of exactly the headroom fits; one byte more does not, and a negative one never does."""
    led = make()
    led.observe(30 * MIB, 0.0)
    assert led.reserve_nowait("neg", -1, 0.0) is None
    assert led.reserve_nowait("over", 60 * MIB + 1, 0.0) is None
    assert led.reserve_nowait("exact", 60 * MIB, 0.0) is not None
    assert led.headroom(0.0) == 0


def test_statistics_snapshot() -> None:
    """The snapshot reports every field, counting weights grants apart from requests' ones."""
    led = make()
    led.force_reserve("w", 40 * MIB, 0.0, "weights")
    assert led.statistics(0.0) == LedgerStatistics(
        device="sim:100",
        capacity_bytes=100 * MIB,
        margin_bytes=10 * MIB,
        predicted_bytes=40 * MIB,
        observed_bytes=None,
        observed_age_s=None,
        headroom_bytes=None,
        reservations=1,
        request_reservations=0,
        granted_total=1,
        released_total=0,
        peak_requests=0,
    )
    led.confirm("w", 0.5)
    led.observe(45 * MIB, 1.0)
    led.reserve_nowait("a", 10 * MIB, 1.1)
    led.reserve_nowait("b", 5 * MIB, 1.2)
    led.release("b", 1.3)
    assert led.statistics(1.5) == LedgerStatistics(
        device="sim:100",
        capacity_bytes=100 * MIB,
        margin_bytes=10 * MIB,
        predicted_bytes=50 * MIB,
        observed_bytes=45 * MIB,
        observed_age_s=0.5,
        headroom_bytes=90 * MIB - (45 + 10) * MIB,  # the reading plus a, not yet confirmed
        reservations=2,
        request_reservations=1,
        granted_total=3,
        released_total=1,
        peak_requests=2,
    )


def test_every_grant_is_counted() -> None:
    """granted_total counts forced grants too, each one, whatever came before."""
    led = make()
    led.observe(0, 0.0)
    led.reserve_nowait("a", MIB, 0.0)
    led.force_reserve("w", MIB, 0.0, "weights")
    led.force_reserve("t", MIB, 0.0, "tenant")
    assert led.statistics(0.0).granted_total == 3


def test_reading_age_is_never_negative() -> None:
    """A reading stamped after ``now`` (another clock's rounding) is reported as age 0, not negative."""
    led = make()
    led.observe(0, 5.0)
    assert led.statistics(4.0).observed_age_s == 0.0


def test_peak_counts_only_request_grants() -> None:
    """peak_requests is the most request reservations live at once; weights and tenants do not count."""
    led = make()
    led.observe(0, 0.0)
    led.force_reserve("w", MIB, 0.0, "weights")
    led.reserve_nowait("t", MIB, 0.0, kind="tenant")
    led.reserve_nowait("a", MIB, 0.0)
    led.reserve_nowait("b", MIB, 0.0)
    led.release("a")
    led.release("b")
    led.reserve_nowait("t2", MIB, 0.0, kind="tenant")
    assert led.statistics(0.0).peak_requests == 2


def test_a_device_reported_capacity_replaces_the_configured_one() -> None:
    """A reading that carries the device's capacity updates it; one without leaves it as it was."""
    led = make()
    led.observe(0, 0.0, capacity_bytes=50 * MIB)
    assert led.capacity_bytes == 50 * MIB and led.headroom(0.0) == 40 * MIB
    led.observe(0, 0.1)
    assert led.capacity_bytes == 50 * MIB


def test_confirmed_at_the_reading_time_is_not_trusted_to_be_in_it() -> None:
    """A grant confirmed at the very instant a reading was taken is still added to that reading."""
    led = make()
    led.observe(0, 0.0)
    led.reserve_nowait("a", 20 * MIB, 0.0)
    led.confirm("a", 1.0)
    led.observe(20 * MIB, 1.0)
    assert led.unconfirmed_bytes() == 20 * MIB
    assert led.headroom(1.0) == 90 * MIB - 40 * MIB
    led.observe(20 * MIB, 1.01)
    assert led.unconfirmed_bytes() == 0


def test_without_a_reading_every_grant_is_unconfirmed() -> None:
    """Before any reading, even confirmed grants cannot be in one."""
    led = make()
    led.force_reserve("w", 30 * MIB, 0.0, "weights")
    led.confirm("w", 0.0)
    assert led.unconfirmed_bytes() == 30 * MIB


def test_confirming_an_unknown_holder_does_nothing() -> None:
    """A confirmation for a holder that holds nothing is ignored."""
    led = make()
    led.confirm("ghost", 0.0)
    led.observe(0, 1.0)
    led.reserve_nowait("ghost", 10 * MIB, 1.5)
    assert led.unconfirmed_bytes() == 10 * MIB


def test_a_holder_granted_again_starts_unconfirmed() -> None:
    """Release forgets the old confirmation: the same holder's next grant is not assumed to be in a reading."""
    led = make()
    led.observe(0, 0.0)
    led.reserve_nowait("a", 20 * MIB, 0.0)
    led.confirm("a", 0.5)
    led.observe(20 * MIB, 1.0)
    assert led.unconfirmed_bytes() == 0
    led.release("a", 1.1)
    led.reserve_nowait("a", 20 * MIB, 1.2)
    assert led.unconfirmed_bytes() == 20 * MIB


def test_recently_released_request_bytes_within_freshness() -> None:
    """Request bytes released at t=5 are remembered through t=6 (freshness 1 s) and forgotten after."""
    led = make()
    led.force_reserve("a", 8 * MIB, 0.0, "request")
    led.release("a", 5.0)
    assert led.recently_released(5.5) == 8 * MIB
    assert led.recently_released(6.0) == 8 * MIB
    assert led.recently_released(6.01) == 0


def test_recently_released_forgets_the_oldest_first() -> None:
    """Of two releases, only the one still within freshness is counted."""
    led = make()
    led.force_reserve("a", 8 * MIB, 0.0, "request")
    led.force_reserve("b", 3 * MIB, 0.0, "request")
    led.release("a", 5.0)
    led.release("b", 5.8)
    assert led.recently_released(5.9) == 11 * MIB
    assert led.recently_released(6.5) == 3 * MIB
    assert led.recently_released(7.0) == 0


def test_a_release_a_later_reading_shows_is_no_longer_coming_back() -> None:
    """Released at t=5: a reading taken before 5 + RELEASE_SETTLE_S may still show the bytes (remembered);
    one taken then or later shows them freed, so they are forgotten before ``freshness_s``."""
    led = make()
    led.force_reserve("a", 8 * MIB, 0.0, "request")
    led.observe(8 * MIB, 4.9)
    led.release("a", 5.0)
    assert led.recently_released(5.1) == 8 * MIB  # the reading was taken before the release
    led.observe(0, 5.0 + RELEASE_SETTLE_S - 0.05)
    assert led.recently_released(5.3) == 8 * MIB  # too soon after the release to show it
    led.observe(0, 5.0 + RELEASE_SETTLE_S)
    assert led.recently_released(5.3) == 0


def test_unloaded_weights_are_coming_back_for_the_whole_freshness() -> None:
    """A model's weights are freed as its process exits, which a reading may show later: a later
    reading does not forget them, ``freshness_s`` (1 s) does."""
    led = make()
    led.force_reserve("w", 8 * MIB, 0.0, "weights")
    led.release("w", 5.0)
    led.observe(8 * MIB, 5.0 + 2 * RELEASE_SETTLE_S)
    assert led.recently_released(5.9) == 8 * MIB
    assert led.recently_released(6.01) == 0


def test_only_the_releases_a_reading_shows_are_forgotten() -> None:
    """Of two releases, the one the last reading was taken long enough after is forgotten; the other
    is still coming back until a later reading or ``freshness_s``."""
    led = make()
    led.force_reserve("a", 8 * MIB, 0.0, "request")
    led.force_reserve("b", 3 * MIB, 0.0, "request")
    led.release("a", 5.0)
    led.release("b", 5.2)
    led.observe(3 * MIB, 5.3)
    assert led.recently_released(5.35) == 3 * MIB
    assert led.recently_released(6.25) == 0  # past freshness (1 s) with no newer reading


@pytest.mark.parametrize(
    ("kind", "now", "remembered"),
    [
        ("request", 5.0, 8 * MIB),
        ("request", None, 0),  # a release without a time is not remembered
        ("weights", 5.0, 8 * MIB),  # an unloaded model's weights are coming back too
        ("weights", None, 0),
        ("tenant", 5.0, 0),  # another tenant's memory is not ours
    ],
)
def test_which_releases_are_remembered(kind: str, now: float | None, remembered: int) -> None:
    """Request and weights reservations released with a time count as recently released."""
    led = make()
    led.force_reserve("a", 8 * MIB, 0.0, kind)
    led.release("a", now)
    assert led.recently_released(5.5) == remembered
