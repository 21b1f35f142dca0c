"""The /v1/status document: one JSON-ready snapshot of the whole gateway.

``status_document`` owns the document's shape and the serving mode it reports (``normal``,
``degraded`` with its reasons, or ``unavailable``). It reads the components' ``statistics()``
snapshots and the gateway's counters and changes nothing. ``/metrics`` is built from it too.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from spillover.core.routing import DEVICE_ROUTES

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["DegradedAnswers", "status_document"]

DEGRADED_WINDOW_S = 60.0  # answers served degraded this recently make the mode "degraded"
CHOSEN_CPU = frozenset({"canary", "client_prefers_cpu"})  # CPU answers nobody was pushed to


class DegradedAnswers:
    """Answers served degraded (off the GPU) because the gateway had to: the mode says so
    while they keep coming, even with every worker up and the breaker closed (e.g. another
    tenant's memory pushes every request to the CPU lane)."""

    def __init__(self, window_s: float = DEGRADED_WINDOW_S) -> None:
        self.window_s = window_s
        self._recent: deque[tuple[float, str]] = deque(maxlen=1000)

    def __repr__(self) -> str:
        return f"<DegradedAnswers recent={len(self._recent)}>"

    def note(self, now_s: float, route: str, reason: str | None) -> None:
        if route not in ("gpu", "none") and (reason or "") not in CHOSEN_CPU:
            self._recent.append((now_s, reason or route))

    def recent(self, now_s: float) -> tuple[int, str | None]:
        """How many in the window, and the latest one's reason."""
        while self._recent and now_s - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        return len(self._recent), (self._recent[-1][1] if self._recent else None)


def serving_mode(gw: Gateway, workers: list[dict[str, Any]], breaker: str) -> tuple[str, list[str]]:
    """The mode the gateway serves in and why it is not ``normal``."""
    gpu_ready = any(w["state"] == "ready" for w in workers if w["lane"] in DEVICE_ROUTES)
    cpu_ready = any(w["state"] == "ready" for w in workers if w["lane"] == "cpu")
    reasons = []
    plan = gw.chat.profile
    if plan is not None and plan.profile == "split" and gw.chat.split is not None:
        reasons.append(f"split profile: {plan.why}")
    if plan is not None and plan.profile == "cpu":  # no worker on the device is planned: none to wait for
        reasons.append(f"cpu profile: {plan.why}")
    elif gw.device is not None and not gpu_ready:  # the split worker, when only it runs on the device
        only_split = gw.chat.scheduler is not None and not gw.chat.scheduler.gpu_workers
        reasons.append("split worker not ready" if only_split else "gpu worker not ready")
    for chat in gw.chats:  # any chat model none of whose workers can start, and why
        if chat.scheduler is not None and (failed := chat.scheduler.cannot_start()) is not None:
            reasons.append(failed.message)
    sched = gw.chat.scheduler
    if breaker != "closed":
        reasons.append(f"gpu breaker {breaker}")
    if sched is not None and sched.split_workers and sched.split_breaker.circuit.value != "closed":
        reasons.append(f"split breaker {sched.split_breaker.circuit.value}")
    if sched is not None and (guard := sched.host_held) is not None:
        reasons.append(f"cpu lane held by the host-RAM guard ({guard})")
    if gw.device is None:
        reasons.append("no gpu lane")
    n, why = gw.degraded.recent(time.monotonic())
    if n:
        reasons.append(f"{n} answers served degraded in the last {gw.degraded.window_s:.0f}s (latest: {why})")
    if gw.device_hang:
        reasons.append("the device reports no progress (hung): its requests stall and go to the CPU")
    journal_down = gw.journal is not None and gw.journal.failing
    if journal_down or gw.pending_outcomes:  # a new request cannot be accepted; an answer not sent
        held = f"; {len(gw.pending_outcomes)} answers held until it can" if gw.pending_outcomes else ""
        reasons.append(f"the journal cannot write (a full disk?): new requests are refused{held}")
    if gw.loops.fatal is not None:
        reasons.append(gw.loops.fatal)
    if gw.loops.fatal is not None or journal_down or not (gpu_ready or cpu_ready):
        mode = "unavailable"
    elif reasons:
        mode = "degraded"
    else:
        mode = "normal"
    return mode, reasons


def service_rows(gw: Gateway) -> list[dict[str, Any]]:
    """A row per service: where its requests start now and why, its queue and ETA; the chat
    models' rows first, each from its scheduler."""
    rows = [c.status_row(gw.ledger, primary=c is gw.chat) for c in gw.chats if c.scheduler is not None]
    return rows + [asdict(svc.statistics()) for svc in gw.services.values()]


def status_document(gw: Gateway) -> dict[str, Any]:
    """The /v1/status document."""
    now = time.monotonic()
    sched = gw.chat.scheduler
    # The primary chat model's workers; every other model's and service's are in its row.
    workers = [s.status_row() for s in gw.chat.supervisors]
    breaker = sched.breaker.circuit.value if sched else "closed"
    mode, reasons = serving_mode(gw, workers, breaker)
    device: dict[str, Any] | None = None
    if gw.device is not None and gw.ledger is not None:
        device = {
            "spec": gw.device.spec,
            "kind": gw.device.kind,
            "simulated": gw.device.kind == "sim",
            "epoch": gw.device_epoch,
            "alloc_failures": gw.alloc_failures,
            "hang": gw.device_hang,
            "ledger": asdict(gw.ledger.statistics(now)),
        }
    host = gw.host.statistics()
    return {
        "object": "spillover.status",
        "mode": mode,
        "reasons": reasons,
        "model": gw.cfg.model.name,
        "model_path": gw.chat.model_path,
        "fallback_model": (
            {"name": gw.chat.fallback_name, "path": gw.chat.cpu_model_path, "lane": "cpu"}
            if gw.chat.fallback_name
            else None
        ),
        "device": device,
        "note": (
            "GPU lane runs on a simulated accelerator (sim): no GPU was found"
            if gw.device is not None and gw.device.kind == "sim"
            else None
        ),
        "breaker": asdict(sched.breaker) | {"circuit": breaker} if sched else None,
        "split_breaker": (  # the split worker's own breaker (issue 13 item 1), when there is one
            asdict(sched.split_breaker)
            | {"circuit": sched.split_breaker.circuit.value, "worker_id": sched.split_workers[0].spec.worker_id}
            if sched and sched.split_workers
            else None
        ),
        "lanes": [asdict(x) for x in sched.statistics()] if sched else [],
        "workers": workers,
        "recent_decisions": list(sched.decisions)[-20:] if sched else [],
        "decision_counts": dict(sched.decision_counts) if sched else {},
        "events": gw.events[-20:],
        "live_requests": len(gw.requests.live),
        "running": [r.brief() for r in list(gw.requests.live.values())[:100]],
        "services": service_rows(gw),
        "retry_budget_denied": gw.budget.denied,
        "loop_restarts": dict(gw.loops.restarts),
        "loops": asdict(gw.loops.statistics()),
        "journal_pending_outcomes": len(gw.pending_outcomes),
        "journal_outcomes_dropped": gw.outcomes_dropped,
        "idempotency_keys_held": gw.keys.statistics().keys,
        "connections": asdict(gw.listener()) if gw.listener is not None else None,
        "recovered": gw.recovered,
        # orphans start-up recovery has not replayed or ended yet (those it failed on wait for the next start)
        "recovering": 0 if gw.recovery_ended else len(gw.requests.orphans),
        "host": {
            "budget_bytes": host.budget_bytes,
            "guard": gw.cfg.device.host_guard,
            "observed_rss_bytes": host.observed_bytes,
            "peak_rss_bytes": host.peak_bytes,
            "cpu_slot_bytes": host.slot_bytes,
            "cpu_replica_bytes": host.replica_bytes,
            "cpu_blocked": sched.cpu_blocked if sched else "",
        },
        "uptime_s": round(now - gw.started_s, 3),
    }
