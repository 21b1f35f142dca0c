"""The memory model: what a model and a request occupy on a device, from GGUF metadata.

A request's footprint on a device (DESIGN.md, "Memory model and admission"):

- KV cache for ``prompt_tokens + max_tokens``, rounded up to whole pages of
  ``page_tokens`` tokens: ``layers x kv_heads x (head_k + head_v) x kv_type_bytes`` per token
  (sliding-window layers too: llama-cpp-python keeps a full-size SWA cache);
- its compute/scratch buffer for that context (``compute_bytes``, calibrated against
  llama.cpp's own reported buffer sizes; see benchmarks/estimate_accuracy.py);
- a fragmentation allowance (``fragmentation_ratio`` of the above).

A model's resident cost is its weights on the device: the ``blk.*`` tensors of the layers
placed there, plus the non-layer tensors (embeddings, output) when fully offloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Footprint", "MemoryModel", "ModelSpec", "ollama_estimate"]

MIB = 1024 * 1024


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
    repack_bytes: int = 0  # layer weights llama.cpp's CPU backend also keeps repacked

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
    compute_bytes: int
    fragmentation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.compute_bytes + self.fragmentation_bytes


def _pad(n: int, to: int) -> int:
    return math.ceil(n / to) * to


@dataclass(frozen=True)
class MemoryModel:
    """Predicts device bytes for a model (``spec``) under llama.cpp's allocation rules."""

    spec: ModelSpec
    page_tokens: int = 16
    fragmentation_ratio: float = 0.02
    kv_type_bytes: int = 2  # f16 cache
    n_ubatch: int = 512
    n_gpu_layers: int = -1  # -1: all layers on the device
    ctx_pad_tokens: int = 256  # llama.cpp pads the KV cache size
    cpu_repack: bool = False  # CPU backend: count the repacked copy of Q4_0/Q4_K/IQ4_NL weights

    # -- model ---------------------------------------------------------------------
    def layers_on_device(self) -> int:
        if self.n_gpu_layers < 0:
            return self.spec.n_layers
        return min(self.n_gpu_layers, self.spec.n_layers)

    def weights_bytes(self) -> int:
        """Weights resident on the device for this placement."""
        s = self.spec
        on = self.layers_on_device()
        layers = s.layer_bytes * on // max(1, s.n_layers)
        repack = s.repack_bytes * on // max(1, s.n_layers) if self.cpu_repack else 0
        return layers + repack + (s.other_bytes if on == s.n_layers else 0)

    # -- per context ---------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs across all layers on the device."""
        s = self.spec
        return self.layers_on_device() * s.n_head_kv * (s.head_dim_k + s.head_dim_v) * self.kv_type_bytes

    def kv_bytes(self, n_ctx: int) -> int:
        """KV cache bytes for a context of ``n_ctx`` tokens, as llama.cpp sizes it.

        The cache is padded to ``ctx_pad_tokens`` cells. Sliding-window layers (gemma3) get a
        full-size cache too: llama-cpp-python creates contexts with ``swa_full`` on, and
        llama.cpp then logs "using full-size SWA cache" (measured).
        """
        return self.kv_bytes_per_token() * _pad(n_ctx, self.ctx_pad_tokens)

    def compute_bytes(self, n_ctx: int) -> int:
        """Compute/scratch buffer plus the output (logits) buffer for one context.

        llama.cpp (flash attention off) sizes the compute buffer for the worst graph node
        of a full micro-batch ``ub``: either the logits (``ub x n_vocab`` f32 plus two
        ``ub x n_embd`` activations) or, at long contexts, the attention scores
        (``ub x n_kv x n_head`` f32, plus the ``ub x n_kv`` mask and about six
        ``ub x n_embd`` activations). The output buffer holds one logits row. Fit against
        llama.cpp's own reports by benchmarks/estimate_accuracy.py.
        """
        s = self.spec
        n_kv = _pad(n_ctx, self.ctx_pad_tokens)
        ub = min(self.n_ubatch, n_kv)
        logits_path = ub * (s.n_vocab + 2 * s.n_embd) * 4
        attn_path = ub * n_kv * (s.n_head + 1) * 4 + 6 * ub * s.n_embd * 4
        return max(logits_path, attn_path) + s.n_vocab * 4

    def context_bytes(self, n_ctx: int) -> int:
        """KV plus compute for a context, as llama.cpp allocates it."""
        return self.kv_bytes(n_ctx) + self.compute_bytes(n_ctx)

    # -- per request ---------------------------------------------------------------
    def request_footprint(self, prompt_tokens: int, max_tokens: int) -> Footprint:
        """Footprint of one request: KV pages for prompt+max_tokens, compute, fragmentation."""
        tokens = max(1, prompt_tokens + max_tokens)
        pages = math.ceil(tokens / self.page_tokens)
        kv_tokens = pages * self.page_tokens
        kv = kv_tokens * self.kv_bytes_per_token()
        compute = self.compute_bytes(kv_tokens)
        frag = int((kv + compute) * self.fragmentation_ratio)
        return Footprint(kv_tokens, pages, kv, compute, frag)


def ollama_estimate(spec: ModelSpec, n_ctx: int) -> int:
    """Ollama's published rule: model file size + f16 KV (2 x layers x kv_heads x head_dim x ctx x 2)."""
    head_dim = spec.head_dim_k
    return spec.file_bytes + 2 * spec.n_layers * spec.n_head_kv * head_dim * n_ctx * 2
