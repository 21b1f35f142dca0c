"""decide(): every decision kind and reason, table-driven, with a fake clock."""

from __future__ import annotations

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
LANES = LaneView(
    gpu_ready=True,
    gpu_free_slots=2,
    gpu_ctx_cap_tokens=2048,
    cpu_ready=True,
    cpu_queue_free=4,
    cpu_ctx_cap_tokens=4096,
    cpu_retry_after_s=3.0,
)


def ledger(cap_mib: int, observed_mib: float, *, ours_mib: float = 0, at: float = NOW) -> DeviceLedger:
    led = DeviceLedger("sim", cap_mib * MIB, 16 * MIB, freshness_s=1.0)
    led.observe(int(observed_mib * MIB), at)
    if ours_mib:
        led.force_reserve("earlier", int(ours_mib * MIB), at, "request")
    return led


def req(prompt: int = 40, max_tokens: int = 60, *, arrived: float = NOW, shrink: bool = False) -> AdmissionRequest:
    return AdmissionRequest("r1", prompt, max_tokens, arrived, allow_shrink=shrink)


@pytest.fixture()
def policy(memory: MemoryModel) -> AdmissionPolicy:
    return AdmissionPolicy(memory=memory, delay_max_s=2.0)


def fp_mib(memory: MemoryModel, prompt: int, max_tokens: int) -> float:
    return memory.request_footprint(prompt, max_tokens).total_bytes / MIB


CASES = [
    # id, ledger(cap, observed, ours), request, lanes, breaker, expected type, reason
    ("fits", (1024, 100, 0), {}, {}, None, Admit, "fits"),
    ("busy_waits", (1024, 100, 0), {}, {"gpu_free_slots": 0}, None, Delay, "gpu_busy"),
    (
        "busy_too_long_routes",
        (1024, 100, 0),
        {"arrived": NOW - 5},
        {"gpu_free_slots": 0},
        None,
        Route,
        "gpu_busy",
    ),
    (
        "too_long_for_gpu",
        (1024, 100, 0),
        {"prompt": 2000, "max_tokens": 100},
        {},
        None,
        Route,
        "too_long_for_gpu",
    ),
    ("breaker_open", (1024, 100, 0), {}, {}, Circuit.OPEN, Route, "breaker_open"),
    ("gpu_unavailable", (1024, 100, 0), {}, {"gpu_ready": False}, None, Route, "gpu_unavailable"),
    ("observed_pressure", (300, 250, 0), {}, {}, None, Route, "observed_pressure"),
    ("kv_exhausted_waits", (300, 0, 250), {}, {}, None, Delay, "kv_pages_exhausted"),
    (
        "kv_exhausted_routes_after_bound",
        (300, 0, 250),
        {"arrived": NOW - 3},
        {},
        None,
        Route,
        "kv_pages_exhausted",
    ),
    (
        "cpu_queue_full_rejects",
        (300, 250, 0),
        {},
        {"cpu_queue_free": 0},
        None,
        Reject,
        "observed_pressure+cpu_queue_full",
    ),
    (
        "cpu_down_rejects",
        (300, 250, 0),
        {},
        {"cpu_ready": False},
        None,
        Reject,
        "observed_pressure+cpu_unavailable",
    ),
    (
        "too_long_for_cpu_rejects",
        (1024, 100, 0),
        {"prompt": 3000, "max_tokens": 2000},
        {},
        None,
        Reject,
        "too_long_for_gpu+too_long_for_cpu",
    ),
]


@pytest.mark.parametrize(("case", "led", "r", "lanes", "circuit", "kind", "reason"), CASES, ids=[c[0] for c in CASES])
def test_decide_table(
    policy: AdmissionPolicy,
    case: str,
    led: tuple[int, int, int],
    r: dict,
    lanes: dict,
    circuit: Circuit | None,
    kind: type,
    reason: str,
) -> None:
    """Each row: a ledger, a request and lanes give one decision kind and reason."""
    cap, observed, ours = led
    b = BreakerState(circuit=circuit, opened_at_s=NOW, cooldown_s=5) if circuit else BreakerState()
    d = decide(req(**r), ledger(cap, observed, ours_mib=ours), replace(LANES, **lanes), b, NOW, policy)
    assert isinstance(d, kind), d
    assert d.reason == reason
    if isinstance(d, Reject):
        assert d.retry_after_s == 3.0
    if isinstance(d, Delay):
        assert NOW < d.until_s <= NOW + policy.delay_max_s


