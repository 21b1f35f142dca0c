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

from spillover.engine.llamacpp import OP_OFFLOAD, load_llama_cpp

__all__ = ["COMPUTE_LINE", "OUTPUT_LINE", "MeasuredBuffers", "by_buffer", "ggml_type", "measure_buffers"]

MIB = 1024 * 1024
_PATTERNS = {
    "model": re.compile(r"model buffer size\s*=\s*([\d.]+) MiB"),
    "kv": re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB"),
    "state": re.compile(r"RS buffer size\s*=\s*([\d.]+) MiB"),  # a recurrent layer's state
}
# The compute and output buffer lines, with the backend buffer's name (CPU, CUDA0, ...).
COMPUTE_LINE = re.compile(r"^\S+:\s+(\S+) compute buffer size\s*=\s*([\d.]+) MiB", re.M)
OUTPUT_LINE = re.compile(r"(\S+)\s+output buffer size\s*=\s*([\d.]+) MiB")


def by_buffer(pattern: re.Pattern[str], text: str) -> dict[str, int]:
    """Bytes of each named buffer the (name, MiB) ``pattern`` finds in llama.cpp's log."""
    out: dict[str, int] = {}
    for name, mib in pattern.findall(text):
        out[name] = out.get(name, 0) + int(float(mib) * MIB)
    return out


# ggml.h's enum values of KV cache types the pinned llama-cpp-python does not export as
# constants (its ``GGML_TYPE_*`` list stops before bf16, which llama.cpp itself takes).
GGML_TYPES_UNEXPORTED = {"bf16": 30}  # GGML_TYPE_BF16


def ggml_type(kv_type: str) -> int:
    """llama.cpp's enum value of a KV cache type name (f16, q8_0, bf16, ...)."""
    import llama_cpp

    value = getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}", None)
    if value is None:
        value = GGML_TYPES_UNEXPORTED[kv_type.lower()]
    return int(value)


@dataclass(frozen=True)
class MeasuredBuffers:
    """Bytes llama.cpp reported, by buffer kind (rounded to its 0.01 MiB print precision)."""

    n_ctx: int
    model_bytes: int
    kv_bytes: int
    compute_bytes: int
    output_bytes: int
    state_bytes: int = 0  # recurrent state (llama.cpp's RS buffer): a hybrid model's recurrent layers

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes + self.state_bytes


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
    Llama = load_llama_cpp().Llama
    cache_type = ggml_type(kv_type)
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        llm = Llama(
            model_path=model_path,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            n_gpu_layers=n_gpu_layers,
            type_k=cache_type,
            type_v=cache_type,
            flash_attn=flash_attn,
            op_offload=OP_OFFLOAD,  # as the engine's contexts run
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
        compute_bytes=sum(by_buffer(COMPUTE_LINE, text).values()),
        output_bytes=sum(by_buffer(OUTPUT_LINE, text).values()),
        state_bytes=_sum(_PATTERNS["state"], text),
    )
