"""core.placement: where a service's queued request starts (late binding, GPU preferred)."""

from __future__ import annotations

import dataclasses

import pytest

from spillover.core.placement import PlacementView, place
from spillover.core.reasons import Reason

BASE = PlacementView(
    gpu_configured=True,
    gpu_ready=True,
    gpu_free_slots=1,
    breaker_allows=True,
    headroom_bytes=1000,
    nbytes=400,
    cpu_ready=True,
    cpu_free_slots=1,
)

# (changes to BASE, expected lane, expected reason, expected gpu verdict)
ROWS = [
    ({}, "gpu", Reason.FITS, Reason.FITS),
    ({"nbytes": 1000}, "gpu", Reason.FITS, Reason.FITS),  # exactly the headroom fits
    ({"nbytes": 1001}, "cpu", Reason.NO_DEVICE_ROOM, Reason.NO_DEVICE_ROOM),
    ({"headroom_bytes": None}, "cpu", Reason.OBSERVATION_STALE, Reason.OBSERVATION_STALE),
    ({"gpu_free_slots": 0}, "cpu", Reason.GPU_BUSY, Reason.GPU_BUSY),
    ({"gpu_ready": False}, "cpu", Reason.GPU_UNAVAILABLE, Reason.GPU_UNAVAILABLE),
    ({"breaker_allows": False}, "cpu", Reason.BREAKER_OPEN, Reason.BREAKER_OPEN),
    ({"gpu_configured": False}, "cpu", Reason.GPU_NOT_CONFIGURED, Reason.GPU_NOT_CONFIGURED),
    ({"avoid_gpu": True}, "cpu", Reason.GPU_UNAVAILABLE, Reason.GPU_UNAVAILABLE),
    ({"demoted": True}, "cpu", Reason.DEMOTED, Reason.DEMOTED),
    ({"demoted": True, "gpu_ready": False}, "cpu", Reason.DEMOTED, Reason.DEMOTED),
    ({"gpu_free_slots": 0, "cpu_free_slots": 0}, "wait", Reason.NO_LANE_FREE, Reason.GPU_BUSY),
    ({"nbytes": 2000, "cpu_ready": False}, "wait", Reason.NO_LANE_FREE, Reason.NO_DEVICE_ROOM),
    ({"nbytes": 2000, "host_allows": False}, "wait", Reason.HOST_BUDGET, Reason.NO_DEVICE_ROOM),
    ({"nbytes": 2000, "host_allows": False, "cpu_free_slots": 0}, "wait", Reason.NO_LANE_FREE, Reason.NO_DEVICE_ROOM),
    # The GPU is preferred even when the CPU is free; the CPU is used even when the GPU
    # will free up soon: whichever can start it now (rule 1).
    ({"cpu_free_slots": 5}, "gpu", Reason.FITS, Reason.FITS),
    ({"gpu_free_slots": 0, "cpu_free_slots": 1, "nbytes": 1}, "cpu", Reason.GPU_BUSY, Reason.GPU_BUSY),
]


@pytest.mark.parametrize(("changes", "lane", "reason", "gpu"), ROWS)
def test_placement_table(changes: dict[str, object], lane: str, reason: Reason, gpu: Reason) -> None:
    """Each row: the lane a queued request starts on, why, and the GPU's own verdict."""
    got = place(dataclasses.replace(BASE, **changes))  # type: ignore[arg-type]
    assert (got.lane, got.reason, got.gpu_reason) == (lane, reason, gpu)


def test_memory_is_checked_before_slots() -> None:
    """A request too big for the device is reported as such even when the GPU is busy too."""
    got = place(dataclasses.replace(BASE, nbytes=5000, gpu_free_slots=0))
    assert got.gpu_reason is Reason.NO_DEVICE_ROOM
