"""The memory model and ``spillover estimate`` held against every cell llama.cpp was measured
on: tests/core/data/memory_table.json, recorded by ``python -m benchmarks.estimate_accuracy
--write`` (real loads on the CPU backend; no engine is needed here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spillover.core.estimate import estimate
from spillover.core.memory import MemoryModel, ModelSpec

TABLE = json.loads((Path(__file__).parent / "data" / "memory_table.json").read_text())
# The off-grid cells (``--offgrid --write``): round 72's, flash attention with a query of another
# width than a row, where the envelope was up to 5.6 % under, and round 74's, a narrower query
# without it (1.8 % under). Held to the same bounds, but for the envelope's over-estimate: on
# them it is up to 16.6 % (room kept free).
OFFGRID = json.loads((Path(__file__).parent / "data" / "memory_offgrid.json").read_text())


def _specs(table: dict[str, Any]) -> dict[str, ModelSpec]:
    """JSON lists back to the spec's tuples."""
    return {
        name: ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        for name, d in table["specs"].items()
    }


SPECS = _specs(TABLE)
OFFGRID_SPECS = _specs(OFFGRID)
PRINTED = 16 * 1024  # llama.cpp prints MiB with two decimals, per buffer
ENVELOPE_OVER = 0.06  # the envelope's worst over-estimate on the table (5.8 %): room kept free
OFFGRID_OVER = 0.17  # and on the off-grid cells (16.6 %)


def _id(c: dict[str, Any]) -> str:
    return (
        f"{c['shape']}-{c['n_ctx']}-b{c['n_batch']}-u{c['n_ubatch']}-{c['kv_type']}{'-fa' if c['flash_attn'] else ''}"
    )


def test_the_table_covers_the_grid() -> None:
    """Shapes (mixtures of experts, repacked weights among them), odd contexts, clamped
    batches, five KV types, flash attention on and off."""
    cells = TABLE["cells"]
    assert len(SPECS) >= 16 and len(cells) >= 600
    assert {c["kv_type"] for c in cells} == {"f16", "q8_0", "q4_0", "f32", "bf16"}
    assert {(c["kv_type"], c["flash_attn"]) for c in cells} >= {("f32", True), ("f32", False), ("bf16", True)}
    assert any(s.n_expert_used > 0 for s in SPECS.values()) and any(s.repack_bytes > 0 for s in SPECS.values())
    assert {c["shape"] for c in cells} == set(SPECS)
    assert {c["flash_attn"] for c in cells} == {False, True}
    assert any(c["n_ctx"] % 256 for c in cells) and any(c["n_batch"] > c["n_ctx"] for c in cells)
    assert len({(c["n_batch"], c["n_ubatch"]) for c in cells}) >= 6
    heads = {(s.n_head, s.n_head_kv) for s in SPECS.values()}
    assert any(h == kv for h, kv in heads) and any(kv == 1 for _, kv in heads) and any(h % 2 for h, _ in heads)


@pytest.mark.parametrize(
    ("cell", "over"),
    [*((c, ENVELOPE_OVER) for c in TABLE["cells"]), *((c, OFFGRID_OVER) for c in OFFGRID["cells"])],
    ids=lambda v: _id(v) if isinstance(v, dict) else "grid" if v == ENVELOPE_OVER else "offgrid",
)
def test_every_measured_cell(cell: dict[str, Any], over: float) -> None:
    spec = {**SPECS, **OFFGRID_SPECS}[cell["shape"]]
    m = cell["measured"]
    kw = {k: cell[k] for k in ("n_batch", "n_ubatch", "kv_type", "flash_attn")}
    model = MemoryModel(spec, cpu_repack=True, **kw)
    # Weights, KV and output are exact counts (to llama.cpp's print precision).
    assert abs(model.weights_bytes() - m["model_bytes"]) <= PRINTED
    assert abs(model.kv_bytes(cell["n_ctx"]) - m["kv_bytes"]) <= PRINTED
    assert abs(model.output_bytes() - m["output_bytes"]) <= PRINTED
    # The envelope never under-estimates the compute buffer by more than 1 %.
    assert model.compute_bytes(cell["n_ctx"]) >= m["compute_bytes"] * 0.99
    measured = sum(m.values())
    envelope = estimate(spec, cell["n_ctx"], **kw).total_bytes
    assert -0.01 <= (envelope - measured) / measured <= over
    # spillover estimate (llama.cpp's planned compute): within 3 %, never more than 1 % under.
    planned = cell["planned_compute_bytes"]
    assert abs(planned - m["compute_bytes"]) <= PRINTED
    total = estimate(spec, cell["n_ctx"], compute=lambda _n: planned, **kw).total_bytes
    assert -0.01 <= (total - measured) / measured <= 0.03
