"""The memory model: what a model and a request occupy on a device, from GGUF metadata.

A request's footprint on a device (DESIGN.md, "Memory model and admission"):

- KV cache for ``prompt_tokens + max_tokens``, rounded up to whole pages of
  ``page_tokens`` tokens: ``layers x kv_heads x (head_k + head_v)`` elements per token in the
  cache's type (f16, or a quantized type such as q8_0 / q4_0 in blocks of 32; sliding-window
  layers too: llama-cpp-python keeps a full-size SWA cache), layer by layer where the file
  gives per-layer head counts; a hybrid's recurrent layers hold llama.cpp's recurrent state
  (one sequence's, whatever the context) instead;
- its compute/scratch buffer for that context (``compute_bytes``) and the output (logits)
  buffer;
- a fragmentation allowance (``fragmentation_ratio`` of the above).

The inputs are llama.cpp's: the context (padded to ``ctx_pad_tokens`` cells), ``n_batch``
(clamped to the context) and ``n_ubatch`` (clamped to ``n_batch``), the KV cache type, flash
attention, and the number of layers on the device. Weights, KV and output are exact byte
counts. The compute buffer is an *envelope*: llama.cpp sizes it by reserving the worst graph
with ggml's allocator, whose fragmentation varies with every tensor's size, so arithmetic
bounds it from above (never under on the measured grid of benchmarks/estimate_accuracy.py)
and ``engine.plan`` asks llama.cpp for the exact figure where a GGUF file is at hand.

A model's resident cost is its weights on the device: the ``blk.*`` tensors of the layers
placed there, plus the non-layer tensors (embeddings, output) when fully offloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "KV_TYPES",
    "Footprint",
    "MemoryModel",
    "ModelSpec",
    "kv_quantized",
    "kv_row_bytes",
    "layer_shares",
    "ollama_estimate",
]

MIB = 1024 * 1024
# KV cache types llama.cpp takes for --cache-type-k/v: (bytes per block, elements per block).
KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q5_1": (24, 32),
    "q5_0": (22, 32),
    "q4_1": (20, 32),
    "q4_0": (18, 32),
    "iq4_nl": (18, 32),
}
# The compute envelope (see compute_bytes). Rows of n_embd f32 activations live beside the
# biggest tensor of each path; on the measured grid the allocator's layout left 2 to 6 of
# them beside the logits and 5 to 7 beside the attention scores (up to 8 without grouped
# query attention: mpt and deci's layers of as many KV heads as query heads, measured).
LOGITS_ROWS = 6.0
SHARED_LOGITS_ROWS = 7.0  # beside the logits of a mixture of experts with a shared expert
HYBRID_LOGITS_ROWS = 9.0  # beside the logits of a hybrid with recurrent (Mamba2) layers
ATTENTION_ROWS = 8.5
FFN_ROWS = 6.0
MOE_ATTENTION_ROWS = 3.5  # more rows beside the attention scores in a mixture of experts
FFN_KEPT_ROWS = 5.5  # rows beside the mask on the feed-forward path (where it is kept there)
GRAPH_SLACK_BYTES = 16 * 1024  # beside every path: inputs and alignment that do not grow with it
QUERY_ROWS = 5.0  # rows beside a query of another width than a row (and the mask), below the logits
KQ_MASK_PAD = 64  # llama.cpp pads the KQ mask's token dimension to this


def _rotation(head_size: int) -> int:
    """The largest power of two from 64 that divides ``head_size`` (a multiple of 64)."""
    n = 64
    while head_size % (2 * n) == 0:
        n *= 2
    return n


def kv_quantized(kv_type: str) -> bool:
    """A block-quantized cache type: llama.cpp takes one for the V cache only with flash attention."""
    return KV_TYPES[kv_type][1] > 1


def kv_row_bytes(kv_type: str, elements: int) -> int:
    """Bytes of ``elements`` cache values of ``kv_type`` (a quantized type stores whole blocks)."""
    try:
        size, block = KV_TYPES[kv_type]
    except KeyError:
        raise ValueError(f"unknown KV cache type {kv_type!r}: one of {', '.join(KV_TYPES)}") from None
    if elements % block:
        raise ValueError(
            f"a {kv_type} KV cache needs head rows that are whole blocks of {block} values; "
            f"this model's heads hold {elements}"
        )
    return elements // block * size


@dataclass(frozen=True)
class ModelSpec:
    """What the memory model needs from a GGUF file."""

    name: str
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    layer_bytes: int
    other_bytes: int
    file_bytes: int
    sliding_window: int = 0
    file_type: int = -1
    repack_bytes: int = 0  # layer weights llama.cpp's CPU backend moves to its repack buffer
    n_ff: int = 0  # feed-forward width (0: unknown)
    cpu_model_bytes: int = 0  # the model buffers the CPU backend reports (0: unknown)
    layer_sizes: tuple[int, ...] = ()  # bytes of each layer's tensors (empty: equal shares)
    input_bytes: int = 0  # token_embd: llama.cpp keeps the input layer on the host
    output_layer_bytes: int = 0  # output matrix (a copy of token_embd when tied) and norm
    tied_output: bool = False  # no output.weight: the logits multiply by token_embd
    layer_repack_sizes: tuple[int, ...] = ()  # bytes of each layer's tensors the CPU backend repacks
    output_repack_bytes: int = 0  # the output matrix's repacked copy when the CPU backend runs it
    n_expert_used: int = 0  # a mixture of experts: experts each token runs (0: a dense feed-forward)
    n_ff_expert: int = 0  # an expert's feed-forward width (0: n_ff)
    n_ff_shared: int = 0  # a mixture of experts' shared experts, their feed-forward width together (0: none)
    qkv_bias_width: int = 0  # a fused Q/K/V projection with a bias (gpt2, phi2): its width (0: none)
    ssm_row_floats: int = 0  # a Mamba layer's f32 values for each micro-batch row in its scan (0: none)
    kept_row_floats: int = 0  # f32 values a row keeps through the whole graph (gemma3n's altup and per-layer inputs)
    last_layer_ffn: bool = True  # False: the last layer has no feed-forward (deci's per-layer widths end in 0)
    kv_cache: bool = True  # False: an encoder (bert and kin), for which llama.cpp makes no KV cache
    v_cache: bool = True  # False: multi-head latent attention (DeepSeek's MLA): V is read from the K cache
    # Per layer (empty: every layer alike): KV heads, where a file gives them layer by layer (0: a
    # layer without a KV cache, as a hybrid's recurrent layers); and a recurrent layer's state
    # (llama.cpp's RS buffer: conv and SSM states of one sequence, f32), which no context size changes.
    layer_kv_heads: tuple[int, ...] = ()
    layer_state_bytes: tuple[int, ...] = ()

    @property
    def weights_bytes(self) -> int:
        """All tensor bytes."""
        return self.layer_bytes + self.other_bytes


@dataclass(frozen=True)
class Footprint:
    """A request's predicted device bytes, by part."""

    kv_tokens: int
    pages: int
    kv_bytes: int
    compute_bytes: int  # compute and output buffers
    fragmentation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.compute_bytes + self.fragmentation_bytes


