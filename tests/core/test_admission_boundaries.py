"""decide() at its boundaries: exact fits, the last free slot or CPU place, the context cap, the delay
bound, the shrink path (both ways in), and memory released so recently that a reading still shows it.

Byte sizes come from the memory model (tested on its own in test_memory.py); every decision, token
count and reason is written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from spillover.core.admission import (
    AdmissionPolicy,
    AdmissionRequest,
    Admit,
    Delay,
    LaneView,
    Reject,
    Route,
    Shrink,
    decide,
)
from spillover.core.breaker import BreakerState, Circuit
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.core.routing import Reason

MIB = 1024 * 1024
NOW = 100.0
CAP = 1024 * MIB
MARGIN = 16 * MIB
LANES = LaneView(
    gpu_ready=True,
    gpu_free_slots=2,
    gpu_ctx_cap_tokens=2048,
    cpu_ready=True,
    cpu_queue_free=4,
    cpu_ctx_cap_tokens=4096,
    cpu_retry_after_s=3.0,
)
CLOSED = BreakerState()
Fp = Callable[[int, int], int]


def room_ledger(room: int, *, live_requests: int = 0, pressure: int = 0) -> DeviceLedger:
    """A ledger with exactly ``room`` bytes of headroom: the rest held by confirmed weights (and
    ``live_requests`` bytes of confirmed request reservations), all of it in a fresh reading, plus
    ``pressure`` bytes that someone else holds."""
    led = DeviceLedger("sim", CAP, MARGIN, freshness_s=1.0)
    weights = CAP - MARGIN - room - live_requests
    led.force_reserve("weights", weights, NOW - 1, "weights")
    led.confirm("weights", NOW - 1)
    if live_requests:
        led.force_reserve("earlier", live_requests, NOW - 1, "request")
        led.confirm("earlier", NOW - 1)
    led.observe(weights + live_requests + pressure, NOW - 0.5)
    assert led.headroom(NOW) == room - pressure
    return led


def req(prompt: int = 40, max_tokens: int = 60, *, arrived: float = NOW, shrink: bool = False) -> AdmissionRequest:
    return AdmissionRequest("r1", prompt, max_tokens, arrived, allow_shrink=shrink)


@pytest.fixture()
def policy(memory: MemoryModel) -> AdmissionPolicy:
    return AdmissionPolicy(memory=memory, delay_max_s=2.0, delay_poll_s=0.05)


@pytest.fixture()
def fp(memory: MemoryModel) -> Fp:
    """Total footprint bytes of (prompt, max_tokens)."""
    return lambda prompt, max_tokens: memory.request_footprint(prompt, max_tokens).total_bytes


# -- admit: exact fits ---------------------------------------------------------------------------


def test_footprint_equal_to_headroom_is_admitted(policy: AdmissionPolicy, fp: Fp) -> None:
    """A footprint of exactly the headroom fits: Admit, with 40 + 60 tokens rounded to 7 pages (112)."""
    d = decide(req(), room_ledger(fp(40, 60)), LANES, CLOSED, NOW, policy)
    assert d == Admit(nbytes=fp(40, 60), kv_tokens=112)


def test_one_byte_short_is_only_the_margin(policy: AdmissionPolicy, fp: Fp) -> None:
    """One byte less headroom than the footprint: it would fit but for the margin, so it goes to CPU."""
    d = decide(req(), room_ledger(fp(40, 60) - 1), LANES, CLOSED, NOW, policy)
    assert d == Route(Reason.MARGIN)


@pytest.mark.parametrize(
    ("shortfall", "expected"),
    [
        (0, Reason.MARGIN),  # exactly the margin short
        (1, Reason.KV_PAGES_EXHAUSTED),  # one byte more than the margin
    ],
)
def test_margin_boundary(policy: AdmissionPolicy, fp: Fp, shortfall: int, expected: Reason) -> None:
    """'margin' covers a footprint up to headroom + margin, not one byte more."""
    led = room_ledger(fp(40, 60) - MARGIN - shortfall)
    assert decide(req(), led, LANES, CLOSED, NOW, policy) == Route(expected)


def test_exactly_one_free_slot_admits(policy: AdmissionPolicy, fp: Fp) -> None:
    """One free GPU slot is enough; none makes the request wait, until the delay bound (a
    freed slot starts a pass: no poll)."""
    led = room_ledger(CAP // 2)
    one = decide(req(), led, replace(LANES, gpu_free_slots=1), CLOSED, NOW, policy)
    assert one == Admit(nbytes=fp(40, 60), kv_tokens=112)
    none = decide(req(), led, replace(LANES, gpu_free_slots=0), CLOSED, NOW, policy)
    assert none == Delay(NOW + 2.0, Reason.GPU_BUSY)


def test_request_of_exactly_the_context_cap_is_admitted(policy: AdmissionPolicy, fp: Fp) -> None:
    """prompt + max_tokens equal to the GPU cap (2000 + 48 = 2048) runs there; one token more does not."""
    led = room_ledger(CAP // 2)
    assert decide(req(2000, 48), led, LANES, CLOSED, NOW, policy) == Admit(nbytes=fp(2000, 48), kv_tokens=2048)
    assert decide(req(2000, 49), led, LANES, CLOSED, NOW, policy) == Route(Reason.TOO_LONG_FOR_GPU)


# -- delay: the bound ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arrived", "expected"),
    [
        (NOW, Delay(NOW + 2.0, Reason.GPU_BUSY)),  # the bound: a freed slot starts a pass, no poll
        (NOW - 1.98, Delay(NOW + 0.02, Reason.GPU_BUSY)),
        (NOW - 2.0, Route(Reason.GPU_BUSY)),  # exactly delay_max_s after arrival: no more waiting
        (NOW - 5.0, Route(Reason.GPU_BUSY)),
    ],
)
def test_busy_gpu_waits_up_to_delay_max(policy: AdmissionPolicy, arrived: float, expected: object) -> None:
    """A busy GPU delays until the bound (what ends the wait is an event); at the bound it routes."""
    d = decide(req(arrived=arrived), room_ledger(CAP // 2), replace(LANES, gpu_free_slots=0), CLOSED, NOW, policy)
    if isinstance(expected, Delay):
        assert isinstance(d, Delay) and d.reason == expected.reason
        assert d.until_s == pytest.approx(expected.until_s)
    else:
        assert d == expected


@pytest.mark.parametrize(
    ("short", "expected"),
    [
        (1, Route(Reason.KV_PAGES_EXHAUSTED)),  # one byte too few coming back
        (0, Delay(NOW + 0.05, Reason.KV_PAGES_EXHAUSTED)),  # exactly enough coming back
    ],
)
def test_delay_when_our_reservations_would_make_exactly_room(
    policy: AdmissionPolicy, fp: Fp, short: int, expected: object
) -> None:
    """It waits when headroom plus our live request reservations covers the footprint, to the byte."""
    led = room_ledger(MIB, live_requests=fp(40, 60) - MIB - short)
    assert decide(req(), led, LANES, CLOSED, NOW, policy) == expected


# -- recently released bytes --------------------------------------------------------------------


def released_ledger(*, remembered: bool) -> DeviceLedger:
    """10 MiB of headroom; a reading taken just before a 200 MiB request reservation was released
    (with its time when ``remembered``), so the reading still shows those bytes."""
    led = DeviceLedger("sim", CAP, MARGIN, freshness_s=1.0)
    weights = CAP - MARGIN - 10 * MIB - 200 * MIB
    led.force_reserve("weights", weights, NOW - 1, "weights")
    led.force_reserve("done", 200 * MIB, NOW - 1, "request")
    led.confirm("weights", NOW - 1)
    led.confirm("done", NOW - 1)
    led.observe(weights + 200 * MIB, NOW - 0.2)
    led.release("done", NOW - 0.1 if remembered else None)
    return led


def test_recently_released_bytes_are_not_pressure_and_are_waited_for(policy: AdmissionPolicy) -> None:
    """Bytes a reading shows only because they were just released are coming back: wait for them, and
    do not call them someone else's pressure."""
    d = decide(req(), released_ledger(remembered=True), LANES, CLOSED, NOW, policy)
    assert d == Delay(NOW + 0.05, Reason.KV_PAGES_EXHAUSTED)