def test_margin_reason_when_only_the_margin_is_in_the_way(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """A request that would fit into the margin but not beside it says 'margin'."""
    need = fp_mib(memory, 40, 60)
    cap = 200
    observed = cap - 16 - need + 4  # 4 MiB short of headroom, well inside the 16 MiB margin
    d = decide(req(arrived=NOW - 10), ledger(cap, observed), LANES, BreakerState(), NOW, policy)
    assert isinstance(d, Route) and d.reason == "margin"


@pytest.mark.parametrize(
    ("case", "led", "r", "lanes", "expected"),
    [
        (
            "pressure, CPU queue full",
            (300, 250, 0),
            {},
            {"cpu_queue_free": 0},
            Reject(3.0, Reason.OBSERVED_PRESSURE, Reason.CPU_QUEUE_FULL),
        ),
        (
            "pressure, CPU down",
            (300, 250, 0),
            {},
            {"cpu_ready": False},
            Reject(3.0, Reason.OBSERVED_PRESSURE, Reason.CPU_UNAVAILABLE),
        ),
        (
            "too long for both lanes",
            (1024, 100, 0),
            {"prompt": 3000, "max_tokens": 2000},
            {},
            Reject(3.0, Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU),
        ),
        (
            "GPU down, CPU queue full",
            (1024, 100, 0),
            {},
            {"gpu_ready": False, "cpu_queue_free": 0},
            Reject(3.0, Reason.GPU_UNAVAILABLE, Reason.CPU_QUEUE_FULL),
        ),
    ],
)
def test_reject_keeps_cause_and_refusal_apart(
    policy: AdmissionPolicy, case: str, led: tuple[int, int, int], r: dict, lanes: dict, expected: Reject
) -> None:
    """A Reject names why the request left the GPU and why the CPU lane refused it, as two values."""
    cap, observed, ours = led
    d = decide(req(**r), ledger(cap, observed, ours_mib=ours), replace(LANES, **lanes), BreakerState(), NOW, policy)
    assert d == expected, case


def test_margin_then_full_cpu_queue_rejects(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """Only the margin in the way and no CPU place: cause margin, refusal cpu_queue_full."""
    need = fp_mib(memory, 40, 60)
    observed = 200 - 16 - need + 4
    lanes = replace(LANES, cpu_queue_free=0)
    d = decide(req(arrived=NOW - 10), ledger(200, observed), lanes, BreakerState(), NOW, policy)
    assert d == Reject(3.0, Reason.MARGIN, Reason.CPU_QUEUE_FULL)
    assert d.reason == "margin+cpu_queue_full"


def test_stale_observation_routes_to_cpu(policy: AdmissionPolicy) -> None:
    """Without a fresh reading, nothing is admitted to the GPU."""
    d = decide(req(), ledger(1024, 0, at=NOW - 5), LANES, BreakerState(), NOW, policy)
    assert isinstance(d, Route) and d.reason == "observation_stale"


def test_shrink_only_when_allowed_and_always_smaller(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """Shrink happens only with the client's opt-in, and yields a max_tokens that fits."""
    room_mib = fp_mib(memory, 40, 200) - 0.5
    cap = int(room_mib + 16 + 50) + 1
    led = ledger(cap, cap - 16 - room_mib)
    no = decide(req(40, 600, arrived=NOW - 5), led, LANES, BreakerState(), NOW, policy)
    assert isinstance(no, Route)
    yes = decide(req(40, 600, arrived=NOW - 5, shrink=True), led, LANES, BreakerState(), NOW, policy)
    assert isinstance(yes, Shrink) and yes.reason == "shrunk_to_fit"
    assert 16 <= yes.max_tokens < 600
    assert yes.nbytes == memory.request_footprint(40, yes.max_tokens).total_bytes
    assert yes.nbytes <= led.headroom(NOW)


def test_half_open_breaker_lets_one_probe(policy: AdmissionPolicy) -> None:
    """HALF_OPEN admits while probes are below the bound, routes once it is reached."""
    led = ledger(1024, 100)
    b = BreakerState(circuit=Circuit.HALF_OPEN)
    assert isinstance(decide(req(), led, LANES, b, NOW, policy), Admit)
    b = replace(b, probes_in_flight=1)
    d = decide(req(), led, LANES, b, NOW, policy)
    assert isinstance(d, Route) and d.reason == "breaker_open"


def test_admit_carries_footprint(policy: AdmissionPolicy, memory: MemoryModel) -> None:
    """Admit reserves exactly the predicted footprint and its KV token count."""
    d = decide(req(37, 30), ledger(1024, 100), LANES, BreakerState(), NOW, policy)
    fp = memory.request_footprint(37, 30)
    assert isinstance(d, Admit) and (d.nbytes, d.kv_tokens) == (fp.total_bytes, fp.kv_tokens)
