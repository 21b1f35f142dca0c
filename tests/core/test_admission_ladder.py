"""The pressure ladder's service step: decide() demotes an idle batch service before routing
to the CPU, and a demoted service is promoted back only after room has lasted (hysteresis)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.admission import AdmissionPolicy, Delay, Demote, Route, Shrink, decide
from spillover.core.breaker import BreakerState
from spillover.core.ledger import RELEASE_SETTLE_S
from spillover.core.memory import MemoryModel
from spillover.core.placement import promote_due
from spillover.core.reasons import Reason
from tests.core.test_admission import LANES, MIB, NOW, fp_mib, ledger, req


@pytest.fixture()
def policy(memory: MemoryModel) -> AdmissionPolicy:
    return AdmissionPolicy(memory=memory, delay_max_s=2.0)


def _short_mib(memory: MemoryModel) -> float:
    """How much the default request misses on a 300 MiB device with 250 MiB seen used."""
    room = 300 - 16 - 250
    return fp_mib(memory, 40, 60) - room


def test_demotes_a_batch_service_whose_weights_make_room(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """Under pressure, an idle batch service whose weights cover the shortfall is demoted
    (the reason stays the pressure's), and the request waits for the room by the delay bound."""
    short = _short_mib(memory)
    lanes = replace(LANES, demotable=(("emb", int((short + 1) * MIB)),))
    d = decide(req(), ledger(300, 250), lanes, BreakerState(), NOW, policy)
    assert isinstance(d, Demote) and d.service == "emb"
    assert d.reason is Reason.OBSERVED_PRESSURE and NOW < d.until_s <= NOW + 2.0


def test_a_service_too_small_to_make_room_is_left_alone(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """Demoting a service whose weights do not cover the shortfall would not help: route to CPU."""
    short = _short_mib(memory)
    lanes = replace(LANES, demotable=(("emb", int((short - 1) * MIB)),))
    d = decide(req(), ledger(300, 250), lanes, BreakerState(), NOW, policy)
    assert isinstance(d, Route) and d.reason is Reason.OBSERVED_PRESSURE


def test_the_smallest_sufficient_service_is_chosen(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """Of several candidates, the one with the least weights that still covers the need goes."""
    short = _short_mib(memory)
    lanes = replace(
        LANES,
        demotable=(
            ("big", int((short + 50) * MIB)),
            ("tiny", int((short - 1) * MIB)),
            ("right", int((short + 2) * MIB)),
        ),
    )
    d = decide(req(), ledger(300, 250), lanes, BreakerState(), NOW, policy)
    assert isinstance(d, Demote) and d.service == "right"


def test_past_the_delay_bound_it_routes_instead_of_demoting(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """A request that has waited its delay bound goes to the CPU rather than wait for an unload."""
    lanes = replace(LANES, demotable=(("emb", int((_short_mib(memory) + 10) * MIB)),))
    d = decide(req(arrived=NOW - 3), ledger(300, 250), lanes, BreakerState(), NOW, policy)
    assert isinstance(d, Route)


def test_a_demotion_under_way_counts_as_memory_coming_back(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """While an unload is under way its weights are returning: the request waits, and no
    second service is demoted."""
    short = _short_mib(memory)
    lanes = replace(LANES, demotable=(("other", int((short + 5) * MIB)),), demoting_bytes=int((short + 1) * MIB))
    d = decide(req(), ledger(300, 250), lanes, BreakerState(), NOW, policy)
    assert isinstance(d, Delay)


@pytest.mark.parametrize(
    ("released_before_reading_s", "expected"),
    [
        (-0.1, Delay),  # released after the reading was taken: it still shows the bytes, they are coming back
        (RELEASE_SETTLE_S / 2, Delay),  # too soon before it for the device to have freed them
        (RELEASE_SETTLE_S, Demote),  # the reading shows them freed: nothing is coming back, demote now
    ],
)
def test_a_release_the_reading_already_shows_is_not_waited_for(
    policy: AdmissionPolicy, memory: MemoryModel, released_before_reading_s: float, expected: type
) -> None:
    """A request released just before the chat arrived (the drill's service_demotion after a burst)
    is counted as coming back only until a reading taken long enough after it: after that the chat
    demotes the idle batch service at once instead of spending its delay bound waiting for memory
    the reading already shows free (and then leaving for the CPU with the demotion under way)."""
    short = _short_mib(memory)
    lanes = replace(LANES, demotable=(("emb", int((short + 1) * MIB)),))
    led = ledger(300, 250, at=NOW - 0.5)
    led.force_reserve("burst", int((short + 1) * MIB), NOW - 5, "request")
    led.release("burst", NOW - 0.05 - released_before_reading_s)
    led.observe(250 * MIB, NOW - 0.05)
    assert isinstance(decide(req(), led, lanes, BreakerState(), NOW, policy), expected)


def test_shrink_comes_before_demotion(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """A client that allows shrinking is shrunk to fit rather than unloading another service."""
    short = _short_mib(memory)
    lanes = replace(LANES, demotable=(("emb", int((short + 10) * MIB)),))
    d = decide(req(max_tokens=1500, shrink=True), ledger(300, 200), lanes, BreakerState(), NOW, policy)
    assert isinstance(d, Shrink)


def test_nothing_is_demoted_when_the_request_fits(policy: AdmissionPolicy) -> None:
    """With room on the device, candidates are ignored."""
    lanes = replace(LANES, demotable=(("emb", 100 * MIB),))
    d = decide(req(), ledger(1024, 100), lanes, BreakerState(), NOW, policy)
    assert d.reason is Reason.FITS


W, R = 100, 20  # weights and reserve, bytes


@pytest.mark.parametrize(
    ("headroom", "since", "now", "due", "new_since"),
    [
        (None, 5.0, 10.0, False, None),  # no trusted reading: start over
        (W + R - 1, 5.0, 10.0, False, None),  # not enough room: start over
        (W + R, None, 10.0, False, 10.0),  # room starts now
        (W + R, 10.0, 12.9, False, 10.0),  # not long enough yet
        (W + R, 10.0, 13.0, True, 10.0),  # held for hold_s
        (W + R + 500, 1.0, 13.0, True, 1.0),
    ],
)
def test_promotion_needs_room_to_spare_for_the_whole_hold(
    headroom: int | None, since: float | None, now: float, due: bool, new_since: float | None
) -> None:
    """promote_due: weights + reserve must fit continuously for hold_s; any gap restarts the clock."""
    got = promote_due(
        headroom_bytes=headroom, weights_bytes=W, reserve_bytes=R, low_since_s=since, now_s=now, hold_s=3.0
    )
    assert got == (due, new_since)
