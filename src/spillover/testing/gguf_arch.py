"""Write small GGUF models of architectures other than llama, for the memory model's checks.

Each has the tokenizer of a donor GGUF (``gguf_factory``'s, read once a process) and random
F16 weights, in the tensor layout llama.cpp loads for its architecture:

- ``qwen2``: attention with q/k/v biases;
- ``qwen3``: q/k norms and a head size apart from the width;
- ``bert``: an encoder (no causal attention, no KV cache in llama.cpp), with biases and
  position and token-type embeddings;
- ``deepseek2``: multi-head latent attention, written with the ``*_mla`` head sizes (llama.cpp
  caches the latent K rows only) or in the older layout without them (an ordinary cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spillover.testing.gguf_factory import add_donor_tokenizer, donor_tokenizer

__all__ = ["ARCHES", "write_arch"]

ARCHES = ("qwen2", "qwen3", "bert", "deepseek2-mla", "deepseek2")

E, H, FF, LAYERS = 128, 4, 256, 2  # width, query heads, feed-forward width, layers


def _llama_like(arch: str, *, head: int, kv_heads: int, bias: bool, qk_norm: bool) -> tuple[dict[str, Any], list[Any]]:
    keys: dict[str, Any] = {
        ".attention.head_count": H, ".attention.head_count_kv": kv_heads, ".attention.key_length": head,
        ".attention.value_length": head, ".attention.layer_norm_rms_epsilon": 1e-5, ".rope.dimension_count": head,
        ".rope.freq_base": 10000.0,
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm"), ("output.weight", None, "out")]
    for i in range(LAYERS):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), (p + "attn_q.weight", (H * head, E), "w")]
        t += [(p + "attn_k.weight", (kv_heads * head, E), "w"), (p + "attn_v.weight", (kv_heads * head, E), "w")]
        if bias:
            t += [(p + f"attn_{x}.bias", (n * head,), "f32") for x, n in (("q", H), ("k", kv_heads), ("v", kv_heads))]
        if qk_norm:
            t += [(p + "attn_q_norm.weight", (head,), "norm"), (p + "attn_k_norm.weight", (head,), "norm")]
        t += [(p + "attn_output.weight", (E, H * head), "w"), (p + "ffn_norm.weight", (E,), "norm")]
        t += [(p + "ffn_gate.weight", (FF, E), "w"), (p + "ffn_up.weight", (FF, E), "w")]
        t += [(p + "ffn_down.weight", (E, FF), "w")]
    return keys, t


def _bert() -> tuple[dict[str, Any], list[Any]]:
    keys = {
        ".attention.head_count": H, ".attention.layer_norm_epsilon": 1e-12, ".attention.causal": False,
        ".pooling_type": 1, "tokenizer.ggml.token_type_count": 2, ".context_length": 512,  # its position rows
    }  # fmt: skip
    t: list[Any] = [("token_types.weight", (2, E), "f32"), ("position_embd.weight", (512, E), "w")]
    t += [("token_embd_norm.weight", (E,), "norm"), ("token_embd_norm.bias", (E,), "norm")]
    for i in range(LAYERS):
        p = f"blk.{i}."
        for x in ("q", "k", "v", "output"):
            t += [(p + f"attn_{x}.weight", (E, E), "w"), (p + f"attn_{x}.bias", (E,), "f32")]
        t += [(p + "attn_output_norm.weight", (E,), "norm"), (p + "attn_output_norm.bias", (E,), "norm")]
        t += [(p + "ffn_up.weight", (FF, E), "w"), (p + "ffn_up.bias", (FF,), "f32")]
        t += [(p + "ffn_down.weight", (E, FF), "w"), (p + "ffn_down.bias", (E,), "f32")]
        t += [(p + "layer_output_norm.weight", (E,), "norm"), (p + "layer_output_norm.bias", (E,), "norm")]
    return keys, t


def _deepseek2(mla: bool) -> tuple[dict[str, Any], list[Any]]:
    rank, rope, nope, v_head, q_rank = 64, 32, 32, 32, 64
    keys: dict[str, Any] = {
        ".attention.head_count": H, ".attention.layer_norm_rms_epsilon": 1e-5, ".rope.freq_base": 10000.0,
        ".rope.dimension_count": rope, ".leading_dense_block_count": LAYERS, ".expert_feed_forward_length": FF,
        ".expert_count": 2, ".expert_used_count": 1, ".expert_shared_count": 1, ".expert_weights_scale": 1.0,
        ".attention.kv_lora_rank": rank, ".attention.q_lora_rank": q_rank,
    }  # fmt: skip
    if mla:
        keys |= {
            ".attention.head_count_kv": 1, ".attention.key_length": rank + rope, ".attention.value_length": rank,
            ".attention.key_length_mla": nope + rope, ".attention.value_length_mla": v_head,
        }  # fmt: skip
    else:
        keys |= {".attention.head_count_kv": H, ".attention.key_length": nope + rope, ".attention.value_length": v_head}
    t: list[Any] = [("output_norm.weight", (E,), "norm"), ("output.weight", None, "out")]
    for i in range(LAYERS):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), (p + "attn_q_a.weight", (q_rank, E), "w")]
        t += [
            (p + "attn_q_a_norm.weight", (q_rank,), "norm"),
            (p + "attn_q_b.weight", (H * (nope + rope), q_rank), "w"),
        ]
        t += [(p + "attn_kv_a_mqa.weight", (rank + rope, E), "w"), (p + "attn_kv_a_norm.weight", (rank,), "norm")]
        if mla:
            t += [(p + "attn_k_b.weight", (H, rank, nope), "w"), (p + "attn_v_b.weight", (H, v_head, rank), "w")]
        else:
            t += [(p + "attn_kv_b.weight", (H * (nope + v_head), rank), "w")]
        t += [(p + "attn_output.weight", (E, H * v_head), "w"), (p + "ffn_norm.weight", (E,), "norm")]
        t += [(p + "ffn_gate.weight", (FF, E), "w"), (p + "ffn_up.weight", (FF, E), "w")]
        t += [(p + "ffn_down.weight", (E, FF), "w")]
    return keys, t


def write_arch(out: str | Path, tokenizer_from: str, name: str) -> Path:
    """Write the model ``name`` (one of ``ARCHES``) to ``out``."""
    import numpy as np
    from gguf import GGUFWriter

    if name == "qwen2":
        keys, tensors = _llama_like("qwen2", head=E // H, kv_heads=2, bias=True, qk_norm=False)
    elif name == "qwen3":
        keys, tensors = _llama_like("qwen3", head=64, kv_heads=2, bias=False, qk_norm=True)
    elif name == "bert":
        keys, tensors = _bert()
    elif name in ("deepseek2", "deepseek2-mla"):
        keys, tensors = _deepseek2(mla=name == "deepseek2-mla")
    else:
        raise ValueError(f"no writer for {name!r}: one of {', '.join(ARCHES)}")
    arch = name.removesuffix("-mla")
    n_vocab = len(donor_tokenizer(str(tokenizer_from))[0])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{name}")
    keys = {".block_count": LAYERS, ".context_length": 8192, ".embedding_length": E, ".feed_forward_length": FF} | keys
    for key, value in keys.items():
        key = arch + key if key.startswith(".") else key
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # mostly F16
    add_donor_tokenizer(w, str(tokenizer_from))
    rng = np.random.default_rng(0)
    for tname, shape, kind in [("token_embd.weight", (n_vocab, E), "w"), *tensors]:
        if kind == "norm":
            w.add_tensor(tname, np.ones(shape, dtype=np.float32))
            continue
        shape = (n_vocab, E) if kind == "out" else shape
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        w.add_tensor(tname, data if kind == "f32" else data.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
