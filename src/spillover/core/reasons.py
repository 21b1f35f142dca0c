"""Why a request runs where it does, as values: one ``Reason`` enum, and a failover's cause.

Rules:

1. Every routing and admission reason is a ``Reason`` member; its value is the wire text
   (``X-Spillover-Reason``, ``/v1/status``, the journal's ``reason`` column, error codes).
2. A ``Reject`` keeps the cause that sent the request off the GPU and the CPU lane's refusal
   apart; only its display text joins them (``cause+refusal``, ``core.admission``).
3. A CPU attempt that replays or continues a failed GPU attempt runs for a
   ``FailoverReason``: the worker's fault kind (an open set, decided by the worker), shown as
   ``failover:<fault>``. That text is built here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["FailoverReason", "Reason", "RouteReason"]


class Reason(StrEnum):
    """A machine-readable reason for an admission, routing or CPU-dispatch decision."""

    # Admission on the GPU (core.admission).
    FITS = "fits"  # also the host guard's: a new CPU context fits the host budget
    SHRUNK_TO_FIT = "shrunk_to_fit"
    GPU_BUSY = "gpu_busy"
    MARGIN = "margin"
    OBSERVED_PRESSURE = "observed_pressure"
    KV_PAGES_EXHAUSTED = "kv_pages_exhausted"
    # Sent off the GPU (core.admission).
    TOO_LONG_FOR_GPU = "too_long_for_gpu"
    BREAKER_OPEN = "breaker_open"
    GPU_UNAVAILABLE = "gpu_unavailable"
    OBSERVATION_STALE = "observation_stale"
    # The CPU lane refuses a request sent off the GPU (a Reject's refusal).
    CPU_UNAVAILABLE = "cpu_unavailable"
    TOO_LONG_FOR_CPU = "too_long_for_cpu"
    CPU_QUEUE_FULL = "cpu_queue_full"
    # Started on the CPU lane (runtime.executor, runtime.scheduler).
    CLIENT_PREFERS_CPU = "client_prefers_cpu"
    CANARY = "canary"
    GPU_QUEUE_FULL = "gpu_queue_full"  # the GPU lane had no place left; the CPU lane had one
    CPU_LANE = "cpu_lane"  # queued on the CPU lane with no other reason (no GPU lane)
    CPU_MEETS_DEADLINE = "cpu_meets_deadline"  # the device would answer past the deadline, the CPU lane in time
    # Whether queued CPU work may start now (core.hostguard, runtime.scheduler).
    CPU_SLOTS_BUSY = "cpu_slots_busy"
    NO_CPU_WORKER = "no_cpu_worker"
    HOST_GUARD_DISABLED = "host_guard_disabled"
    CONTEXT_FREE = "context_free"
    HOST_BUDGET = "host_budget"
    HOST_AVAILABLE = "host_available"
    # Where a service's request starts (core.placement): the first lane that can start it.
    NO_DEVICE_ROOM = "no_device_room"  # its memory does not fit the one device budget now
    GPU_NOT_CONFIGURED = "gpu_not_configured"  # the service has no GPU worker
    NO_LANE_FREE = "no_lane_free"  # every lane it may use is busy: it waits
    DEMOTED = "demoted"  # a batch service unloaded from the GPU to make room for interactive work
    # The split profile (core.profiles, runtime.scheduler): only a split worker runs on the device.
    RESIDENT_DOES_NOT_FIT = "resident_does_not_fit"


@dataclass(frozen=True)
class FailoverReason:
    """This attempt replays or continues a GPU attempt that failed with ``fault`` (rule 3)."""

    fault: str

    def __str__(self) -> str:
        return f"failover:{self.fault}"


RouteReason = Reason | FailoverReason
