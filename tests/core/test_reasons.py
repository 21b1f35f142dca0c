"""The reason vocabulary: every member's wire text, a Reject's display text, a failover's text,
each written out by hand (the wire output must stay byte-identical)."""

from __future__ import annotations

import pytest

from spillover.core import reasons, routing
from spillover.core.admission import Reject
from spillover.core.reasons import FailoverReason, Reason

WIRE: list[tuple[Reason, str]] = [
    (Reason.FITS, "fits"),
    (Reason.SHRUNK_TO_FIT, "shrunk_to_fit"),
    (Reason.GPU_BUSY, "gpu_busy"),
    (Reason.MARGIN, "margin"),
    (Reason.OBSERVED_PRESSURE, "observed_pressure"),
    (Reason.KV_PAGES_EXHAUSTED, "kv_pages_exhausted"),
    (Reason.TOO_LONG_FOR_GPU, "too_long_for_gpu"),
    (Reason.BREAKER_OPEN, "breaker_open"),
    (Reason.GPU_UNAVAILABLE, "gpu_unavailable"),
    (Reason.OBSERVATION_STALE, "observation_stale"),
    (Reason.CPU_UNAVAILABLE, "cpu_unavailable"),
    (Reason.TOO_LONG_FOR_CPU, "too_long_for_cpu"),
    (Reason.CPU_QUEUE_FULL, "cpu_queue_full"),
    (Reason.CLIENT_PREFERS_CPU, "client_prefers_cpu"),
    (Reason.CANARY, "canary"),
    (Reason.GPU_QUEUE_FULL, "gpu_queue_full"),
    (Reason.CPU_LANE, "cpu_lane"),
    (Reason.CPU_MEETS_DEADLINE, "cpu_meets_deadline"),
    (Reason.CPU_SLOTS_BUSY, "cpu_slots_busy"),
    (Reason.NO_CPU_WORKER, "no_cpu_worker"),
    (Reason.HOST_GUARD_DISABLED, "host_guard_disabled"),
    (Reason.CONTEXT_FREE, "context_free"),
    (Reason.HOST_BUDGET, "host_budget"),
    (Reason.HOST_AVAILABLE, "host_available"),
    (Reason.NO_DEVICE_ROOM, "no_device_room"),
    (Reason.GPU_NOT_CONFIGURED, "gpu_not_configured"),
    (Reason.NO_LANE_FREE, "no_lane_free"),
    (Reason.DEMOTED, "demoted"),
    (Reason.RESIDENT_DOES_NOT_FIT, "resident_does_not_fit"),
]


@pytest.mark.parametrize(("reason", "text"), WIRE, ids=[t for _, t in WIRE])
def test_reason_wire_text(reason: Reason, text: str) -> None:
    """Each reason prints, formats and compares as its wire text."""
    assert str(reason) == text
    assert f"{reason}" == text
    assert reason == text


def test_every_reason_has_its_wire_text_pinned() -> None:
    """A new Reason member must be added to the table above with its text."""
    assert {r for r, _ in WIRE} == set(Reason)
    assert len(WIRE) == len(Reason) == 29


@pytest.mark.parametrize(
    ("cause", "refusal", "text"),
    [
        (Reason.MARGIN, Reason.CPU_QUEUE_FULL, "margin+cpu_queue_full"),
        (Reason.TOO_LONG_FOR_GPU, Reason.TOO_LONG_FOR_CPU, "too_long_for_gpu+too_long_for_cpu"),
        (Reason.BREAKER_OPEN, Reason.CPU_UNAVAILABLE, "breaker_open+cpu_unavailable"),
    ],
)
def test_reject_display_text(cause: Reason, refusal: Reason, text: str) -> None:
    """A Reject keeps cause and refusal apart; only its display text joins them with '+'."""
    r = Reject(2.0, cause, refusal)
    assert (r.cause, r.refusal, r.route) == (cause, refusal, "none")
    assert r.reason == text
    assert type(r.reason) is str


@pytest.mark.parametrize(
    ("fault", "text"),
    [("alloc_failed", "failover:alloc_failed"), ("crash", "failover:crash"), ("stall", "failover:stall")],
)
def test_failover_reason_text(fault: str, text: str) -> None:
    """A failover's reason is its worker fault, shown as failover:<fault>."""
    assert str(FailoverReason(fault)) == text
    assert f"{FailoverReason(fault)}" == text


def test_routing_reexports_the_reasons() -> None:
    """core.routing hands out the same Reason and FailoverReason as core.reasons."""
    assert routing.Reason is reasons.Reason
    assert routing.FailoverReason is reasons.FailoverReason
