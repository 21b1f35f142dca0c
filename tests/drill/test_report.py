"""The drill report on a hand-written history: the per-service memory plot is drawn from
the samples' service rows, and the Markdown report links every plot it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spillover.drill.checker import check
from spillover.drill.report import write_report

MIB = 1024 * 1024


def _sample(t: float, chat_mib: int, emb_mib: int, demoted: bool, tenant_mib: int) -> dict[str, Any]:
    predicted = (chat_mib + emb_mib) * MIB
    return {
        "type": "sample",
        "t": t,
        "ledger": {
            "capacity_bytes": 1024 * MIB,
            "margin_bytes": 32 * MIB,
            "predicted_bytes": predicted,
            "observed_bytes": predicted + tenant_mib * MIB,
        },
        "lanes": [{"lane": "gpu", "depth": 0, "oldest_age_s": 0.0, "running": 0}],
        "services": [
            {"name": "chat", "device_bytes": chat_mib * MIB, "demoted": False},
            {"name": "emb", "device_bytes": emb_mib * MIB, "demoted": demoted},
        ],
    }


def test_report_plots_memory_per_service(tmp_path: Path) -> None:
    history = [
        _sample(0.0, 92, 47, False, 0),
        _sample(1.0, 92, 780, False, 0),
        {"type": "fault", "t": 1.5, "kind": "tenant_start"},
        _sample(2.0, 210, 0, True, 700),
        _sample(3.0, 92, 47, False, 0),
    ]
    fig = check(history, None)
    write_report(tmp_path, history, {}, fig, {}, "ci")
    png = (tmp_path / "services.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (tmp_path / "report.md").read_text()
    for name in ("memory.png", "services.png", "latency.png", "queues.png"):
        assert f"({name})" in md and (tmp_path / name).exists()


def test_a_history_without_service_rows_still_reports(tmp_path: Path) -> None:
    """A gateway that serves chat alone (or an older one): the plot is drawn empty, not an error."""
    s = _sample(0.0, 92, 0, False, 0)
    s.pop("services")
    fig = check([s], None)
    write_report(tmp_path, [s], {}, fig, {}, "ci")
    assert (tmp_path / "services.png").stat().st_size > 0
