"""Write small GGUF models of architectures other than llama, for the memory model's checks.

Each has the tokenizer of a donor GGUF (``gguf_factory``'s, read once a process) and random
F16 weights, in the tensor layout llama.cpp loads for its architecture:

- ``qwen2``: attention with q/k/v biases;
- ``qwen3``: q/k norms and a head size apart from the width;
- ``bert``: an encoder (no causal attention, no KV cache in llama.cpp), with biases and
  position and token-type embeddings;
- ``deepseek2``: multi-head latent attention, written with the ``*_mla`` head sizes (llama.cpp
  caches the latent K rows only) or in the older layout without them (an ordinary cache);
- ``openelm``: per-layer query and KV head counts and feed-forward widths, fused Q/K/V;
- ``granitehybrid``: a hybrid, a Mamba2 layer (recurrent state, no KV cache) and an attention one;
- ``lfm2``: a hybrid, a short-convolution layer and an attention one, tied output;
- ``gemma3``: sliding-window attention (two masks), q/k norms, tied output;
- ``qwen2moe``: a mixture of experts with a shared expert;
- ``gpt2``: a fused Q/K/V projection with a bias, learned positions, tied output;
- ``deci``: per-layer shapes with a layer without attention and one without a feed-forward;
- ``llama4``: chunked attention in three layers and full attention in the fourth (two masks),
  and a mixture of experts with a shared expert every second layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spillover.testing.gguf_factory import add_donor_tokenizer, donor_tokenizer

__all__ = ["ARCHES", "write_arch"]

ARCHES = (
    "qwen2", "qwen3", "bert", "deepseek2-mla", "deepseek2", "openelm", "granitehybrid", "lfm2", "gemma3",
    "qwen2moe", "gpt2", "deci", "llama4",
)  # fmt: skip

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
        t += _ffn(p)
    return keys, t


def _ffn(p: str, ff: int = FF) -> list[Any]:
    return [
        (p + "ffn_gate.weight", (ff, E), "w"),
        (p + "ffn_up.weight", (ff, E), "w"),
        (p + "ffn_down.weight", (E, ff), "w"),
    ]


def _attention(p: str, kv: int, head: int) -> list[Any]:
    return [
        (p + "attn_q.weight", (H * head, E), "w"), (p + "attn_k.weight", (kv * head, E), "w"),
        (p + "attn_v.weight", (kv * head, E), "w"), (p + "attn_output.weight", (E, H * head), "w"),
    ]  # fmt: skip


def _hybrid(arch: str) -> tuple[dict[str, Any], list[Any]]:
    """Layer 0 recurrent (Mamba2, or LFM2's short convolution), layer 1 attention with 2 KV heads."""
    head, kv = E // H, [0, 2]
    keys: dict[str, Any] = {
        ".attention.head_count": H, ".attention.head_count_kv": kv, ".attention.layer_norm_rms_epsilon": 1e-5,
        ".rope.dimension_count": head, ".rope.freq_base": 10000.0,
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm")]
    layer0: list[Any]
    layer1: list[Any]
    if arch == "lfm2":
        keys[".shortconv.l_cache"] = 3
        t = [("token_embd_norm.weight", (E,), "norm")]
        layer0 = [
            ("blk.0.shortconv.conv.weight", (E, 3), "f32"), ("blk.0.shortconv.in_proj.weight", (3 * E, E), "w"),
            ("blk.0.shortconv.out_proj.weight", (E, E), "w"),
        ]  # fmt: skip
        layer1 = [("blk.1.attn_q_norm.weight", (head,), "norm"), ("blk.1.attn_k_norm.weight", (head,), "norm")]
    else:
        inner, state, heads = 2 * E, 64, 8
        keys |= {
            ".ssm.conv_kernel": 4, ".ssm.inner_size": inner, ".ssm.state_size": state, ".ssm.time_step_rank": heads,
            ".ssm.group_count": 1, ".attention.scale": 0.125, ".embedding_scale": 1.0, ".residual_scale": 1.0,
            ".logit_scale": 1.0,
        }  # fmt: skip
        t.append(("output.weight", None, "out"))
        conv = inner + 2 * state
        layer0 = [
            ("blk.0.ssm_in.weight", (2 * inner + 2 * state + heads, E), "w"),
            ("blk.0.ssm_conv1d.weight", (conv, 4), "f32"),
            ("blk.0.ssm_conv1d.bias", (conv,), "f32"),
            ("blk.0.ssm_dt.bias", (heads,), "f32"),
            ("blk.0.ssm_a", (heads, 1), "f32"),
            ("blk.0.ssm_d", (heads, 1), "f32"),
            ("blk.0.ssm_norm.weight", (1, inner), "norm"),
            ("blk.0.ssm_out.weight", (E, inner), "w"),
        ]
        layer1 = []
    for i, layer in ((0, layer0), (1, layer1 + _attention("blk.1.", 2, head))):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), *layer, (p + "ffn_norm.weight", (E,), "norm"), *_ffn(p)]
    return keys, t


