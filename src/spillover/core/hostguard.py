"""The CPU lane's host-RAM guard: a CPU slot may start only within the host budget.

Rules:

1. A CPU request runs in a slot with its own llama context; a slot that already has one
   costs nothing more, a new one costs ``slot_bytes`` (its weights mapping, KV cache and
   compute buffers: the same memory model as the GPU, CPU side).
2. Host usage is ``max(predicted, observed)``: predicted from the memory model, observed
   from the processes' RSS.
3. A new context is opened only when ``used + slot_bytes <= budget`` and the machine would
   keep ``min_free_bytes`` available; otherwise the request waits in the queue (or is
   shed by the queue's own bounds). Whatever the GPU is doing, this never lets the CPU
   lane go past its budget.
4. Of ``slot_bytes``, the weights a load maps from the model file (``mapped_bytes``:
   llama.cpp's mmap) count against the budget (they are resident) but not against the
   machine's available memory, which counts that page cache as available already, mapped
   or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillover.core.reasons import Reason

__all__ = ["HOST_REFUSALS", "HostView", "may_start_cpu"]


@dataclass(frozen=True)
class HostView:
    """What the guard needs to know right now."""

    running: int  # CPU requests running
    contexts: int  # CPU slots that already hold a context
    slots: int  # the CPU lane's slot limit
    predicted_bytes: int
    observed_bytes: int
    slot_bytes: int
    budget_bytes: int
    available_bytes: int
    min_free_bytes: int
    mapped_bytes: int = 0  # of slot_bytes, weights mapped from the model file (rule 4)


HOST_REFUSALS = frozenset({Reason.HOST_BUDGET, Reason.HOST_AVAILABLE})  # may_start_cpu's refusals for memory


def may_start_cpu(v: HostView, enabled: bool = True) -> tuple[bool, Reason]:
    """Whether one more CPU request may start now, and why (machine-readable)."""
    if v.running >= v.slots:
        return False, Reason.CPU_SLOTS_BUSY
    if not enabled:
        return True, Reason.HOST_GUARD_DISABLED
    if v.running < v.contexts:
        return True, Reason.CONTEXT_FREE
    used = max(v.predicted_bytes, v.observed_bytes)
    if used + v.slot_bytes > v.budget_bytes:
        return False, Reason.HOST_BUDGET
    if v.available_bytes - (v.slot_bytes - v.mapped_bytes) < v.min_free_bytes:  # rule 4
        return False, Reason.HOST_AVAILABLE
    return True, Reason.FITS
