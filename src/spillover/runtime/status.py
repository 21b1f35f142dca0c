"""The /v1/status document: one JSON-ready snapshot of the whole gateway.

``status_document`` owns the document's shape and the serving mode it reports (``normal``,
``degraded`` with its reasons, or ``unavailable``). It reads the components' ``statistics()``
snapshots and the gateway's counters and changes nothing. ``/metrics`` is built from it too.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["status_document"]


def serving_mode(gw: Gateway, workers: list[dict[str, Any]], breaker: str) -> tuple[str, list[str]]:
    """The mode the gateway serves in and why it is not ``normal``."""
    gpu_ready = any(w["state"] == "ready" for w in workers if w["lane"] == "gpu")
    cpu_ready = any(w["state"] == "ready" for w in workers if w["lane"] == "cpu")
    reasons = []
    if gw.device is not None and not gpu_ready:
        reasons.append("gpu worker not ready")
    if breaker != "closed":
        reasons.append(f"gpu breaker {breaker}")
    if gw.device is None:
        reasons.append("no gpu lane")
    if gw.loops.fatal is not None:
        reasons.append(gw.loops.fatal)
    if gw.loops.fatal is not None or not (gpu_ready or cpu_ready):
        mode = "unavailable"
    elif reasons:
        mode = "degraded"
    else:
        mode = "normal"
    return mode, reasons


def status_document(gw: Gateway) -> dict[str, Any]:
    """The /v1/status document."""
    now = time.monotonic()
    sched = gw.scheduler
    workers = [asdict(s.worker.statistics()) | {"restarts": s.restarts} for s in gw.supervisors]
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
        "model_path": gw.model_path,
        "fallback_model": (
            {"name": gw.fallback_name, "path": gw.cpu_model_path, "lane": "cpu"} if gw.fallback_name else None
        ),
        "device": device,
        "note": (
            "GPU lane runs on a simulated accelerator (sim): no GPU was found"
            if gw.device is not None and gw.device.kind == "sim"
            else None
        ),
        "breaker": asdict(sched.breaker) | {"circuit": breaker} if sched else None,
        "lanes": [asdict(x) for x in sched.statistics()] if sched else [],
        "workers": workers,
        "recent_decisions": list(sched.decisions)[-20:] if sched else [],
        "decision_counts": dict(sched.decision_counts) if sched else {},
        "events": gw.events[-20:],
        "live_requests": len(gw.requests.live),
        "running": [
            {"rid": rid, "route": r.info.route if r.info else None, "attempt": r.exe.attempt}
            for rid, r in list(gw.requests.live.items())[:100]
        ],
        "retry_budget_denied": gw.budget.denied,
        "loop_restarts": dict(gw.loops.restarts),
        "loops": asdict(gw.loops.statistics()),
        "journal_pending_outcomes": len(gw.pending_outcomes),
        "journal_outcomes_dropped": gw.outcomes_dropped,
        "idempotency_keys_held": gw.keys.statistics().keys,
        "connections": asdict(gw.listener()) if gw.listener is not None else None,
        "recovered": gw.recovered,
        "host": {
            "budget_bytes": host.budget_bytes,
            "guard": gw.cfg.device.host_guard,
            "observed_rss_bytes": host.observed_bytes,
            "peak_rss_bytes": host.peak_bytes,
            "cpu_slot_bytes": host.slot_bytes,
            "cpu_blocked": sched.cpu_blocked if sched else "",
        },
        "uptime_s": round(now - gw.started_s, 3),
    }
