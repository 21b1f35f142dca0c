"""The drill report: report.md and a self-contained report.html with plots."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from spillover.drill.checker import Figures

__all__ = ["summary_table", "write_report"]

MIB = 1024 * 1024


def _s(x: float | None, scale: float = 1000.0, unit: str = "ms") -> str:
    return "-" if x is None else f"{x * scale:.0f} {unit}"


def summary_table(figures: dict[str, Figures], overall: Figures, caught: dict[str, bool]) -> str:
    """The per-scenario pass/fail table, as Markdown."""
    head = (
        "| scenario | result | invoked | ok | accepted | completed | explicit errors | lost | dup tool effects "
        "| equivalent | degraded flagged | false flags | retries | p50 | p95 | CPU TTFT p50 | queue age p95 "
        "| recovery |"
    )
    rows = [head, "|" + "---|" * 18]
    for f in [*figures.values(), overall]:
        if f.scenario in caught:
            result = "caught (negative control)" if caught[f.scenario] else "NOT CAUGHT"
        else:
            result = "pass" if f.passed else "FAIL"
        eq = f"{f.equivalence_checked - len(f.equivalence_failed)}/{f.equivalence_checked}"
        deg = f"{f.degraded_flagged}/{f.degraded_served}"
        rec = ", ".join(f"{x:.1f}s" for x in f.recovery_s[:4]) or "-"
        rows.append(
            f"| {f.scenario} | {result} | {f.invoked} | {f.ok} | {f.accepted} | {f.completed} | "
            f"{f.explicit_errors} | {len(f.lost)} | {f.duplicate_tool_effects} | {eq} | {deg} | "
            f"{f.false_flags} | {f.retries} | {_s(f.latency_p50_s)} | {_s(f.latency_p95_s)} | "
            f"{_s(f.cpu_ttft_p50_s)} | {_s(f.queue_age_p95_s)} | {rec} |"
        )
    return "\n".join(rows)


def _plots(history: list[dict[str, Any]], overall: Figures) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    samples = [r for r in history if r["type"] == "sample" and r.get("ledger")]
    faults = [r for r in history if r["type"] == "fault"]
    decisions = [r for r in history if r["type"] == "decision"]

    fig, ax = plt.subplots(figsize=(11, 4.2))
    if samples:
        t = [s["t"] for s in samples]
        for key, label in (
            ("capacity_bytes", "capacity"),
            ("predicted_bytes", "reserved (predicted)"),
            ("observed_bytes", "observed"),
        ):
            ax.plot(t, [(s["ledger"].get(key) or 0) / MIB for s in samples], label=label)
        usable = [(s["ledger"]["capacity_bytes"] - s["ledger"]["margin_bytes"]) / MIB for s in samples]
        ax.plot(t, usable, "--", label="capacity - margin", linewidth=0.8)
        top = max((s["ledger"]["capacity_bytes"] for s in samples), default=MIB) / MIB
        colors = {
            "admit": "tab:green",
            "delay": "tab:orange",
            "route": "tab:red",
            "reject": "black",
            "shrink": "tab:purple",
        }
        for kind, color in colors.items():
            xs = [d["t"] for d in decisions if d.get("decision") == kind]
            ax.scatter(xs, [top * 1.03] * len(xs), marker="|", color=color, label=f"decision: {kind}")
        for f in faults:
            ax.axvline(f["t"], color="grey", alpha=0.35, linewidth=0.8)
            ax.text(f["t"], top * 0.05, f["kind"], rotation=90, fontsize=6, alpha=0.7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title("GPU device memory, admission decisions (ticks) and faults (grey lines)")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    out["memory.png"] = _png(fig)

    out["services.png"] = _services_plot(plt, samples, faults)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    routes = sorted(overall.latency_by_route)
    if routes:
        ax.boxplot([overall.latency_by_route[r] for r in routes], tick_labels=routes)
    ax.set_ylabel("seconds")
    ax.set_title("Latency by route (successful operations)")
    out["latency.png"] = _png(fig)

    fig, ax = plt.subplots(figsize=(11, 3.2))
    lane_samples = [r for r in history if r["type"] == "sample"]
    for lane in ("gpu", "cpu"):
        pts: list[tuple[float, int]] = []
        for s in lane_samples:
            depth = next((x["depth"] for x in s["lanes"] if x["lane"] == lane), None)
            if depth is not None:
                pts.append((s["t"], int(depth)))
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=f"{lane} queue")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests waiting")
    ax.set_title("Queue depth over time")
    ax.legend(fontsize=8)
    out["queues.png"] = _png(fig)
    plt.close("all")
    return out


def _services_plot(plt: Any, samples: list[dict[str, Any]], faults: list[dict[str, Any]]) -> bytes:
    """Device memory per service (what each holds in the ledger: weights and its requests'
    reservations), stacked, with what other tenants hold (observed beyond the ledger) on top,
    the usable capacity, and each service's demoted spans shaded."""
    fig, ax = plt.subplots(figsize=(11, 4.2))
    samples = [s for s in samples if s.get("services")]
    if samples:
        t = [s["t"] for s in samples]
        names = [x["name"] for x in samples[-1]["services"]]
        layers = []
        for name in names:
            row: list[dict[str, Any]] = [next((x for x in s["services"] if x["name"] == name), {}) for s in samples]
            layers.append([(x.get("device_bytes") or 0) / MIB for x in row])
        others = [
            max(0, (s["ledger"].get("observed_bytes") or 0) - s["ledger"]["predicted_bytes"]) / MIB for s in samples
        ]
        ax.stackplot(t, *layers, others, labels=[*names, "other tenants (observed beyond the ledger)"], alpha=0.8)
        usable = [(s["ledger"]["capacity_bytes"] - s["ledger"]["margin_bytes"]) / MIB for s in samples]
        ax.plot(t, usable, "k--", label="capacity - margin", linewidth=0.8)
        for name in names:
            demoted = [s["t"] for s in samples if any(x["name"] == name and x["demoted"] for x in s["services"])]
            if demoted:
                ax.scatter(demoted, [0] * len(demoted), marker="s", s=8, label=f"{name} demoted (off the GPU)")
        for f in faults:
            ax.axvline(f["t"], color="grey", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title("Device memory per service (ledger: weights + request reservations), stacked")
    if samples:
        ax.legend(fontsize=7, loc="upper right")
    return _png(fig)


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_report(
    out: Path,
    history: list[dict[str, Any]],
    figures: dict[str, Figures],
    overall: Figures,
    caught: dict[str, bool],
    profile: str,
) -> None:
    """Write report.md, report.html and the plot PNGs into ``out``."""
    plots = _plots(history, overall)
    for name, data in plots.items():
        (out / name).write_bytes(data)
    table = summary_table(figures, overall, caught)
    failures = [
        f"- **{f.scenario}**: {msg}" for f in figures.values() if f.scenario not in caught for msg in f.failures
    ]
    verdict = "PASS" if overall.passed and not failures and all(caught.values()) else "FAIL"
    peak = f"{overall.peak_rss_bytes / MIB:.0f} MiB of {overall.budget_bytes / MIB:.0f} MiB"
    md = [
        f"# spillover drill — {verdict}",
        "",
        f"Profile `{profile}`. Raw history: `history.jsonl` (one record per line).",
        "",
        "Pass criteria: no accepted request lost; host RSS never over budget; no tool effect executed "
        "twice; every degraded response flagged; token equivalence where claimed. Negative controls "
        "must be *caught* by the checker.",
        "",
        f"Overall: {overall.invoked} operations, {overall.accepted} accepted, {len(overall.lost)} lost, "
        f"{overall.duplicate_tool_effects} duplicate tool effects, degraded visibility "
        f"{overall.degraded_visibility:.0%} ({overall.degraded_flagged}/{overall.degraded_served}), "
        f"{overall.false_flags} false flags, peak host RSS {peak}, first error: {overall.first_error or '-'}.",
        "",
        table,
        "",
        "## Failures",
        "",
        *(failures or ["none"]),
        "",
        "## Plots",
        "",
        "![device memory](memory.png)",
        "",
        "![device memory per service](services.png)",
        "",
        "![latency by route](latency.png)",
        "",
        "![queue depth](queues.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    imgs = "".join(
        f'<h2>{html.escape(name)}</h2><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(data).decode()}">'
        for name, data in plots.items()
    )
    rows = table.splitlines()
    thead = "".join(f"<th>{html.escape(c.strip())}</th>" for c in rows[0].strip("|").split("|"))
    tbody = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in r.strip("|").split("|")) + "</tr>"
        for r in rows[2:]
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>spillover drill</title><style>"
        "body{font:14px system-ui,sans-serif;margin:1.5rem}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:.2rem .4rem}img{max-width:100%}</style></head><body>"
        f"<h1>spillover drill — {verdict}</h1><p>{html.escape(md[6])}</p><p>{html.escape(md[8])}</p>"
        f"<table><thead><tr>{thead}</tr></thead><tbody>{tbody}</tbody></table>"
        f"<h2>Failures</h2><ul>{''.join(f'<li>{html.escape(x[2:])}</li>' for x in failures) or '<li>none</li>'}</ul>"
        f"{imgs}</body></html>"
    )
    (out / "report.html").write_text(page, encoding="utf-8")