def layer_shares(sizes: tuple[int, ...], total: int, n_layers: int) -> list[int]:
    """Each layer's bytes: the recorded sizes, or equal shares of ``total`` when there are none."""
    if sizes:
        return list(sizes)
    n = max(1, n_layers)
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _pad(n: int, to: int) -> int:
    return math.ceil(n / to) * to


FOOTPRINTS_KEPT = 4096  # request footprints a model remembers (then it starts again)


@dataclass(frozen=True)
class MemoryModel:
    """Predicts device bytes for a model (``spec``) under llama.cpp's allocation rules."""

    spec: ModelSpec
    page_tokens: int = 16
    fragmentation_ratio: float = 0.02
    kv_type: str = "f16"
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = False
    n_gpu_layers: int = -1  # -1: all layers on the device
    ctx_pad_tokens: int = 256  # llama.cpp pads the KV cache size
    cpu_repack: bool = False  # CPU backend: weights as its model buffers hold them (repack rules)
    # request_footprint's answers: admission asks again for every queued job on every pass.
    _footprints: dict[tuple[int, int], Footprint] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        s = self.spec
        if not s.layer_kv_heads and (s.n_head_kv < 1 or s.n_head % s.n_head_kv):
            raise ValueError(
                f"{s.n_head} query heads cannot share {s.n_head_kv} KV heads: llama.cpp needs the first "
                "to be a multiple of the second"
            )
        kv_row_bytes(self.kv_type, s.head_dim_k)  # raises on an impossible cache: llama.cpp
        kv_row_bytes(self.kv_type, s.head_dim_v)  # quantizes each head's row in whole blocks
        if kv_quantized(self.kv_type) and not self.flash_attn:
            raise ValueError(f"llama.cpp needs flash attention for a quantized ({self.kv_type}) V cache")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise ValueError("n_batch and n_ubatch must be at least 1")

    # -- model ---------------------------------------------------------------------
    def layers_on_device(self) -> int:
        if self.n_gpu_layers < 0:
            return self.spec.n_layers
        return min(self.n_gpu_layers, self.spec.n_layers)

    def output_on_device(self) -> bool:
        """Whether the output layer is on the device: llama.cpp offloads it only past the
        repeating layers (``n_gpu_layers`` above ``n_layers``, or -1: all), so a split of every
        repeating layer (``n_gpu_layers = n_layers``) keeps it on the CPU."""
        return self.n_gpu_layers < 0 or self.n_gpu_layers > self.spec.n_layers

    def weights_bytes(self) -> int:
        """Weights resident on the device for this placement."""
        s = self.spec
        n, on = s.n_layers, self.layers_on_device()
        if self.cpu_repack and self.output_on_device() and s.cpu_model_bytes:
            return s.cpu_model_bytes
        # the last ``on`` layers, as llama.cpp places them (their own sizes: a quantization mix
        # makes some layers larger than others)
        layers = sum(layer_shares(s.layer_sizes, s.layer_bytes, n)[n - on :])
        repack = sum(layer_shares(s.layer_repack_sizes, s.repack_bytes, n)[n - on :]) if self.cpu_repack else 0
        if not self.output_on_device():
            return layers + repack
        return layers + repack + s.other_bytes + (s.output_repack_bytes if self.cpu_repack else 0)

    # -- per context ---------------------------------------------------------------
    def _layer_kv_rows(self) -> list[int]:
        """KV bytes one token costs in each layer (none for an encoder, or a hybrid's recurrent
        layer, which llama.cpp leaves out of the cache). Without flash attention llama.cpp
        stores V transposed, every cached layer's as wide as the widest layer's
        (``n_embd_v_gqa_max``), a layer without heads too (deci's layers without attention)."""
        s = self.spec
        heads = s.layer_kv_heads or (s.n_head_kv,) * s.n_layers
        if not s.kv_cache:
            return [0] * len(heads)
        widest = max(heads, default=0)
        return [
            kv_row_bytes(self.kv_type, h * s.head_dim_k)
            + (kv_row_bytes(self.kv_type, (h if self.flash_attn else widest) * s.head_dim_v) if s.v_cache else 0)
            if h or not state
            else 0
            for h, state in zip(heads, self._layer_states(), strict=True)
        ]

    def _layer_states(self) -> list[int]:
        return list(self.spec.layer_state_bytes) or [0] * self.spec.n_layers

    def _on_device(self, per_layer: list[int]) -> int:
        """The sum over the layers on the device: the last ``layers_on_device``, as llama.cpp places them."""
        return sum(per_layer[len(per_layer) - self.layers_on_device() :])

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs across all layers on the device."""
        return self._on_device(self._layer_kv_rows())

    def state_bytes(self) -> int:
        """Recurrent state of the layers on the device (one sequence's; any context)."""
        return self._on_device(self._layer_states())

    def layer_kv_bytes(self, n_ctx: int) -> list[int]:
        """Each layer's KV cache and recurrent state for a context of ``n_ctx`` tokens."""
        cells = _pad(n_ctx, self.ctx_pad_tokens)
        return [row * cells + state for row, state in zip(self._layer_kv_rows(), self._layer_states(), strict=True)]

    def cells(self, n_ctx: int) -> int:
        """KV cells llama.cpp creates for a context of ``n_ctx`` tokens."""
        return _pad(max(1, n_ctx), self.ctx_pad_tokens)

    def ubatch(self, n_ctx: int) -> int:
        """The micro-batch llama.cpp reserves its graph for: ``n_batch`` clamped to the context
        (as llama-cpp-python does), ``n_ubatch`` clamped to that."""
        return max(1, min(self.n_ubatch, self.n_batch, n_ctx))

    def kv_bytes(self, n_ctx: int) -> int:
        """KV cache bytes for a context of ``n_ctx`` tokens, as llama.cpp sizes it.

        The cache is padded to ``ctx_pad_tokens`` cells. Sliding-window layers (gemma3) get a
        full-size cache too: llama-cpp-python creates contexts with ``swa_full`` on, and
        llama.cpp then logs "using full-size SWA cache" (measured). A hybrid's recurrent layers
        hold their state instead (``state_bytes``), counted here too.
        """
        return self.kv_bytes_per_token() * _pad(n_ctx, self.ctx_pad_tokens) + self.state_bytes()

    def compute_bytes(self, n_ctx: int) -> int:
        """An upper envelope of llama.cpp's compute buffer for a context of ``n_ctx`` tokens.

        llama.cpp reserves the graph of a full micro-batch ``ub`` (``ubatch``) with every
        row's logits, and the buffer is the allocator's high-water mark. It is the largest of:

        - the logits, ``ub x n_vocab`` f32, beside ``LOGITS_ROWS`` activation rows
          (``SHARED_LOGITS_ROWS`` with a shared expert, ``HYBRID_LOGITS_ROWS`` in a hybrid), or
          beside the mask, a query of another width than a row and ``QUERY_ROWS`` rows (one
          fewer for a wider query; without flash attention only a narrower one);
        - without flash attention, the attention scores ``ub x n_kv x n_head`` f32 beside
          ``ATTENTION_ROWS`` rows of the wider of ``n_embd`` and the query
          (``n_head x head_k``); with flash attention no scores are kept, but an f32 cache's
          K and V views are cast to f16 (``n_kv`` cells of every KV head, both at once);
        - the feed-forward, three ``ub x n_ff`` f32 tensors (gate, up, activated) beside
          ``FFN_ROWS`` rows, or beside the mask where it is still there (flash attention, or
          any layer but the last) and ``FFN_KEPT_ROWS`` rows, and a query wider than a row (a
          mixture of experts: three ``ub x n_expert_used x n_ff_expert`` ones and the experts'
          ``ub x n_expert_used x n_embd`` outputs);

        The attention path holds the KQ mask (``n_kv`` x ``ub`` padded to 64; f32, or f16 with
        flash attention); with flash attention the mask stays allocated beside the other two
        (beside 3 rows on the logits path, ``FFN_KEPT_ROWS`` on the feed-forward one). Every
        path has ``GRAPH_SLACK_BYTES`` on top, and a quantized cache of heads in whole blocks
        of 64 its two rotation matrices.

        The row counts are the largest the allocator left on the measured grid, so this never
        under-estimates there; how far over depends on the layout (``engine.plan`` gives
        llama.cpp's exact figure).
        """
        return math.ceil(max(self.compute_paths(n_ctx)))

    def compute_paths(self, n_ctx: int) -> tuple[float, float, float]:
        """The logits, attention and feed-forward envelopes of ``compute_bytes``."""
        s = self.spec
        n_kv = self.cells(n_ctx)
        ub = self.ubatch(n_ctx)
        embd = ub * s.n_embd * 4
        # A model with sliding-window layers has two masks, the window's and the full one's,
        # alive together (measured on gemma2 and gemma3: a second mask's bytes at 32k cells).
        masks = 2 if s.sliding_window else 1
        mask = masks * n_kv * _pad(ub, KQ_MASK_PAD) * (2 if self.flash_attn else 4)
        # With flash attention the f16 mask stays allocated to the end (measured); without it
        # the f32 mask is freed after the last layer, so it is beside every layer's
        # feed-forward but the last one's (measured: a one-layer model does without it).
        # Below the logits: the rows, or the kept mask beside the three rows always there,
        # or (flash attention) a query wider than a row beside ``QUERY_ROWS`` rows, or (below)
        # the mask and a query of another width than a row together.
        kept = mask if self.flash_attn else 0
        query = ub * s.n_head * s.head_dim_k * 4
        wide_query = query + QUERY_ROWS * embd if self.flash_attn else 0
        # The f32 mask is beside the logits and their rows too when no feed-forward follows the
        # last layer's attention (measured on deci: a mask's bytes more, the logits taking fresh room).
        unfreed = mask + (LOGITS_ROWS + 1) * embd if not s.last_layer_ffn else 0  # a row to spare
        # A query or attention output of another width than a row (n_head x head size !=
        # n_embd) leaves blocks of two sizes that the allocator cannot reuse for each other: with
        # flash attention the logits then sit beside the kept mask, the query and
        # ``QUERY_ROWS`` rows, one fewer for a query wider than a row (round 72: measured up to
        # exactly that on 2,100 cells, up to 5.6 % more than the other bounds where the mask is
        # about a row wide; a query as wide as a row is reused and takes nothing more).
        # Without flash attention the same holds for a query narrower than a row, beside the f32
        # mask (round 74: 2.9 % under on a llama of 4 heads of 256 on 1056, +8.1 % over now; a
        # wider query's blocks take the rows' place). The f32 mask is not always all there (3
        # layers: about a query and 6 rows measured), but it is on others (2 layers: the mask,
        # the query and 4.1 rows at masks of 5 and 8 rows; a 1-layer model was 1.4 % under
        # without it), so the bound keeps it.
        widths = {s.n_head * s.head_dim_k, s.n_head * s.head_dim_v}
        if self.flash_attn and widths != {s.n_embd}:
            both = mask + query + (QUERY_ROWS - (query > embd)) * embd
        elif not self.flash_attn and min(widths) < s.n_embd:
            both = mask + query + QUERY_ROWS * embd
        else:
            both = 0
        # More rows beside the logits where more kinds of blocks come before them (round 74): a
        # shared expert's (qwen2moe: 6.85 rows measured), a hybrid's Mamba2 layers' (granite-hybrid:
        # 8.8 rows, without flash attention; 7.4 with it).
        rows_beside = HYBRID_LOGITS_ROWS if s.ssm_row_floats else SHARED_LOGITS_ROWS if s.n_ff_shared else LOGITS_ROWS
        logits_path = ub * s.n_vocab * 4 + max(rows_beside * embd, kept + 3 * embd, wide_query, unfreed, both)
        # A mixture of experts keeps more rows beside the scores (measured: 2.6 KiB a micro-batch
        # row more on a qwen2moe of width 256 with a shared expert).
        rows = (
            (ATTENTION_ROWS + (MOE_ATTENTION_ROWS if s.n_expert_used else 0))
            * ub
            * max(s.n_embd, s.n_head * s.head_dim_k)
            * 4
        )
        scores = 0 if self.flash_attn else ub * n_kv * s.n_head * 4
        # Flash attention reads an f32 cache as f16: each layer's K and V views are cast
        # (n_kv cells of every KV head), both alive at once (measured; 13 % of the total for
        # a small micro-batch on a narrow model, where nothing else is as large).
        cast = (
            2 * n_kv * s.n_head_kv * (s.head_dim_k + s.head_dim_v) if self.flash_attn and self.kv_type == "f32" else 0
        )
        # Multi-head latent attention (no V cache) without flash attention reads V from the K
        # cache, where it is not stored transposed as a V cache is: each layer makes a transposed
        # copy, ``n_kv`` cells of ``head_dim_v`` values in the cache's type, beside the scores
        # (measured on a deepseek2 MLA: up to 244 bytes a cell more with an f32 cache, 116 with
        # f16; round 15, where the envelope was 9 % under at 64k cells).
        mla_v = (
            n_kv * s.n_head_kv * kv_row_bytes(self.kv_type, s.head_dim_v) if not (self.flash_attn or s.v_cache) else 0
        )
        # A fused Q/K/V projection with a bias adds its biased copy beside them (measured on
        # gpt2 and phi2: up to 1.5 KiB a micro-batch row more; the copy's row is 3 KiB there).
        attn_path = scores + mask + rows + cast + mla_v + ub * s.qkv_bias_width * 4
        # A hybrid's Mamba layer instead: its projections, conv input and output, the scan's
        # output, gate and product and the layer's output for every row (``ssm_row_floats``),
        # beside the state the scan writes back and the mask (measured: 32.6 KiB a row and
        # 0.52 MiB on a granite-hybrid of width 512, inner 1024, state 128).
        if s.ssm_row_floats:
            attn_path = max(attn_path, ub * s.ssm_row_floats * 4 + max(s.layer_state_bytes, default=0) + mask)
        # A mixture of experts runs each token through n_expert_used experts: their gate, up
        # and activated rows are alive at once (3 x ub x used x width f32, measured), and
        # then each expert's output row before they are weighted and summed. A dense layer
        # holds its gate, up and activated rows too (3 x ub x n_ff).
        used = s.n_expert_used
        # A shared expert (qwen2moe) runs beside them: its three rows too (measured).
        ffn = used * (3 * (s.n_ff_expert or s.n_ff) + s.n_embd) + 3 * s.n_ff_shared if used else 3 * s.n_ff
        ffn_mask = mask if self.flash_attn or s.n_layers > 1 else 0
        # A query wider than a row is still held there too (measured: a model of 4 heads of 64 on
        # an embedding of 64).
        wider = max(0, query - embd)
        ffn_path = ub * ffn * 4 + max(FFN_ROWS * embd, ffn_mask + FFN_KEPT_ROWS * embd if ffn_mask else 0) + wider
        # A quantized cache whose heads are whole blocks of 64 values is rotated (llama.cpp's
        # attn_rot_k): two f32 matrices, graph inputs alive throughout, of the largest power
        # of two from 64 that divides the head size, and of 64.
        rot = 4 * (_rotation(s.head_dim_k) ** 2 + 64**2) if kv_quantized(self.kv_type) and s.head_dim_k % 64 == 0 else 0
        # Small graph inputs (positions, output ids) and each tensor's alignment: bytes that
        # do not grow with the micro-batch, all that matters in a buffer of a few hundred KiB.
        fixed = rot + GRAPH_SLACK_BYTES
        # What every row keeps from the first layer to the logits (gemma3n: the altup
        # predictions and their corrected copies, and the per-layer inputs) is beside every path.
        fixed += ub * s.kept_row_floats * 4
        return logits_path + fixed, attn_path + fixed, ffn_path + fixed

    def output_bytes(self) -> int:
        """The output buffer: one sequence's logits row, f32."""
        return self.spec.n_vocab * 4

    def device_compute_bytes(self, n_ctx: int) -> int:
        """The compute buffer on the device for this placement (``core.estimate``'s ``gpu``
        rules): the whole graph's when the output layer is there; for a split, whose device
        runs only repeating layers while the logits go with the output layer to the host, the
        larger of the attention and feed-forward paths; nothing without layers there."""
        if self.output_on_device():
            return self.compute_bytes(n_ctx)
        return self.layers_compute_bytes(n_ctx) if self.layers_on_device() else 0

    def layers_compute_bytes(self, n_ctx: int) -> int:
        """The compute buffer of a side that runs repeating layers but not the output layer:
        the larger of the attention and feed-forward paths (the logits are the other side's)."""
        _, attention, ffn = self.compute_paths(n_ctx)
        return math.ceil(max(attention, ffn))

    def device_output_bytes(self) -> int:
        """The output buffer on the device: only with the output layer."""
        return self.output_bytes() if self.output_on_device() else 0

    def context_bytes(self, n_ctx: int) -> int:
        """KV, compute and output buffers for a context, as llama.cpp allocates them."""
        return self.kv_bytes(n_ctx) + self.compute_bytes(n_ctx) + self.output_bytes()

    # -- per request ---------------------------------------------------------------
    def request_footprint(self, prompt_tokens: int, max_tokens: int) -> Footprint:
        """Footprint of one request: KV pages for prompt+max_tokens, compute, fragmentation
        (remembered: the model is frozen, so the same two numbers give the same answer)."""
        key = (prompt_tokens, max_tokens)
        if (got := self._footprints.get(key)) is not None:
            return got
        if len(self._footprints) >= FOOTPRINTS_KEPT:
            self._footprints.clear()
        fp = self._footprint(prompt_tokens, max_tokens)
        self._footprints[key] = fp
        return fp

    def _footprint(self, prompt_tokens: int, max_tokens: int) -> Footprint:
        tokens = max(1, prompt_tokens + max_tokens)
        pages = math.ceil(tokens / self.page_tokens)
        kv_tokens = pages * self.page_tokens
        kv = kv_tokens * self.kv_bytes_per_token() + self.state_bytes()
        # The graph is reserved for a full micro-batch of the padded cells, not of the tokens;
        # of it, and of the output buffer, what this placement puts on the device.
        compute = self.device_compute_bytes(self.cells(kv_tokens)) + self.device_output_bytes()
        frag = int((kv + compute) * self.fragmentation_ratio)
        return Footprint(kv_tokens, pages, kv, compute, frag)


def ollama_estimate(spec: ModelSpec, n_ctx: int) -> int:
    """Ollama's published rule: model file size + f16 KV (2 x layers x kv_heads x head_dim x ctx x 2)."""
    head_dim = spec.head_dim_k
    return spec.file_bytes + 2 * spec.n_layers * spec.n_head_kv * head_dim * n_ctx * 2
