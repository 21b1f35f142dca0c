"""Read a GGUF file's metadata into a ``ModelSpec`` for the memory model."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from spillover.core.memory import ModelSpec
from spillover.engine.gguf_header import ARRAY_KEPT, Header, TensorInfo, read_header

__all__ = [
    "AVX512_REPACK_TYPES",
    "CPU_REPACK_TYPES",
    "NO_KV_ARCHES",
    "UnsupportedModel",
    "cpu_model_bytes",
    "header_by_reader",
    "read_model_spec",
    "spec_of",
]

# Weight types llama.cpp's CPU backend (x86-64 with AVX2, as here) repacks into interleaved
# rows, with the row count each needs to divide (ggml-cpu's ``ggml_repack_get_optimal_repack_type``,
# and measured on this build: Q4_0, Q4_K, IQ4_NL and MXFP4 matrices are repacked, in groups of 8
# rows; an IQ4_NL matrix of 2052 rows is not; Q8_0, Q5_0, Q5_1, Q6_K, Q4_1, BF16 and TQ2_0 are
# not). Q2_K is repacked too, in groups of 8, where the CPU has AVX-512 (``AVX512_REPACK_TYPES``:
# a Q2_K model's weights took 1.8x their file size here, which the estimate missed until
# 2026-12-04). ARM builds repack other types. Where models load without extra buffer types (a
# CPU with AMX: ``engine.llamacpp``), nothing is repacked.
CPU_REPACK_TYPES = {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8}
AVX512_REPACK_TYPES = {"Q2_K": 8}
Repacks = dict[str, int]  # type name -> interleave rows: CPU_REPACK_TYPES, or {} (no repacking)

# Bounds on a model's shape fields, far past any real model's (the widest have embeddings of
# about 2**14, 128 heads, heads of 576 values), so that a damaged field is refused, not estimated.
WIDTH_MAX = 2**20
HEADS_MAX = 2**14
HEAD_SIZE_MAX = 2**14

# Architectures llama.cpp makes no KV cache for (``llama_model::create_memory``: encoders and
# diffusion models attend over the batch only).
NO_KV_ARCHES = frozenset(
    {"bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "neo-bert", "modern-bert",
     "wavtokenizer-dec", "dream", "llada", "llada-moe", "rnd1"}
)  # fmt: skip


# llama.cpp's CPU backend maps a file's tensor data where it lies, and asserts the mapping's
# first tensor starts at a multiple of this (ggml's TENSOR_ALIGNMENT): a file written with a
# smaller ``general.alignment`` aborts the load (round 39: alignment 8 was estimated, exit 0).
MAPPED_ALIGNMENT = 32
# Architectures whose token embedding is not ``embedding_length`` wide (a codec's features).
OWN_EMBEDDING_WIDTH = frozenset({"wavtokenizer-dec"})


class UnsupportedModel(ValueError):
    """A readable GGUF file whose kind of model the memory model does not cover."""


def _repackable(t: Any, repacks: Repacks) -> bool:
    """A matrix of a type the CPU backend repacks, with rows in whole interleave groups: a 2-D
    weight, or a mixture of experts' 3-D stack of them (``ffn_*_exps``, measured)."""
    rows = repacks.get(t.tensor_type.name)
    return rows is not None and len(t.shape) in (2, 3) and int(t.shape[1]) % rows == 0


def _repacked(t: Any, repacks: Repacks) -> bool:
    """Whether the CPU backend moves this tensor to its repack buffer: a repackable matrix
    multiplied in the graph (``token_embd`` is read with get_rows, so it stays)."""
    return _repackable(t, repacks) and t.name != "token_embd.weight"


def _tied_output_copy(tensors: list[Any], repacks: Repacks) -> int:
    """Without ``output.weight`` the logits multiply by ``token_embd``: the CPU backend reads
    it in place as the input and holds a repacked copy of it as the output matrix, when it
    repacks its type."""
    return sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight" and _repackable(t, repacks))


def cpu_model_bytes(tensors: list[Any], repacks: Repacks) -> int:
    """The model buffers llama.cpp's CPU backend reports: the mapped file span from the first
    to the last tensor it reads in place (repacked tensors between them included, as the
    mapping is one range), plus the repack buffer. A model without ``output.weight`` multiplies
    by ``token_embd``, so a repackable embedding gets a repacked copy as the output matrix."""
    tied = not any(t.name == "output.weight" for t in tensors)
    mapped = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in tensors if not _repacked(t, repacks)]
    repack = sum(int(t.n_bytes) for t in tensors if _repacked(t, repacks))
    if tied:
        repack += _tied_output_copy(tensors, repacks)
    span = max(e for _, e in mapped) - min(b for b, _ in mapped) if mapped else 0
    return span + repack


