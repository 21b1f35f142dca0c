"""Admission: one pure function decides where a request goes before any device is touched.

``decide(request, ledger, lanes, breaker, now_s, policy) -> Decision``

Rules, applied in order (the first that matches wins):

1. Longer than the GPU lane's context cap (the resident's: ``core.profiles`` rule 5): when
   shrinking is allowed and the prompt leaves room for ``min_max_tokens``, ``max_tokens``
   is cut to the cap and rules 2-6 decide (admitted, it is a ``Shrink``; a delay waits for
   memory as any other); else, or when those rules send it off the GPU, route to CPU
   (``too_long_for_gpu``; ``gpu_busy`` when every slot was busy past the delay, as for any
   other request: a slot comes back).
2. Breaker not letting work through: route to CPU (``breaker_open``).
3. No ready GPU worker: route to CPU (``gpu_unavailable``).
4. Device usage cannot be trusted (no fresh observation): route to CPU
   (``observation_stale``).
5. The footprint fits the headroom: ``Admit`` (``fits``) when a slot is free, else
   ``Delay`` (``gpu_busy``) while the wait is within ``delay_max_s``. That delay lasts until
   the bound, not one poll interval: what ends it comes as an event that starts a pass (a
   slot given back, a worker's change, a device reading that changed), so a busy GPU is not
   polled. Rule 6's memory delays still poll: what returns also comes back with time.
6. It does not fit. The reason is ``margin`` when it would fit but for the safety margin,
   ``observed_pressure`` when what is observed exceeds what we predicted (someone else
   holds memory), and ``kv_pages_exhausted`` otherwise. Then:
   a. if our own request reservations, once returned (live ones, and ones released so
      recently that a reading may still show them), and allocations counted twice until the
      next reading (confirmed after the last one was taken, e.g. a model that just loaded:
      ``ledger.settling_bytes``) would make room and the wait is within ``delay_max_s``: Delay;
   b. if the client allowed shrinking and a smaller ``max_tokens`` fits: Shrink;
   c. if unloading an idle batch-priority service's GPU weights (``lanes.demotable``) would
      make room, and the wait is within ``delay_max_s``: ``Demote`` the smallest one that
      is enough (the runtime unloads it; its requests go to its CPU path) and ask again;
      memory of a demotion under way (``lanes.demoting_bytes``) counts as returning (a);
   d. else route to CPU.
7. Routing to CPU needs room in the CPU lane; otherwise ``Reject`` with a Retry-After. A
   ``Reject`` keeps the cause (the reason it left the GPU) and the CPU lane's refusal
   (``cpu_unavailable``, ``too_long_for_cpu``, ``cpu_queue_full``) apart.

Every decision carries a machine-readable ``reason``: a ``Reason``, or for a ``Reject`` the
display text ``cause+refusal``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from spillover.core.breaker import BreakerPolicy, BreakerState, allows
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.core.routing import MIN_SHRUNK_TOKENS, Reason, fits_lane

__all__ = [
    "AdmissionPolicy",
    "AdmissionRequest",
    "Admit",
    "Decision",
    "Delay",
    "Demote",
    "LaneView",
    "Reject",
    "Route",
    "Shrink",
    "decide",
    "returning_bytes",
]


@dataclass(frozen=True)
class AdmissionRequest:
    """What admission needs to know about one request."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrived_s: float
    allow_shrink: bool = False
    min_max_tokens: int = MIN_SHRUNK_TOKENS


@dataclass(frozen=True)
class LaneView:
    """The lanes as admission sees them right now."""

    gpu_ready: bool
    gpu_free_slots: int
    gpu_ctx_cap_tokens: int
    cpu_ready: bool
    cpu_queue_free: int
    cpu_ctx_cap_tokens: int
    cpu_retry_after_s: float = 1.0
    demotable: tuple[tuple[str, int], ...] = ()  # idle batch services on the GPU: (name, weights bytes)
    demoting_bytes: int = 0  # weights of demotions under way, not yet released


@dataclass(frozen=True)
class AdmissionPolicy:
    """Thresholds (configuration) and the memory model used to size requests."""

    memory: MemoryModel
    delay_max_s: float = 2.0
    delay_poll_s: float = 0.05
    allow_cpu_route: bool = True
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)