def _openelm() -> tuple[dict[str, Any], list[Any]]:
    head, heads, kv_heads, widths = 32, [2, 4], [1, 2], [FF // 2, FF]
    keys: dict[str, Any] = {
        ".attention.head_count": heads, ".attention.head_count_kv": kv_heads, ".feed_forward_length": widths,
        ".attention.key_length": head, ".attention.value_length": head, ".attention.layer_norm_rms_epsilon": 1e-5,
        ".rope.dimension_count": head, ".rope.freq_base": 10000.0,
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm")]
    for i, (h, kv, ff) in enumerate(zip(heads, kv_heads, widths, strict=True)):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), (p + "attn_qkv.weight", ((h + 2 * kv) * head, E), "w")]
        t += [(p + "attn_q_norm.weight", (head,), "norm"), (p + "attn_k_norm.weight", (head,), "norm")]
        t += [(p + "attn_output.weight", (E, h * head), "w"), (p + "ffn_norm.weight", (E,), "norm"), *_ffn(p, ff)]
    return keys, t


def _deci() -> tuple[dict[str, Any], list[Any]]:
    """Layer 0: 4 query heads on 2 KV heads and a feed-forward; layer 1: a feed-forward alone
    (no attention: no KV heads); layer 2: 4 KV heads and no feed-forward."""
    head = E // H
    keys: dict[str, Any] = {
        ".attention.head_count": [H, 0, H], ".attention.head_count_kv": [2, 0, H],
        ".feed_forward_length": [FF, FF // 2, 0], ".attention.layer_norm_rms_epsilon": 1e-5,
        ".rope.dimension_count": head, ".rope.freq_base": 10000.0, ".block_count": 3,
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm")]
    t += [("blk.0.attn_norm.weight", (E,), "norm"), *_attention("blk.0.", 2, head)]
    t += [("blk.0.ffn_norm.weight", (E,), "norm"), *_ffn("blk.0.")]
    t += [("blk.1.ffn_norm.weight", (E,), "norm"), *_ffn("blk.1.", FF // 2)]
    t += [("blk.2.attn_norm.weight", (E,), "norm"), *_attention("blk.2.", H, head)]
    return keys, t


def _llama4() -> tuple[dict[str, Any], list[Any]]:
    head, experts, width = E // H, 4, 128
    keys: dict[str, Any] = {
        ".attention.head_count": H, ".attention.head_count_kv": 2, ".attention.layer_norm_rms_epsilon": 1e-5,
        ".rope.dimension_count": head, ".rope.freq_base": 10000.0, ".expert_count": experts, ".expert_used_count": 1,
        ".expert_feed_forward_length": width, ".interleave_moe_layer_step": 2, ".attention.chunk_size": 256,
        ".block_count": 4,  # layers 0-2 chunked, layer 3 full attention: both masks
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm")]
    for i in range(4):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), *_attention(p, 2, head), (p + "ffn_norm.weight", (E,), "norm")]
        if i % 2 == 0:
            t += _ffn(p)
            continue
        t += [(p + "ffn_gate_inp.weight", (experts, E), "f32")]
        t += [(p + f"ffn_{x}_exps.weight", (experts, width, E), "w") for x in ("gate", "up")]
        t += [(p + "ffn_down_exps.weight", (experts, E, width), "w")]
        t += [(p + f"ffn_{x}_shexp.weight", (width, E), "w") for x in ("gate", "up")]
        t += [(p + "ffn_down_shexp.weight", (E, width), "w")]
    return keys, t


def _gemma3() -> tuple[dict[str, Any], list[Any]]:
    head = 64
    keys: dict[str, Any] = {
        ".attention.head_count": H, ".attention.head_count_kv": 1, ".attention.key_length": head,
        ".attention.value_length": head, ".attention.layer_norm_rms_epsilon": 1e-6, ".attention.sliding_window": 64,
        ".rope.freq_base": 10000.0,
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm")]
    for i in range(LAYERS):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), *_attention(p, 1, head)]
        t += [(p + "attn_q_norm.weight", (head,), "norm"), (p + "attn_k_norm.weight", (head,), "norm")]
        t += [(p + "post_attention_norm.weight", (E,), "norm"), (p + "ffn_norm.weight", (E,), "norm"), *_ffn(p)]
        t += [(p + "post_ffw_norm.weight", (E,), "norm")]
    return keys, t


def _qwen2moe() -> tuple[dict[str, Any], list[Any]]:
    head, experts, width = E // H, 4, 64
    keys: dict[str, Any] = {
        ".attention.head_count": H, ".attention.head_count_kv": H, ".attention.layer_norm_rms_epsilon": 1e-6,
        ".rope.freq_base": 10000.0, ".expert_count": experts, ".expert_used_count": 2,
        ".expert_feed_forward_length": width, ".expert_shared_feed_forward_length": FF,
    }  # fmt: skip
    t: list[Any] = [("output_norm.weight", (E,), "norm"), ("output.weight", None, "out")]
    for i in range(LAYERS):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), *_attention(p, H, head)]
        t += [(p + f"attn_{x}.bias", (E,), "f32") for x in "qkv"]
        t += [(p + "ffn_norm.weight", (E,), "norm"), (p + "ffn_gate_inp.weight", (experts, E), "f32")]
        t += [(p + f"ffn_{x}_exps.weight", (experts, width, E), "w") for x in ("gate", "up")]
        t += [(p + "ffn_down_exps.weight", (experts, E, width), "w"), (p + "ffn_gate_inp_shexp.weight", (E,), "f32")]
        t += [(p + f"ffn_{x}_shexp.weight", (FF, E), "w") for x in ("gate", "up")]
        t += [(p + "ffn_down_shexp.weight", (E, FF), "w")]
    return keys, t


