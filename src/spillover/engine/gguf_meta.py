"""Read a GGUF file's metadata into a ``ModelSpec`` for the memory model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spillover.core.memory import ModelSpec

__all__ = ["CPU_REPACK_TYPES", "read_model_spec"]

# Weight types llama.cpp's CPU backend repacks into a second, interleaved copy (measured on
# this build: Q4_K layer matrices are; Q8_0, Q5_0, Q6_K and Q4_1 are not).
CPU_REPACK_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL"})


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def read_model_spec(path: str | Path) -> ModelSpec:
    """Parse layers, heads, head sizes, vocabulary and tensor bytes from a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    arch = str(_field(reader, "general.architecture", "llama"))
    n_layers = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv_raw = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_head_kv_raw, list):  # per-layer counts (some architectures)
        n_head_kv = max(int(x) for x in n_head_kv_raw)
    else:
        n_head_kv = int(n_head_kv_raw)
    head_k = int(_field(reader, f"{arch}.attention.key_length", n_embd // n_head))
    head_v = int(_field(reader, f"{arch}.attention.value_length", n_embd // n_head))
    n_ctx_train = int(_field(reader, f"{arch}.context_length", 2048))
    swa = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    layer_bytes = 0
    other_bytes = 0
    repack_bytes = 0
    for t in reader.tensors:
        if t.name.startswith("blk."):
            layer_bytes += int(t.n_bytes)
            if t.tensor_type.name in CPU_REPACK_TYPES and len(t.shape) == 2:
                repack_bytes += int(t.n_bytes)
        else:
            other_bytes += int(t.n_bytes)
    file_type = int(_field(reader, "general.file_type", -1))
    return ModelSpec(
        name=str(_field(reader, "general.name", Path(path).stem)),
        arch=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=head_v,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        sliding_window=swa,
        layer_bytes=layer_bytes,
        other_bytes=other_bytes,
        file_bytes=os.path.getsize(path),
        file_type=file_type,
        repack_bytes=repack_bytes,
    )