@dataclass(frozen=True)
class Admit:
    """Run on the GPU with a reservation of ``nbytes`` covering ``kv_tokens``."""

    nbytes: int
    kv_tokens: int
    reason: Reason = Reason.FITS
    route: str = "gpu"


@dataclass(frozen=True)
class Shrink:
    """Run on the GPU with a smaller ``max_tokens``; always reported to the client."""

    max_tokens: int
    nbytes: int
    kv_tokens: int
    reason: Reason
    route: str = "gpu"


@dataclass(frozen=True)
class Demote:
    """Unload ``service``'s GPU worker to make room, then ask again by ``until_s`` (rule 6c)."""

    service: str
    until_s: float
    reason: Reason
    route: str = "gpu"


@dataclass(frozen=True)
class Delay:
    """Ask again at ``until_s`` (bounded by ``delay_max_s`` from arrival)."""

    until_s: float
    reason: Reason
    route: str = "gpu"


@dataclass(frozen=True)
class Route:
    """Serve on the CPU lane."""

    reason: Reason
    route: str = "cpu"


@dataclass(frozen=True)
class Reject:
    """Refuse now; the client may retry after ``retry_after_s``. ``cause``: why the request left
    the GPU; ``refusal``: why the CPU lane cannot take it (the error's code)."""

    retry_after_s: float
    cause: Reason
    refusal: Reason
    route: str = "none"

    @property
    def reason(self) -> str:
        """The display text, ``cause+refusal`` (e.g. ``margin+cpu_queue_full``)."""
        return f"{self.cause}+{self.refusal}"


Decision = Admit | Shrink | Delay | Demote | Route | Reject


def _to_cpu(req: AdmissionRequest, lanes: LaneView, reason: Reason, p: AdmissionPolicy) -> Decision:
    if not p.allow_cpu_route or not lanes.cpu_ready:
        return Reject(lanes.cpu_retry_after_s, reason, Reason.CPU_UNAVAILABLE)
    cap = lanes.cpu_ctx_cap_tokens
    if not fits_lane(
        req.prompt_tokens, req.max_tokens, cap, shrinkable=req.allow_shrink, min_tokens=req.min_max_tokens
    ):
        return Reject(lanes.cpu_retry_after_s, reason, Reason.TOO_LONG_FOR_CPU)
    if lanes.cpu_queue_free <= 0:
        return Reject(lanes.cpu_retry_after_s, reason, Reason.CPU_QUEUE_FULL)
    return Route(reason)


def _bound(req: AdmissionRequest, now_s: float, p: AdmissionPolicy) -> float | None:
    """The end of the request's delay bound, or None once it has passed (a busy GPU's delay
    lasts until then: rule 5)."""
    deadline = req.arrived_s + p.delay_max_s
    return None if now_s >= deadline else deadline


def _may_wait(req: AdmissionRequest, now_s: float, p: AdmissionPolicy) -> float | None:
    """Until when a memory delay waits before it is decided again: the next poll, or the bound
    when that comes first; None past the bound."""
    deadline = _bound(req, now_s, p)
    return None if deadline is None else min(deadline, now_s + p.delay_poll_s)