def _gpt2() -> tuple[dict[str, Any], list[Any]]:
    keys: dict[str, Any] = {".attention.head_count": H, ".attention.layer_norm_epsilon": 1e-5}
    t: list[Any] = [("position_embd.weight", (8192, E), "w")]
    t += [("output_norm.weight", (E,), "norm"), ("output_norm.bias", (E,), "norm")]
    for i in range(LAYERS):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (E,), "norm"), (p + "attn_norm.bias", (E,), "norm")]
        t += [(p + "attn_qkv.weight", (3 * E, E), "w"), (p + "attn_qkv.bias", (3 * E,), "f32")]
        t += [(p + "attn_output.weight", (E, E), "w"), (p + "attn_output.bias", (E,), "f32")]
        t += [(p + "ffn_norm.weight", (E,), "norm"), (p + "ffn_norm.bias", (E,), "norm")]
        t += [(p + "ffn_up.weight", (FF, E), "w"), (p + "ffn_up.bias", (FF,), "f32")]
        t += [(p + "ffn_down.weight", (E, FF), "w"), (p + "ffn_down.bias", (E,), "f32")]
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
    elif name == "openelm":
        keys, tensors = _openelm()
    elif name in ("granitehybrid", "lfm2"):
        keys, tensors = _hybrid(name)
    elif name == "gemma3":
        keys, tensors = _gemma3()
    elif name == "qwen2moe":
        keys, tensors = _qwen2moe()
    elif name == "gpt2":
        keys, tensors = _gpt2()
    elif name == "deci":
        keys, tensors = _deci()
    elif name == "llama4":
        keys, tensors = _llama4()
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
        if isinstance(value, list):  # per-layer values
            w.add_array(key, value)
        elif isinstance(value, bool):
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
