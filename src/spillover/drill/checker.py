"""The drill's checker: pure functions over a recorded history.

Pass criteria (DESIGN.md, "The drill"):

1. no accepted request is lost (every request id the gateway gave out ends in a terminal
   journal state);
2. the host never exceeds its budget (peak RSS of gateway + workers);
3. no tool effect is executed twice;
4. every degraded response is flagged (header and body), and no GPU response is;
5. token equivalence holds wherever it is claimed (greedy runs vs an uninterrupted
   reference; not claimed for answers of a configured fallback model).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Figures", "check"]

TERMINAL = {"completed", "failed", "cancelled", "rejected", "resumable_error"}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class Figures:
    """Checker output for one scenario (or ``overall``)."""

    scenario: str
    invoked: int = 0
    ok: int = 0
    failed: int = 0
    info: int = 0
    accepted: int = 0
    completed: int = 0
    explicit_errors: int = 0
    lost: list[str] = field(default_factory=list)
    duplicate_tool_effects: int = 0
    equivalence_checked: int = 0
    equivalence_failed: list[str] = field(default_factory=list)
    degraded_served: int = 0
    degraded_flagged: int = 0
    false_flags: int = 0
    retries: int = 0
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    latency_by_route: dict[str, list[float]] = field(default_factory=dict)
    cpu_ttft_p50_s: float | None = None
    queue_age_p95_s: float | None = None
    peak_rss_bytes: int = 0
    budget_bytes: int = 0
    recovery_s: list[float] = field(default_factory=list)
    first_error: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def success_rate(self) -> float:
        return self.ok / self.invoked if self.invoked else 1.0

    @property
    def degraded_visibility(self) -> float:
        return self.degraded_flagged / self.degraded_served if self.degraded_served else 1.0

    @property
    def passed(self) -> bool:
        return not self.failures


def _outcomes(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for rec in history:
        if rec["type"] in ("ok", "fail", "info"):
            out[rec["op"]] = rec
    return out


def check(history: list[dict[str, Any]], scenario: str | None = None) -> Figures:
    """Compute figures and pass/fail for one scenario's records (all when None)."""
    recs = [r for r in history if scenario is None or r.get("scenario") == scenario]
    fig = Figures(scenario or "overall")
    invokes = [r for r in recs if r["type"] == "invoke"]
    outcomes = _outcomes(recs)
    finals = {r["request_id"]: r for r in history if r["type"] == "final"}
    fig.invoked = len(invokes)
    lat: list[float] = []
    by_route: dict[str, list[float]] = defaultdict(list)
    cpu_ttft: list[float] = []
    seen_ids: set[str] = set()
    for inv in invokes:
        res = outcomes.get(inv["op"])
        if res is None or res["type"] == "info":
            fig.info += 1
        elif res["type"] == "ok":
            fig.ok += 1
        else:
            fig.failed += 1
            if fig.first_error is None:
                fig.first_error = f"{inv.get('name', '')}: {res.get('error_code') or res.get('error')}"
        if res is None:
            continue
        rid = res.get("request_id")
        if rid:
            seen_ids.add(rid)
        if res["type"] == "ok":
            lat.append(res["latency_s"])
            by_route[res.get("route") or "?"].append(res["latency_s"])
            if res.get("route") == "cpu" and res.get("ttft_s") is not None:
                cpu_ttft.append(res["ttft_s"])
            if (res.get("attempts") or 1) > 1:
                fig.retries += 1
            served_degraded = res.get("route") not in ("gpu", None) or res.get("model_fallback", False)
            # Headers go out once; a stream that moved from GPU to CPU mid-way says so in-band
            # (a spillover chunk), so for it the body flag is the signal.
            header_ok = res.get("degraded_header") == "1" or (res.get("stream") and res.get("header_route") == "gpu")
            flagged = header_ok and res.get("degraded_body") is True
            if served_degraded:
                fig.degraded_served += 1
                fig.degraded_flagged += int(bool(flagged))
                if not flagged:
                    fig.failures.append(f"op {inv['op']} served by {res.get('route')} but not flagged degraded")
            elif res.get("degraded_header") == "1" or res.get("degraded_body") is True:
                fig.false_flags += 1
                fig.failures.append(f"op {inv['op']} served by GPU but flagged degraded")
            # Equivalence is claimed for the GPU and an exact replica, not for a fallback model
            # (a different model by design, which criterion 4 requires to be flagged instead).
            if res.get("reference_text") is not None and not res.get("model_fallback"):
                fig.equivalence_checked += 1
                if res.get("text") != res["reference_text"]:
                    fig.equivalence_failed.append(rid or str(inv["op"]))
    for rid in sorted(seen_ids):
        final = finals.get(rid)
        if final is not None and not final.get("accepted"):
            continue  # refused before it was journaled (bad input, full queue): nothing to lose
        fig.accepted += 1
        state = final.get("state") if final else None
        if state not in TERMINAL:
            fig.lost.append(rid)
        elif state == "completed":
            fig.completed += 1
        else:
            fig.explicit_errors += 1
    effects = Counter(r["tool_call_id"] for r in recs if r["type"] == "tool")
    steps = Counter((r.get("agent"), r.get("step")) for r in recs if r["type"] == "tool")
    fig.duplicate_tool_effects = sum(n - 1 for n in effects.values() if n > 1) + sum(
        n - 1 for n in steps.values() if n > 1
    )
    samples = [r for r in recs if r["type"] == "sample"]
    ages = [lane["oldest_age_s"] for s in samples for lane in s.get("lanes", [])]
    fig.queue_age_p95_s = _pct(ages, 0.95)
    fig.peak_rss_bytes = max((s.get("host_rss", 0) for s in samples), default=0)
    fig.budget_bytes = max((s.get("host_budget", 0) for s in samples), default=0)
    for fault in (r for r in recs if r["type"] == "fault" and r.get("expect_recovery")):
        back = next((s["t"] for s in samples if s["t"] > fault["t"] and s.get("gpu_serving")), None)
        if back is not None:
            fig.recovery_s.append(round(back - fault["t"], 3))
    fig.latency_p50_s = statistics.median(lat) if lat else None
    fig.latency_p95_s = _pct(lat, 0.95)
    fig.latency_by_route = dict(by_route)
    fig.cpu_ttft_p50_s = statistics.median(cpu_ttft) if cpu_ttft else None
    fig.failures += [f"{a['name']}: {a.get('detail')}" for a in recs if a["type"] == "assert" and not a["ok"]]
    if fig.lost:
        fig.failures.append(f"{len(fig.lost)} accepted request(s) lost: {fig.lost[:5]}")
    if fig.duplicate_tool_effects:
        fig.failures.append(f"{fig.duplicate_tool_effects} tool effect(s) executed twice")
    if fig.equivalence_failed:
        fig.failures.append(f"token equivalence failed for {fig.equivalence_failed[:5]}")
    if fig.budget_bytes and fig.peak_rss_bytes > fig.budget_bytes:
        fig.failures.append(
            f"host RSS peaked at {fig.peak_rss_bytes >> 20} MiB over the {fig.budget_bytes >> 20} MiB budget"
        )
    return fig