def _shrunk(req: AdmissionRequest, room: int, cap: int, p: AdmissionPolicy) -> Shrink | None:
    """The largest ``max_tokens`` (>= min) whose footprint fits ``room`` and ``cap``."""
    best: Shrink | None = None
    lo, hi = req.min_max_tokens, min(req.max_tokens - 1, cap - req.prompt_tokens)
    while lo <= hi:
        mid = (lo + hi) // 2
        fp = p.memory.request_footprint(req.prompt_tokens, mid)
        if fp.total_bytes <= room:
            best = Shrink(mid, fp.total_bytes, fp.kv_tokens, Reason.SHRUNK_TO_FIT)
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def decide(
    req: AdmissionRequest,
    ledger: DeviceLedger,
    lanes: LaneView,
    breaker: BreakerState,
    now_s: float,
    p: AdmissionPolicy,
) -> Decision:
    """Decide admit / delay / shrink / route / reject for one request (rules above)."""
    cap = lanes.gpu_ctx_cap_tokens
    if req.prompt_tokens + req.max_tokens <= cap:
        return _on_gpu(req, ledger, lanes, breaker, now_s, p)
    if not (req.allow_shrink and req.prompt_tokens + req.min_max_tokens <= cap):
        return _to_cpu(req, lanes, Reason.TOO_LONG_FOR_GPU, p)
    # Rule 1's shrink: cut to the cap, it goes rules 2-6's way (a delay while memory comes
    # back included); admitted, it is a Shrink; sent off the GPU, it is too long for it,
    # unless every slot was busy.
    d = _on_gpu(replace(req, max_tokens=cap - req.prompt_tokens), ledger, lanes, breaker, now_s, p)
    if isinstance(d, Admit):
        return Shrink(cap - req.prompt_tokens, d.nbytes, d.kv_tokens, Reason.SHRUNK_TO_FIT)
    if isinstance(d, Route | Reject):  # every slot busy stays the cause: a slot comes back (the scheduler waits)
        busy = (d.reason if isinstance(d, Route) else d.cause) is Reason.GPU_BUSY
        return _to_cpu(req, lanes, Reason.GPU_BUSY if busy else Reason.TOO_LONG_FOR_GPU, p)
    return d


def _on_gpu(
    req: AdmissionRequest,
    ledger: DeviceLedger,
    lanes: LaneView,
    breaker: BreakerState,
    now_s: float,
    p: AdmissionPolicy,
) -> Decision:
    """Rules 2-7 for a request within the GPU lane's context cap."""
    if not allows(breaker, p.breaker):
        return _to_cpu(req, lanes, Reason.BREAKER_OPEN, p)
    if not lanes.gpu_ready:
        return _to_cpu(req, lanes, Reason.GPU_UNAVAILABLE, p)
    room = ledger.headroom(now_s)
    if room is None:
        return _to_cpu(req, lanes, Reason.OBSERVATION_STALE, p)
    fp = p.memory.request_footprint(req.prompt_tokens, req.max_tokens)
    if fp.total_bytes <= room:
        if lanes.gpu_free_slots > 0:
            return Admit(nbytes=fp.total_bytes, kv_tokens=fp.kv_tokens)
        until = _bound(req, now_s, p)  # a freed slot kicks a pass (rule 5)
        if until is not None:
            return Delay(until, Reason.GPU_BUSY)
        return _to_cpu(req, lanes, Reason.GPU_BUSY, p)

    observed = ledger.observed_fresh(now_s) or 0
    returning = returning_bytes(ledger, now_s) + lanes.demoting_bytes
    if fp.total_bytes <= room + ledger.margin_bytes:
        reason = Reason.MARGIN
    elif observed > ledger.predicted_bytes + ledger.recently_released(now_s):
        reason = Reason.OBSERVED_PRESSURE
    else:
        reason = Reason.KV_PAGES_EXHAUSTED
    if fp.total_bytes <= room + returning:
        until = _may_wait(req, now_s, p)
        if until is not None:
            return Delay(until, reason)
    if req.allow_shrink and lanes.gpu_free_slots > 0:
        shrink = _shrunk(req, room, lanes.gpu_ctx_cap_tokens, p)
        if shrink is not None:
            return shrink
    victim = _demotion(fp.total_bytes - room - returning, lanes)
    if victim is not None:
        until = _may_wait(req, now_s, p)
        if until is not None:
            return Demote(victim, until, reason)
    return _to_cpu(req, lanes, reason, p)


def returning_bytes(ledger: DeviceLedger, now_s: float) -> int:
    """Device bytes that come back without anyone else's doing (rule 6a): our own live request
    reservations as their requests end, releases a reading may still show, and allocations
    counted twice until the next reading."""
    return ledger.reserved_by_kind("request") + ledger.recently_released(now_s) + ledger.settling_bytes()


def _demotion(short_bytes: int, lanes: LaneView) -> str | None:
    """The idle batch service with the least weights that still covers ``short_bytes``."""
    enough = [(nbytes, name) for name, nbytes in lanes.demotable if nbytes >= short_bytes]
    return min(enough)[1] if enough else None
