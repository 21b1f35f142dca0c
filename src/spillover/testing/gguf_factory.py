"""Write small, loadable GGUF models with the ``gguf`` package (random weights).

Used to calibrate the memory model on architectures and KV layouts that no small shipped
model has: the tokenizer is copied from a real GGUF, the tensors are random, and llama.cpp
loads the result and reports its buffers like for any other model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TinyLlamaSpec", "add_donor_tokenizer", "donor_tokenizer", "write_tiny_llama"]

_FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q4_K": 15,
    "IQ4_NL": 25,
    "BF16": 32,
    "TQ2_0": 37,
    "MXFP4": 38,
}  # llama_ftype


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of a llama-architecture model to write."""

    n_layers: int = 6
    n_embd: int = 256
    n_head: int = 8
    n_head_kv: int = 2
    n_ff: int = 768
    n_ctx_train: int = 8192
    # Weight type of the matrices: F32, F16, BF16, a type gguf quantizes (Q8_0, Q4_0, ...), or
    # Q2_K, Q4_K or IQ4_NL, written as zero blocks (gguf cannot quantize them; a model's memory
    # does not depend on its values, and such a model generates nothing worth reading).
    wtype: str = "F16"
    head_dim: int = 0  # 0: n_embd // n_head (else key_length = value_length = head_dim)
    tied: bool = False  # no output.weight: llama.cpp reuses token_embd for the logits
    name: str = "tiny-llama-gqa4"
    n_expert: int = 0  # > 0: a mixture of experts (3-D expert matrices of n_ff, an f32 router)
    n_expert_used: int = 2
    n_vocab: int = 0  # > 0: only the donor's first n_vocab tokens (and the merges among them)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


@functools.cache
def donor_tokenizer(path: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...], str, str | None]:
    """The tokens, token types, merges, pre-tokenizer and chat template of ``path`` (read once
    a process: ``GGUFReader`` takes about 2 s over the default model's vocabulary)."""
    from gguf import GGUFReader

    src = GGUFReader(path, "r")
    tokens = tuple(
        bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace")
        for i in src.fields["tokenizer.ggml.tokens"].data
    )
    types = tuple(
        int(src.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in src.fields["tokenizer.ggml.token_type"].data
    )
    merges = tuple(
        bytes(src.fields["tokenizer.ggml.merges"].parts[i]).decode("utf-8", "replace")
        for i in src.fields["tokenizer.ggml.merges"].data
    )
    template = src.fields.get("tokenizer.chat_template")
    return (
        tokens,
        types,
        merges,
        str(src.fields["tokenizer.ggml.pre"].contents()),
        (None if template is None else str(template.contents())),
    )


def add_donor_tokenizer(w: Any, tokenizer_from: str, n_vocab: int = 0) -> None:
    """Write ``tokenizer_from``'s BPE tokenizer (``donor_tokenizer``) into the GGUFWriter ``w``;
    with ``n_vocab``, its first ``n_vocab`` tokens only."""
    tokens, types, merges, pre, _template = donor_tokenizer(tokenizer_from)
    if n_vocab:
        tokens, types = tokens[:n_vocab], types[:n_vocab]
        kept = set(tokens)
        merges = tuple(m for m in merges if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    w.add_token_merges(list(merges))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_tiny_llama(
    out: str | Path, tokenizer_from: str, spec: TinyLlamaSpec = TinyLlamaSpec(), *, chat_template: bool = True
) -> Path:
    """Write a llama GGUF of ``spec``'s shape with the tokenizer (and, unless told not to,
    the chat template) of ``tokenizer_from``."""
    import numpy as np
    from gguf import GGUFWriter

    tokens, _types, _merges, _pre, template = donor_tokenizer(str(tokenizer_from))
    if not chat_template:
        template = None
    n_vocab = min(spec.n_vocab, len(tokens)) if spec.n_vocab else len(tokens)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), "llama")
    w.add_name(spec.name)
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    hd = spec.head_size
    if spec.head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(_FILE_TYPES[spec.wtype])
    add_donor_tokenizer(w, str(tokenizer_from), n_vocab)
    if template is not None:
        w.add_chat_template(template)
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int, norm: bool = False, f32: bool = False) -> None:
        if norm:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if f32 or spec.wtype == "F32":
            w.add_tensor(name, data)
            return
        if spec.wtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
            return
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        qtype = GGMLQuantizationType[spec.wtype]
        try:
            raw = quants.quantize(data, qtype)
        except NotImplementedError:
            block, size = GGML_QUANT_SIZES[qtype]
            raw = np.zeros((*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)

    t("token_embd.weight", n_vocab, spec.n_embd)
    t("output_norm.weight", spec.n_embd, norm=True)
    if not spec.tied:
        t("output.weight", n_vocab, spec.n_embd)
    for i in range(spec.n_layers):
        t(f"blk.{i}.attn_norm.weight", spec.n_embd, norm=True)
        t(f"blk.{i}.attn_q.weight", spec.n_head * hd, spec.n_embd)
        t(f"blk.{i}.attn_k.weight", spec.n_head_kv * hd, spec.n_embd)
        t(f"blk.{i}.attn_v.weight", spec.n_head_kv * hd, spec.n_embd)
        t(f"blk.{i}.attn_output.weight", spec.n_embd, spec.n_head * hd)
        t(f"blk.{i}.ffn_norm.weight", spec.n_embd, norm=True)
        if spec.n_expert:
            t(f"blk.{i}.ffn_gate_inp.weight", spec.n_expert, spec.n_embd, f32=True)
            t(f"blk.{i}.ffn_gate_exps.weight", spec.n_expert, spec.n_ff, spec.n_embd)
            t(f"blk.{i}.ffn_up_exps.weight", spec.n_expert, spec.n_ff, spec.n_embd)
            t(f"blk.{i}.ffn_down_exps.weight", spec.n_expert, spec.n_embd, spec.n_ff)
            continue
        t(f"blk.{i}.ffn_gate.weight", spec.n_ff, spec.n_embd)
        t(f"blk.{i}.ffn_up.weight", spec.n_ff, spec.n_embd)
        t(f"blk.{i}.ffn_down.weight", spec.n_embd, spec.n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