def test_a_model_that_just_loaded_is_waited_for_not_routed(policy: AdmissionPolicy) -> None:
    """Weights confirmed after the last reading are counted twice (the reading shows them, and
    they are still unconfirmed) until the next reading: the request waits for that reading
    instead of going to the CPU, and is admitted once it comes."""
    fp = policy.memory.request_footprint(40, 60).total_bytes  # req()
    weights = 300 * MIB
    led = DeviceLedger("sim", CAP, MARGIN, freshness_s=1.0)
    led.force_reserve("weights", weights, NOW - 1, kind="weights")
    led.observe(CAP - MARGIN - fp - weights // 2, NOW - 0.2)  # the device shows the weights loaded
    led.confirm("weights", NOW - 0.1)  # the worker said READY after that reading
    assert led.settling_bytes() == weights
    d = decide(req(), led, LANES, CLOSED, NOW, policy)
    assert isinstance(d, Delay)
    led.observe(CAP - MARGIN - fp - weights // 2, NOW)  # the next reading: counted once
    assert led.settling_bytes() == 0
    assert isinstance(decide(req(), led, LANES, CLOSED, NOW, policy), Admit)


def test_unexplained_bytes_in_the_reading_are_pressure(policy: AdmissionPolicy) -> None:
    """The same reading, with nothing known to be coming back: someone else holds the memory."""
    d = decide(req(), released_ledger(remembered=False), LANES, CLOSED, NOW, policy)
    assert d == Route(Reason.OBSERVED_PRESSURE)


def test_an_empty_device_too_small_is_not_pressure(policy: AdmissionPolicy) -> None:
    """Nothing observed, nothing reserved, and still no room: the KV pages are exhausted, not pressured."""
    led = DeviceLedger("sim", MARGIN + MIB, MARGIN, freshness_s=1.0)
    led.observe(0, NOW)
    assert decide(req(), led, LANES, CLOSED, NOW, policy) == Route(Reason.KV_PAGES_EXHAUSTED)


def test_observed_exactly_what_we_predicted_is_not_pressure(policy: AdmissionPolicy) -> None:
    """A reading equal to our own reservations is no one else's memory: the reason is kv_pages_exhausted."""
    led = room_ledger(MIB, live_requests=300 * MIB)
    d = decide(req(arrived=NOW - 2.0), led, LANES, CLOSED, NOW, policy)
    assert d == Route(Reason.KV_PAGES_EXHAUSTED)


# -- shrink, when the request does not fit the memory -------------------------------------------


@pytest.mark.parametrize(
    ("max_tokens", "room_for", "shrunk", "kv_tokens"),
    [
        # room for max_tokens=k fits every max_tokens up to the end of k's 16-token page.
        (600, 16, 24, 64),  # 40 + 16 = 56 -> page ends at 64
        (600, 24, 24, 64),  # already a page end
        (600, 25, 40, 80),
        (600, 100, 104, 144),
        (600, 200, 200, 240),
        (600, 216, 216, 256),
        (600, 217, 232, 272),
        (600, 500, 504, 544),
        (601, 600, 600, 640),  # one token less crosses back into the previous page
    ],
)
def test_shrink_to_the_largest_max_tokens_that_fits(
    policy: AdmissionPolicy,
    fp: Fp,
    max_tokens: int,
    room_for: int,
    shrunk: int,
    kv_tokens: int,
) -> None:
    """With exactly the room of (40, k), the shrunk max_tokens is the last one of k's page, to the token."""
    d = decide(req(40, max_tokens, shrink=True), room_ledger(fp(40, room_for)), LANES, CLOSED, NOW, policy)
    assert d == Shrink(shrunk, fp(40, shrunk), kv_tokens, Reason.SHRUNK_TO_FIT)
    assert type(d.max_tokens) is int


def test_shrink_needs_room_for_min_max_tokens(policy: AdmissionPolicy, fp: Fp) -> None:
    """Below the footprint of min_max_tokens (16) there is nothing to shrink to: CPU."""
    led = room_ledger(fp(40, 16) - 1)
    assert decide(req(40, 600, shrink=True), led, LANES, CLOSED, NOW, policy) == Route(Reason.KV_PAGES_EXHAUSTED)


@pytest.mark.parametrize(("free_slots", "shrinks"), [(1, True), (0, False)])
def test_shrink_needs_a_free_slot(policy: AdmissionPolicy, fp: Fp, free_slots: int, shrinks: bool) -> None:
    """A shrunk request still needs a GPU slot: exactly one is enough, none routes to CPU."""
    led = room_ledger(fp(40, 200))
    d = decide(req(40, 600, shrink=True), led, replace(LANES, gpu_free_slots=free_slots), CLOSED, NOW, policy)
    if shrinks:
        assert d == Shrink(200, fp(40, 200), 240, Reason.SHRUNK_TO_FIT)
    else:
        assert d == Route(Reason.KV_PAGES_EXHAUSTED)


# -- shrink, when the request is longer than the GPU's context ----------------------------------


def test_too_long_shrinks_to_exactly_the_context_cap(policy: AdmissionPolicy, fp: Fp) -> None:
    """Too long for 2048 tokens, with room to spare: shrunk to 2048 - 2000 = 48 tokens, not beyond."""
    d = decide(req(2000, 100, shrink=True), room_ledger(CAP // 2), LANES, CLOSED, NOW, policy)
    assert d == Shrink(48, fp(2000, 48), 2048, Reason.SHRUNK_TO_FIT)


@pytest.mark.parametrize(
    ("free_slots", "breaker"),
    [
        (1, CLOSED),  # the last free slot
        (2, BreakerState(circuit=Circuit.HALF_OPEN, opened_at_s=NOW - 5, cooldown_s=2, opens=1)),  # a probe
    ],
    ids=["last_slot", "half_open_probe"],
)
def test_too_long_shrinks_with_the_last_slot_or_as_a_probe(
    policy: AdmissionPolicy, fp: Fp, free_slots: int, breaker: BreakerState
) -> None:
    """Exactly one free GPU slot is enough to shrink, and so is a half-open breaker with a probe place."""
    lanes = replace(LANES, gpu_free_slots=free_slots)
    d = decide(req(2000, 100, shrink=True), room_ledger(CAP // 2), lanes, breaker, NOW, policy)
    assert d == Shrink(48, fp(2000, 48), 2048, Reason.SHRUNK_TO_FIT)


def test_too_long_shrinks_to_the_room_when_that_is_less(policy: AdmissionPolicy, fp: Fp) -> None:
    """With room for exactly (2000, 16), the shrunk request is 16 tokens (2016, a page end)."""
    d = decide(req(2000, 100, shrink=True), room_ledger(fp(2000, 16)), LANES, CLOSED, NOW, policy)
    assert d == Shrink(16, fp(2000, 16), 2016, Reason.SHRUNK_TO_FIT)


def test_too_long_prompt_plus_min_exactly_the_cap_shrinks(policy: AdmissionPolicy, fp: Fp) -> None:
    """A prompt that leaves exactly min_max_tokens (2032 + 16 = 2048) shrinks to 16; one more routes."""
    led = room_ledger(CAP // 2)
    assert decide(req(2032, 100, shrink=True), led, LANES, CLOSED, NOW, policy) == Shrink(
        16, fp(2032, 16), 2048, Reason.SHRUNK_TO_FIT
    )
    assert decide(req(2033, 100, shrink=True), led, LANES, CLOSED, NOW, policy) == Route(Reason.TOO_LONG_FOR_GPU)


def stale_ledger() -> DeviceLedger:
    led = DeviceLedger("sim", CAP, MARGIN, freshness_s=1.0)
    led.observe(0, NOW - 5)
    return led


@pytest.mark.parametrize(
    ("why", "ledger", "lanes", "breaker"),
    [
        ("no room even for 16 tokens", lambda fp: room_ledger(fp(2000, 16) - 1), {}, CLOSED),
        ("GPU not ready", lambda fp: room_ledger(CAP // 2), {"gpu_ready": False}, CLOSED),
        (
            "breaker open",
            lambda fp: room_ledger(CAP // 2),
            {},
            BreakerState(circuit=Circuit.OPEN, opened_at_s=NOW, cooldown_s=5, opens=1),
        ),
        ("stale reading", lambda fp: stale_ledger(), {}, CLOSED),
    ],
    ids=["no_room", "gpu_not_ready", "breaker_open", "stale_reading"],
)
def test_too_long_without_a_way_to_shrink_routes(
    policy: AdmissionPolicy,
    fp: Fp,
    why: str,
    ledger: Callable[[Fp], DeviceLedger],
    lanes: dict[str, object],
    breaker: BreakerState,
) -> None:
    """A too-long request that may shrink still goes to CPU when the GPU cannot take the shrunk one."""
    d = decide(req(2000, 100, shrink=True), ledger(fp), replace(LANES, **lanes), breaker, NOW, policy)
    assert d == Route(Reason.TOO_LONG_FOR_GPU), why


def test_too_long_and_allowed_to_shrink_waits_as_any_request_for_a_slot_or_for_memory(
    policy: AdmissionPolicy, fp: Fp
) -> None:
    """Rule 1 (round 27): cut to the cap, the request goes rules 2-6's way. Every GPU slot
    busy, it waits for one within ``delay_max_s`` and then goes to CPU as ``gpu_busy``; its room
    held by a reservation that comes back, it waits for it (it went to the CPU at once, or a
    503 when the CPU lane could not take it either)."""
    long = req(2000, 100, shrink=True)
    busy = replace(LANES, gpu_free_slots=0)
    assert decide(long, room_ledger(CAP // 2), busy, CLOSED, NOW, policy) == Delay(NOW + 2.0, Reason.GPU_BUSY)
    waited = req(2000, 100, arrived=NOW - 2.0, shrink=True)  # past its delay bound
    assert decide(waited, room_ledger(CAP // 2), busy, CLOSED, NOW, policy) == Route(Reason.GPU_BUSY)
    # with no CPU path for it, the cause stays gpu_busy: the scheduler then waits for a slot (round 29)
    no_cpu = replace(busy, cpu_ctx_cap_tokens=1024)
    d = decide(waited, room_ledger(CAP // 2), no_cpu, CLOSED, NOW, policy)
    assert d == Reject(3.0, Reason.GPU_BUSY, Reason.TOO_LONG_FOR_CPU), d
    need = fp(2000, 48)
    held = room_ledger(need // 2, live_requests=need)  # a live request holds what it needs
    d = decide(long, held, LANES, CLOSED, NOW, policy)
    assert isinstance(d, Delay) and d.reason is Reason.KV_PAGES_EXHAUSTED, d
    assert decide(long, room_ledger(need), LANES, CLOSED, NOW, policy) == Shrink(
        48, need, policy.memory.request_footprint(2000, 48).kv_tokens, Reason.SHRUNK_TO_FIT
    )


# -- the CPU lane's own bounds ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("queue_free", "expected"),
    [
        (1, Route(Reason.TOO_LONG_FOR_GPU)),  # the last place in the queue
        (0, Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.CPU_QUEUE_FULL)),
    ],
)
def test_last_cpu_queue_place(policy: AdmissionPolicy, queue_free: int, expected: object) -> None:
    """Exactly one free place in the CPU queue takes the request; none rejects with Retry-After."""
    d = decide(req(2000, 100), room_ledger(CAP // 2), replace(LANES, cpu_queue_free=queue_free), CLOSED, NOW, policy)
    assert d == expected


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "expected"),
    [
        (4000, 96, Route(Reason.TOO_LONG_FOR_GPU)),  # exactly the CPU cap
        (4000, 97, Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU)),
        (4096, 0, Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU)),  # no room for one new token
    ],
)
def test_cpu_context_cap(policy: AdmissionPolicy, prompt: int, max_tokens: int, expected: object) -> None:
    """The CPU lane takes prompt + max_tokens up to its cap exactly, and needs room for one new token."""
    assert decide(req(prompt, max_tokens), room_ledger(CAP // 2), LANES, CLOSED, NOW, policy) == expected


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "shrink", "expected"),
    [
        (4000, 500, True, Route(Reason.TOO_LONG_FOR_GPU)),  # the CPU lane runs it with the room it has
        (4080, 500, True, Route(Reason.TOO_LONG_FOR_GPU)),  # room for exactly 16 new tokens
        (4081, 500, True, Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU)),  # room for 15
        (4090, 4, True, Route(Reason.TOO_LONG_FOR_GPU)),  # asks for fewer than 16: all 4 fit
        (4093, 4, True, Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU)),
        (4000, 500, False, Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU)),  # not allowed to shrink
    ],
)
def test_a_shrinkable_request_fits_the_cpu_lane_with_room_for_16_tokens(
    policy: AdmissionPolicy, prompt: int, max_tokens: int, shrink: bool, expected: object
) -> None:
    """A request that may be shrunk goes to the CPU lane when its prompt leaves room there for
    min(max_tokens, 16) new tokens; one that may not needs room for all of max_tokens."""
    d = decide(req(prompt, max_tokens, shrink=shrink), room_ledger(CAP // 2), LANES, CLOSED, NOW, policy)
    assert d == expected


def test_the_cpu_lane_honours_the_requests_own_shrink_floor(policy: AdmissionPolicy) -> None:
    """With min_max_tokens=8, room for 11 new tokens on the CPU lane is enough; with the
    default 16 it is not."""
    low = replace(req(4085, 500, shrink=True), min_max_tokens=8)
    assert decide(low, room_ledger(CAP // 2), LANES, CLOSED, NOW, policy) == Route(Reason.TOO_LONG_FOR_GPU)
    d = decide(req(4085, 500, shrink=True), room_ledger(CAP // 2), LANES, CLOSED, NOW, policy)
    assert d == Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU)


def test_cpu_route_switched_off_rejects(memory: MemoryModel) -> None:
    """With allow_cpu_route off, what would go to CPU is rejected as cpu_unavailable."""
    p = AdmissionPolicy(memory=memory, allow_cpu_route=False)
    d = decide(req(2000, 100), room_ledger(CAP // 2), LANES, CLOSED, NOW, p)
    assert d == Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.CPU_UNAVAILABLE)
