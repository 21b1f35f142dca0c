"""Measure what llama.cpp itself reports it allocates (model, KV, compute, output buffers).

llama.cpp logs each buffer it allocates when it loads a model and creates a context; with
``verbose=True`` llama-cpp-python prints those lines to ``sys.stderr``, where we catch them.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from dataclasses import dataclass

__all__ = ["MeasuredBuffers", "measure_buffers"]

MIB = 1024 * 1024
_PATTERNS = {
    "model": re.compile(r"model buffer size\s*=\s*([\d.]+) MiB"),
    "kv": re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB"),
    "compute": re.compile(r"^\S+:\s+\S+ compute buffer size\s*=\s*([\d.]+) MiB", re.M),
    "output": re.compile(r"output buffer size\s*=\s*([\d.]+) MiB"),
}


@dataclass(frozen=True)
class MeasuredBuffers:
    """Bytes llama.cpp reported, by buffer kind (rounded to its 0.01 MiB print precision)."""

    n_ctx: int
    model_bytes: int
    kv_bytes: int
    compute_bytes: int
    output_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes


def _sum(pattern: re.Pattern[str], text: str) -> int:
    return int(sum(float(x) for x in pattern.findall(text)) * MIB)


def measure_buffers(
    model_path: str,
    n_ctx: int,
    n_batch: int = 512,
    n_gpu_layers: int = 0,
    *,
    n_ubatch: int = 512,
    kv_type: str = "f16",
    flash_attn: bool = False,
) -> MeasuredBuffers:
    """Load ``model_path`` with a context of ``n_ctx`` (batch, micro-batch, KV cache type and
    flash attention as given) and return the buffers llama.cpp reported."""
    import llama_cpp
    from llama_cpp import Llama

    ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}")
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        llm = Llama(
            model_path=model_path,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            n_gpu_layers=n_gpu_layers,
            type_k=ggml_type,
            type_v=ggml_type,
            flash_attn=flash_attn,
            n_threads=1,
            verbose=True,
        )
        llm.close()
        del llm
    text = buf.getvalue()
    if sys.stderr is not None and not _PATTERNS["model"].search(text):
        raise RuntimeError("llama.cpp did not report its buffers; is verbose logging captured?")
    return MeasuredBuffers(
        n_ctx=n_ctx,
        model_bytes=_sum(_PATTERNS["model"], text),
        kv_bytes=_sum(_PATTERNS["kv"], text),
        compute_bytes=_sum(_PATTERNS["compute"], text),
        output_bytes=_sum(_PATTERNS["output"], text),
    )