def read_model_spec(path: str | Path, *, cpu_repack: bool | None = None) -> ModelSpec:
    """Parse layers, heads, head sizes, vocabulary and tensor bytes from a GGUF file.

    ``cpu_repack``: whether llama.cpp's CPU backend repacks weights (the repack fields and
    ``cpu_model_bytes``, by this machine's CPU's rules: ``engine.llamacpp.cpu_repack_rules``);
    None: as this machine's llama.cpp loads models (``engine.llamacpp.cpu_backend_repacks``).
    The header is read by ``engine.gguf_header``; a file it refuses is read by ``gguf``'s
    ``GGUFReader``, and a file both refuse (a damaged one) raises the first's error, which names
    the fault in the file's terms (the second's are about numpy arrays)."""
    from spillover.engine.llamacpp import cpu_backend_repacks, cpu_repack_rules

    if cpu_repack is None:
        cpu_repack = cpu_backend_repacks()
    try:
        header = read_header(path)
    except (ValueError, OSError, struct.error) as refused:
        try:
            header = header_by_reader(path)
        except Exception:
            raise refused from None
    return spec_of(header, path, cpu_repack_rules() if cpu_repack else {})


def header_by_reader(path: str | Path) -> Header:
    """``engine.gguf_header``'s ``Header``, read by ``GGUFReader`` (slow: every string of the
    vocabulary becomes an array view), which reads more kinds of file and raises its own
    errors for a damaged one."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path), "r")
    h = Header()
    for key, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            h.lengths[key] = len(f.data)
            if len(f.data) <= ARRAY_KEPT and f.types[-1] not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                h.fields[key] = f.contents()
        else:
            h.fields[key] = f.contents()
    h.tensors = [
        TensorInfo(t.name, tuple(int(d) for d in t.shape), t.tensor_type, int(t.n_bytes), int(t.data_offset))
        for t in reader.tensors
    ]
    return h


def spec_of(header: Header, path: str | Path, repacks: Repacks) -> ModelSpec:
    """The ``ModelSpec`` of a file's header (``repacks``: the CPU backend's rules, or none)."""
    fields = header.fields

    def _field(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    shards = fields.get("split.count", 1)
    if isinstance(shards, int) and shards > 1:  # a part of the tensors only (past the first, no metadata)
        raise UnsupportedModel(
            f"this is part {int(fields.get('split.no', 0)) + 1} of a GGUF split into {shards} files: "
            "merge them first (llama.cpp's llama-gguf-split --merge)"
        )
    arch = _field("general.architecture")
    if not isinstance(arch, str) or not arch:  # llama.cpp refuses such a file: "unknown model architecture: ''"
        raise ValueError("general.architecture is missing" if arch is None else f"general.architecture is {arch!r}")
    n_layers = _integer(fields, f"{arch}.block_count")
    if n_layers < 1:
        raise ValueError(f"{arch}.block_count is {n_layers}: a model has at least one layer")
    if n_layers > len(header.tensors):  # each layer holds tensors (checked before any list of that size)
        raise ValueError(f"{arch}.block_count is {n_layers}, but the file holds {len(header.tensors)} tensors")
    n_embd = _integer(fields, f"{arch}.embedding_length")
    # the widest layer's, for per-layer lists
    n_head_raw = _integer(fields, f"{arch}.attention.head_count", 0, layers=n_layers)
    n_head = _n_ff(n_head_raw)
    if n_head <= 0:
        raise UnsupportedModel(
            f"{arch} has no attention heads (a recurrent model): spillover's memory model covers attention models only"
        )
    # Without a KV count each layer's is its query count, as llama.cpp defaults it (round 84: the
    # widest layer's, taken for every layer, refused an openelm of [8, 6] heads and no KV key).
    n_head_kv_raw = _integer(fields, f"{arch}.attention.head_count_kv", n_head_raw, layers=n_layers)
    # per-layer counts (some architectures): each layer's KV is its own (0: none there)
    per_layer_kv = [int(x) for x in n_head_kv_raw] if isinstance(n_head_kv_raw, list) else []
    n_head_kv = max(per_layer_kv, default=0) if per_layer_kv else int(n_head_kv_raw)
    if per_layer_kv and not 0 <= min(per_layer_kv) <= n_head_kv <= HEADS_MAX:
        raise ValueError(f"{arch}.attention.head_count_kv holds {min(per_layer_kv)} to {n_head_kv}: 0 to {HEADS_MAX}")
    # Each layer's query heads share its KV heads in whole groups (llama.cpp aborts otherwise; two
    # scalar counts are checked by ``MemoryModel``): helper round 81, a KV list of [3, 3] under 4
    # heads, round 82 a query list of [8, 6] over 4 KV heads.
    if per_layer_kv or isinstance(n_head_raw, list):
        q_heads = [int(x) for x in n_head_raw] if isinstance(n_head_raw, list) else [n_head] * n_layers
        for i, (q, kv) in enumerate(zip(q_heads, per_layer_kv or [n_head_kv] * n_layers, strict=True)):
            if kv and q % kv:
                raise ValueError(
                    f"layer {i}'s {q} query heads cannot share its {kv} KV heads ({arch}.attention.head_count_kv):"
                    " llama.cpp needs the first to be a multiple of the second"
                )
    head_k = _integer(fields, f"{arch}.attention.key_length", n_embd // n_head)
    head_v = _integer(fields, f"{arch}.attention.value_length", n_embd // n_head)
    for key, value, top in (
        ("embedding_length", n_embd, WIDTH_MAX),
        ("attention.head_count", n_head, HEADS_MAX),
        ("attention.key_length", head_k, HEAD_SIZE_MAX),
        ("attention.value_length", head_v, HEAD_SIZE_MAX),
    ):
        if not 1 <= value <= top:  # a damaged field: the estimate would be negative or absurd
            given = "" if f"{arch}.{key}" in fields else " (not in the file: embedding_length / head_count)"
            raise ValueError(f"{arch}.{key} is {value}{given}: a model's is from 1 to {top}")
    # 0 when the file gives none: no usable training context (llama.cpp itself refuses such a file)
    n_ctx_train = _integer(fields, f"{arch}.context_length", 0)
    # A window, or llama4's chunks (8192 unless the file says; a window of 0 turns them off):
    # either way llama.cpp keeps a second mask.
    chunks = int(_field(f"{arch}.attention.chunk_size", 8192 if arch == "llama4" else 0) or 0)
    swa = int(_field(f"{arch}.attention.sliding_window", chunks) or 0)
    n_vocab = header.lengths.get("tokenizer.ggml.tokens", 0)
    tensors = header.tensors
    _check_tensors(tensors, arch, n_layers, n_embd, fields)
    layer_sizes = [0] * n_layers
    layer_repacks = [0] * n_layers
    other_bytes = 0
    has_output = any(t.name == "output.weight" for t in tensors)
    # the output matrix's repacked copy: output.weight's, or token_embd's when tied (cpu_model_bytes' rule)
    output_repack = 0 if has_output else _tied_output_copy(tensors, repacks)
    input_bytes = 0
    recurrent = [False] * n_layers  # a layer holding recurrent tensors (a hybrid's Mamba or convolution)
    attention = [False] * n_layers  # a layer holding the tensors of a layer that caches K
    for t in tensors:
        if t.name.startswith("blk."):
            layer = int(t.name.split(".")[1])
            layer_sizes[layer] += int(t.n_bytes)
            if _repacked(t, repacks):
                layer_repacks[layer] += int(t.n_bytes)
            recurrent[layer] = recurrent[layer] or any(k in t.name for k in RECURRENT_TENSORS)
            attention[layer] = attention[layer] or any(k in t.name for k in ATTENTION_TENSORS)
        else:
            other_bytes += int(t.n_bytes)
            if t.name == "token_embd.weight":
                input_bytes = int(t.n_bytes)
            if _repacked(t, repacks):  # output.weight (token_embd is never repacked in place)
                output_repack += int(t.n_bytes)
    output_layer_bytes = other_bytes - input_bytes + (0 if has_output else input_bytes)
    ff_widths = _integer(fields, f"{arch}.feed_forward_length", 0, layers=n_layers)  # one, or one a layer
    kv_heads = per_layer_kv or [n_head_kv] * n_layers
    layer_kv_heads, layer_states = _hybrid_layers(fields, arch, n_embd, kv_heads, recurrent, attention)
    file_type = int(_field("general.file_type", -1))
    return ModelSpec(
        name=str(_field("general.name", Path(path).stem)),
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
        layer_bytes=sum(layer_sizes),
        other_bytes=other_bytes,
        file_bytes=os.path.getsize(path),
        file_type=file_type,
        repack_bytes=sum(layer_repacks),
        n_ff=_n_ff(ff_widths),
        last_layer_ffn=_last_ffn(ff_widths),
        n_expert_used=int(_field(f"{arch}.expert_used_count", 0) or 0),
        n_ff_expert=int(_field(f"{arch}.expert_feed_forward_length", 0) or 0),
        n_ff_shared=_shared_ffn(fields, arch, tensors),
        qkv_bias_width=max((int(t.shape[0]) for t in tensors if t.name.endswith(".attn_qkv.bias")), default=0),
        ssm_row_floats=_ssm_row(fields, arch, n_embd),
        kept_row_floats=_kept_row(fields, arch, n_embd, n_layers),
        cpu_model_bytes=cpu_model_bytes(tensors, repacks),
        layer_sizes=tuple(layer_sizes),
        input_bytes=input_bytes,
        output_layer_bytes=output_layer_bytes,
        tied_output=not has_output,
        layer_repack_sizes=tuple(layer_repacks),
        output_repack_bytes=output_repack,
        kv_cache=arch not in NO_KV_ARCHES,
        # MLA (its decompressed head sizes given apart): llama.cpp caches the latent K rows only
        v_cache=not (_field(f"{arch}.attention.key_length_mla") and _field(f"{arch}.attention.value_length_mla")),
        layer_kv_heads=layer_kv_heads if per_layer_kv or any(layer_states) else (),
        layer_state_bytes=layer_states if any(layer_states) else (),
    )


def _check_tensors(tensors: list[TensorInfo], arch: str, n_layers: int, n_embd: int, fields: dict[str, Any]) -> None:
    """Refuse a tensor table that disagrees with the metadata where llama.cpp would refuse or
    abort the load (round 39: ``--no-plan``, which asks llama.cpp nothing, estimated such files):
    a layer with no tensors or tensors of a layer past ``block_count``, a token embedding of
    another width than ``embedding_length``, tensor data llama.cpp cannot map. What only the
    architecture's own tensor list tells (a tensor it does not take) is llama.cpp's plan's check."""
    held: set[int] = set()
    for t in tensors:
        if t.name.startswith("blk."):
            part = t.name.split(".")[1]
            if not part.isdigit():
                raise ValueError(f"tensor {t.name!r} names no layer")
            held.add(int(part))
    # Layers named otherwise (t5's enc.blk / dec.blk, a codec's convnext / posnet) are not checked.
    past = sorted(i for i in held if i >= n_layers)
    if past:
        raise ValueError(
            f"{arch}.block_count is {n_layers}, but the file holds tensors of layer {past[0]} (blk.{past[0]})"
        )
    missing = sorted(set(range(n_layers)) - held) if held else []
    if missing:
        raise ValueError(
            f"{arch}.block_count is {n_layers}, but the file holds no tensor of layer {missing[0]} (blk.{missing[0]})"
        )
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is not None and embd.shape and arch not in OWN_EMBEDDING_WIDTH and int(embd.shape[0]) != n_embd:
        raise ValueError(f"token_embd.weight is {embd.shape[0]} wide, but {arch}.embedding_length is {n_embd}")
    first = min(tensors, key=lambda t: t.data_offset, default=None)
    if first is not None and first.data_offset % MAPPED_ALIGNMENT:
        raise ValueError(
            f"tensor data starts at byte {first.data_offset} (general.alignment "
            f"{fields.get('general.alignment', 32)}), not a multiple of {MAPPED_ALIGNMENT}: llama.cpp's CPU "
            "backend maps it in place and aborts on this file"
        )


