"""Where a queued request of a service starts: late binding across its lanes.

Rules:

1. A request that has not started runs on whichever lane can start it first, the GPU
   preferred: the GPU when its worker has a free slot, its breaker lets it through and its
   predicted bytes fit the one device budget now; else the CPU path when it has a free
   slot (and host memory allows); else it waits, queued, for the first lane to free up.
   No lane idles while work it can run waits.
2. A request whose GPU attempt failed is not sent to the GPU again (``avoid_gpu``): it is
   replayed on the CPU path at a request boundary.
3. The reason names what decided: ``fits`` on the GPU; on the CPU, why not the GPU
   (``gpu_busy``, ``no_device_room``, ``observation_stale``, ``breaker_open``,
   ``gpu_unavailable``, ``gpu_not_configured``, ``demoted``, or the failover); waiting,
   ``host_budget`` when a CPU slot is free but host memory does not allow it, else
   ``no_lane_free``.
5. A demoted service is promoted back (``promote_due``) only once its weights have fitted
   with ``reserve_bytes`` to spare, continuously, for ``hold_s``: hysteresis, no flapping.
4. Pure: no I/O, no clock; ``runtime`` gathers the view and acts on the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spillover.core.reasons import Reason

__all__ = ["LaneChoice", "PlacementView", "place", "promote_due"]


@dataclass(frozen=True)
class PlacementView:
    """What placement looks at, for one request."""

    gpu_configured: bool
    gpu_ready: bool
    gpu_free_slots: int
    breaker_allows: bool
    headroom_bytes: int | None  # None: the device reading is stale
    nbytes: int
    cpu_ready: bool
    cpu_free_slots: int
    host_allows: bool = True
    avoid_gpu: bool = False
    demoted: bool = False  # the service is demoted from the GPU (the pressure ladder)


@dataclass(frozen=True)
class LaneChoice:
    """``lane`` "gpu" | "cpu" | "wait" and why."""

    lane: Literal["gpu", "cpu", "wait"]
    reason: Reason
    gpu_reason: Reason  # why the GPU could (``fits``) or could not take it


def _gpu_verdict(v: PlacementView) -> Reason:
    if not v.gpu_configured:
        return Reason.GPU_NOT_CONFIGURED
    if v.demoted:
        return Reason.DEMOTED
    if not v.gpu_ready:
        return Reason.GPU_UNAVAILABLE
    if not v.breaker_allows:
        return Reason.BREAKER_OPEN
    if v.headroom_bytes is None:
        return Reason.OBSERVATION_STALE
    if v.nbytes > v.headroom_bytes:
        return Reason.NO_DEVICE_ROOM
    if v.gpu_free_slots <= 0:
        return Reason.GPU_BUSY
    return Reason.FITS


def place(v: PlacementView) -> LaneChoice:
    """Rule 1's choice for one queued request."""
    gpu = Reason.GPU_UNAVAILABLE if v.avoid_gpu else _gpu_verdict(v)
    if gpu is Reason.FITS:
        return LaneChoice("gpu", Reason.FITS, gpu)
    if v.cpu_ready and v.cpu_free_slots > 0:
        if v.host_allows:
            return LaneChoice("cpu", gpu, gpu)
        return LaneChoice("wait", Reason.HOST_BUDGET, gpu)  # a free CPU slot, no host room for it
    return LaneChoice("wait", Reason.NO_LANE_FREE, gpu)


def promote_due(
    *, headroom_bytes: int | None, weights_bytes: int, reserve_bytes: int, low_since_s: float | None, now_s: float,
    hold_s: float,
) -> tuple[bool, float | None]:  # fmt: skip
    """Rule 5: (promote now?, the moment room has been there since, or None)."""
    if headroom_bytes is None or headroom_bytes < weights_bytes + reserve_bytes:
        return False, None
    since = now_s if low_since_s is None else low_since_s
    return now_s - since >= hold_s, since
