"""The memory model against what llama.cpp itself reports for the real default model."""

from __future__ import annotations

import pytest

from spillover.core.memory import MemoryModel, ModelSpec
from spillover.engine.calibrate import measure_buffers
from spillover.testing.gguf_factory import TinyLlamaSpec, write_tiny_llama


@pytest.mark.parametrize("n_ctx", [256, 1000, 4096])
def test_default_model_prediction_within_3_percent(model_path: str, smol_spec: ModelSpec, n_ctx: int) -> None:
    """Predicted weights + KV + compute is within 3% of llama.cpp's reported buffers."""
    m = measure_buffers(model_path, n_ctx)
    mm = MemoryModel(smol_spec, cpu_repack=True)
    assert abs(m.kv_bytes - mm.kv_bytes(n_ctx)) <= 0.01 * 2**20  # llama.cpp prints 2 decimals of MiB
    pred = mm.weights_bytes() + mm.context_bytes(n_ctx)
    assert abs(pred - m.total_bytes) / m.total_bytes <= 0.03


def test_written_gguf_loads_and_is_predicted(tmp_path, model_path: str) -> None:
    """A GGUF written with the gguf package (another KV layout) loads and is predicted."""
    from spillover.engine.gguf_meta import read_model_spec

    path = write_tiny_llama(tmp_path / "t.gguf", model_path, TinyLlamaSpec(n_layers=2, n_head=4, n_head_kv=1))
    spec = read_model_spec(path)
    assert (spec.n_layers, spec.n_head, spec.n_head_kv) == (2, 4, 1)
    m = measure_buffers(str(path), 512)
    mm = MemoryModel(spec, cpu_repack=True)
    assert abs(mm.weights_bytes() + mm.context_bytes(512) - m.total_bytes) / m.total_bytes <= 0.03
