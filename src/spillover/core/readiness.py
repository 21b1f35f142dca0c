"""How ready a service's CPU replica is kept: ``warm``, ``mmap`` or ``on_demand``, or
``auto``, which picks by a recovery budget. An embeddings or transcription replica has no
per-request context (``engine.holder``): its ``ctx_ms`` is 0 and its context costs nothing,
so ``warm`` and ``mmap`` predict the same and keep the same.

Rules:

1. A mode's *recovery time* is the time from a GPU fault to the first CPU result (a token,
   vectors, a segment), predicted from the steps the replica must still take (``recovery_ms``):
   - ``warm`` (model and contexts ready): a first result;
   - ``mmap`` (model loaded, contexts on demand): a context, then a first result;
   - ``on_demand`` (process started, nothing loaded): the model load, a context, a first result.
   Each step's figure is the replica's own measurement (at start-up, then every time it
   really does the step).
2. A mode's *host cost* is what it keeps in host memory while idle (``host_cost``): warm
   the weights and every slot's context, mmap the weights, on_demand nothing. The CPU
   lane's host-RAM guard counts what the replica really holds.
3. ``auto`` (``pick``) takes the cheapest mode whose recovery time meets the budget; when
   none does, the fastest (``warm``). When host memory cannot hold that mode, it takes the
   fastest mode that the room allows (``host_short``) and says so. Moving to a dearer mode
   needs one more context of room than the mode costs, or a tenth of the model for a replica
   without contexts (hysteresis: no flapping at the edge). Replicas share the host room: a
   load one was asked for and has not reported is counted in every other one's room
   (``HostMemory.room_bytes``), so two are never both asked to spend the same room.
4. A model without a GPU lane has no failover: its replica is its only path, and ``auto``
   keeps it ``mmap`` (model loaded, contexts as requests need them; ``no_gpu_lane``).
   A configured mode other than ``auto`` is kept whatever the budget, but host room bounds it
   the same way (``host_short``): no mode loads past the host-RAM guard's budget.
5. A replica starts (``initial_mode``) in the cheapest mode its configuration allows before
   any room is known: ``on_demand`` for auto, ``mmap`` for warm (its contexts come with the
   first pick), so a start never opens contexts the guard has not seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CHEAPEST_FIRST", "MODES", "Choice", "Why", "host_cost", "initial_mode", "pick", "recovery_ms"]

MODES = ("warm", "mmap", "on_demand", "auto")
CHEAPEST_FIRST = ("on_demand", "mmap", "warm")


class Why(StrEnum):
    """Why the replica is kept in the mode it is (machine-readable, shown in /v1/status)."""

    CONFIGURED = "configured"  # a fixed mode was configured
    NOT_MEASURED = "not_measured"  # auto, before the replica reported its timings: warm
    WITHIN_BUDGET = "cheapest_within_budget"  # auto: the cheapest mode meeting the budget
    OVER_BUDGET = "no_mode_meets_budget"  # auto: none meets it; the fastest
    NO_GPU_LANE = "no_gpu_lane"  # auto, on a model without a GPU lane: mmap
    HOST_SHORT = "host_short"  # host memory cannot hold the mode the budget (or configuration) wants


@dataclass(frozen=True)
class Choice:
    mode: str
    why: Why
    wanted: str  # the mode the budget alone asks for (differs from ``mode`` when host_short)


def initial_mode(configured: str) -> str:
    """The mode a replica process starts in (rule 5)."""
    return {"auto": "on_demand", "warm": "mmap"}.get(configured, configured)


def recovery_ms(timings: Mapping[str, float]) -> dict[str, float]:
    """Each mode's predicted recovery time (rule 1) from the step timings ``load_ms``,
    ``ctx_ms`` and ``first_ms``. Empty when a step has no figure yet."""
    if not all(k in timings for k in ("load_ms", "ctx_ms", "first_ms")):
        return {}
    first = float(timings["first_ms"])
    ctx = float(timings["ctx_ms"])
    load = float(timings["load_ms"])
    return {"warm": first, "mmap": ctx + first, "on_demand": load + ctx + first}


def host_cost(mode: str, *, weights_bytes: int, context_bytes: int, slots: int) -> int:
    """Host bytes ``mode`` keeps while idle (rule 2)."""
    if mode == "warm":
        return weights_bytes + slots * context_bytes
    if mode == "mmap":
        return weights_bytes
    if mode == "on_demand":
        return 0
    raise ValueError(f"unknown readiness mode {mode!r}")


def pick(
    configured: str,
    budget_ms: float,
    recovery: Mapping[str, float],
    cost: Mapping[str, int],
    room_bytes: int,
    *,
    current: str,
    step_bytes: int,
    alone: bool = False,
) -> Choice:
    """The mode to keep (rules 3-4). ``room_bytes``: host memory the replica may hold idle
    (the guard's budget and the machine's free memory, less everything else); ``current``:
    the mode it is in; ``step_bytes``: the hysteresis of a move up (rule 3); ``alone``: the
    model has no GPU lane (rule 4)."""
    if configured != "auto":
        wanted, why = configured, Why.CONFIGURED
    elif alone:
        wanted, why = "mmap", Why.NO_GPU_LANE
    elif not recovery:
        wanted, why = "warm", Why.NOT_MEASURED
    else:
        meets = [m for m in CHEAPEST_FIRST if recovery[m] <= budget_ms]
        wanted, why = (meets[0], Why.WITHIN_BUDGET) if meets else ("warm", Why.OVER_BUDGET)

    def affordable(mode: str) -> bool:  # a mode that keeps nothing always is (host room can be below 0)
        dearer = CHEAPEST_FIRST.index(mode) > CHEAPEST_FIRST.index(current) if current in CHEAPEST_FIRST else True
        return cost[mode] == 0 or cost[mode] + (step_bytes if dearer else 0) <= room_bytes

    if affordable(wanted):
        return Choice(wanted, why, wanted)
    fits = [m for m in CHEAPEST_FIRST[: CHEAPEST_FIRST.index(wanted)] if affordable(m)]
    return Choice(fits[-1] if fits else "on_demand", Why.HOST_SHORT, wanted)