def _shared_ffn(fields: dict[str, Any], arch: str, tensors: list[Any]) -> int:
    """A mixture of experts' shared experts' feed-forward width, all of them together (0: none):
    their up projection's rows (llama4 gives no key for it), else their own width (qwen2moe),
    or as many experts' widths as it shares (deepseek2)."""
    rows = max((int(t.shape[1]) for t in tensors if t.name.endswith(".ffn_up_shexp.weight")), default=0)
    if rows:
        return rows
    count = _count(fields, f"{arch}.expert_shared_count")
    width = _n_ff(fields.get(f"{arch}.expert_shared_feed_forward_length", 0))
    if width:
        return width * max(1, count)
    return count * _count(fields, f"{arch}.expert_feed_forward_length")


RECURRENT_TENSORS = (".ssm_", ".shortconv.")  # a recurrent layer's tensors (Mamba/Mamba2, LFM2's short convolution)
ATTENTION_TENSORS = (".attn_k.", ".attn_qkv.", ".attn_k_b.", ".attn_kv_a_mqa.")  # a layer that caches K


def _hybrid_layers(
    fields: dict[str, Any], arch: str, n_embd: int, kv_heads: list[int], recurrent: list[bool], attention: list[bool]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's KV heads and recurrent state bytes. A layer holding recurrent tensors (a
    hybrid's Mamba or short-convolution layer) keeps llama.cpp's recurrent state for one sequence,
    f32: its conv state (``n_embd_r``) and SSM state (``n_embd_s``), as ``llama_hparams`` sizes
    them; in such a model only the layers with attention tensors have a KV cache."""
    if not any(recurrent):
        return tuple(kv_heads), (0,) * len(kv_heads)
    l_cache = _count(fields, f"{arch}.shortconv.l_cache")
    d_state, d_inner = _count(fields, f"{arch}.ssm.state_size"), _count(fields, f"{arch}.ssm.inner_size")
    groups = _count(fields, f"{arch}.ssm.group_count")
    kernel = _count(fields, f"{arch}.ssm.conv_kernel")
    conv = n_embd * (l_cache - 1) if l_cache else max(0, kernel - 1) * (d_inner + 2 * groups * d_state)
    state = 4 * (conv + d_state * d_inner)
    heads = tuple(h if attention[i] else 0 for i, h in enumerate(kv_heads))
    return heads, tuple(state if r else 0 for r in recurrent)


def _integer(fields: dict[str, Any], key: str, default: Any = None, *, layers: int = 0) -> Any:
    """A shape field as llama.cpp reads it: an unsigned integer (``layers``: or one for each of
    that many layers), or ``default`` when the file does not give it (None: a key the model
    needs). Another type (a negative number: a signed one), or a list of another length, is a
    damaged field that llama.cpp refuses too."""
    value = fields.get(key, default)
    if value is None:
        raise ValueError(f"{key} is missing")
    items = value if layers and isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            shown = f"a list of {len(item)}" if isinstance(item, list) else repr(item)[:40]
            raise ValueError(f"{key} is {shown}: llama.cpp reads an integer there")
        if item < 0:  # a signed field: llama.cpp refuses its type ("wrong type i32 but expected type u32")
            raise ValueError(f"{key} is {item}: llama.cpp reads an unsigned integer there")
    if layers and isinstance(value, list) and len(value) != layers:
        raise ValueError(f"{key} holds {len(value)} values for {layers} layers")
    return value


def _count(fields: dict[str, Any], key: str) -> int:
    """An integer field, 0 when the file does not give it."""
    return int(fields.get(key, 0) or 0)


def _ssm_row(fields: dict[str, Any], arch: str, n_embd: int) -> int:
    """A Mamba layer's f32 values for each micro-batch row (0: none): the input projection
    (z, x, B, C and dt), the conv input and output (x, B and C), the scan's output, its gate
    and their product (the inner width each), and the layer's output (the width)."""
    inner = _count(fields, f"{arch}.ssm.inner_size")
    if not inner:
        return 0
    bc = 2 * _count(fields, f"{arch}.ssm.group_count") * _count(fields, f"{arch}.ssm.state_size")
    heads = _count(fields, f"{arch}.ssm.time_step_rank")
    return (2 * inner + bc + heads) + 2 * (inner + bc) + 3 * inner + n_embd


def _kept_row(fields: dict[str, Any], arch: str, n_embd: int, n_layers: int) -> int:
    """f32 values each micro-batch row keeps through the whole graph (0: none): gemma3n's altup
    streams (``altup.num_inputs`` rows of the width: predictions, their corrections and the
    activated copy, three) and its per-layer inputs (twice each layer's width). Measured on a
    small gemma3n: 6.5-9.5 KiB a row beside the largest path, which this bounds (14 KiB)."""
    streams = _count(fields, f"{arch}.altup.num_inputs")
    per_layer = _count(fields, f"{arch}.embedding_length_per_layer_input")
    return 3 * streams * n_embd + 2 * n_layers * per_layer


def _last_ffn(widths: Any) -> bool:
    """Whether the last layer has a feed-forward (per-layer widths: the last is not 0)."""
    return not isinstance(widths, list) or not widths or int(widths[-1]) > 0


def _n_ff(value: Any) -> int:
    """A per-layer width (feed-forward, heads): the widest layer's, for per-layer lists."""
    if isinstance(value, list):
        return max((int(x) for x in value), default=0)
    return int(value or 0)
