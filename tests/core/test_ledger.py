"""Device ledger: never over-commits, releases once, trusts only fresh observations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.core.ledger import DeviceLedger

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


def test_release_exactly_once() -> None:
    """A second release of the same holder raises KeyError."""
    led = make()
    led.observe(0, 0.0)
    led.reserve_nowait("a", MIB, 0.0)
    led.release("a")
    with pytest.raises(KeyError):
        led.release("a")


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
