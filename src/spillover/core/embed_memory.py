"""The embedding memory model: what an encoder session and an embeddings request occupy.

An encoder (``EmbedModelInfo``: ``dim`` d, ``n_layers``, ``n_heads`` H, ``intermediate`` I,
``file_bytes``) is run by ONNX Runtime one chunk at a time (``engine.embedder``, rule 2).
Layers run one after another, so a chunk's peak is one layer's largest live set, whatever
the depth. For a chunk of ``b`` inputs padded to ``s`` tokens, in float32 (4 bytes):

- ``h = b·s·d·4`` (a hidden-state tensor), ``F = b·s·I·4`` (a feed-forward tensor),
  ``S = b·H·s²·4`` (the attention scores of one layer);
- attention path: ``2·S + 5.5·h``: the scores twice (the masked scores and the softmax
  output are live together) beside hidden-size tensors and the slack of ONNX Runtime's
  memory-pattern block (fit: 5.30 h, taken as 5.5);
- feed-forward path: ``2·F + 2·h``: GELU's input and output, live together, beside two
  hidden-size tensors (fit: 2.00 h). While ``s <= 1.25 x head_dim`` (40 tokens for
  bge-small-en) the scores are tiny and ONNX Runtime's memory-pattern planner lays the
  feed-forward step out with up to three more hidden blocks: ``2·F + 5·h`` (measured
  5.00 h at ``s <= 24``, mixed from 26 to 40). Past that length the path is held at its
  level at ``s = 1.25 x head_dim`` until ``2·F + 2·h`` overtakes it (``s`` = 52), so the
  prediction never falls as ``s`` grows;
- ``activation_bytes = max(attention, feed-forward) + 3 MiB``: the constant covers the
  small allocations and the code pages a run first touches (up to 1.7 MiB measured on
  one-input chunks).

A request's bytes are the largest of its chunks' (chunks run one after another, their
activations are given back in between) plus ``fragmentation_ratio`` of that.

A loaded session costs ``file_bytes + 15 MiB``: the weights as stored (int8 matrices and
embeddings, no fp32 copies) plus onnxruntime's session structures and the code pages its
kernels touch (measured 14.4 MiB: 7.1 MiB anonymous above the file, 7.3 MiB file-backed).
The load itself peaks ~10 MiB above that for well under a second.

The coefficients were fit by ``benchmarks/embed_estimate.py`` (peak RSS of a fresh
process per cell, the allocator pinned so RSS follows live tensor bytes; the table is in
``tests/core/data/embed_memory_table.json``). They are ONNX Runtime's (CPU, memory
pattern on, no arena); a different runtime or encoder family needs a new measurement.
With glibc's default (dynamic) mmap threshold a worker's RSS reads far above these figures
(first run of a shape up to 5.5x, e.g. 64x64: 332 MiB against 60 MiB live, kept in the
heap afterwards; a load 72 MiB): run the worker with ``MALLOC_MMAP_THRESHOLD_=131072`` for
RSS to follow the model, or leave that to the host guard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spillover.engine.embedder import EmbedModelInfo

__all__ = ["EmbedMemoryModel"]

MIB = 1024 * 1024
F32_BYTES = 4
ATTN_HIDDEN_BLOCKS = 5.5  # hidden-size tensors live beside the two score tensors (measured 5.30)
FFN_HIDDEN_BLOCKS = 2  # hidden-size tensors live beside the two feed-forward tensors (measured 2.00)
SHORT_FFN_HIDDEN_BLOCKS = 5  # ... while the scores are tiny (measured 5.00)
SHORT_SEQ_HEAD_DIMS = 1.25  # "tiny scores": s <= this many head dimensions
RUN_OVERHEAD_BYTES = 3 * MIB  # small allocations and first-touched code of one run
SESSION_OVERHEAD_BYTES = 15 * MIB  # session structures and kernel code pages (measured 14.4 MiB)


@dataclass(frozen=True)
class EmbedMemoryModel:
    """Predicts the bytes of an encoder (``info``) session and of its requests under ONNX Runtime."""

    info: EmbedModelInfo
    fragmentation_ratio: float = 0.02

    # -- model ---------------------------------------------------------------------
    def weights_bytes(self) -> int:
        """Resident bytes of a loaded session: what loading the encoder costs."""
        return self.info.file_bytes + SESSION_OVERHEAD_BYTES

    # -- per chunk -----------------------------------------------------------------
    def short_seq(self) -> int:
        """The longest padded length at which the feed-forward step takes its short-sequence layout."""
        head_dim = self.info.dim // max(1, self.info.n_heads)
        return int(head_dim * SHORT_SEQ_HEAD_DIMS)

    def activation_bytes(self, batch: int, seq: int) -> int:
        """Peak working bytes of one chunk of ``batch`` inputs padded to ``seq`` tokens."""
        if batch < 1 or seq < 1:
            raise ValueError(f"a chunk has at least one input of one token (got {batch}x{seq})")
        i = self.info
        hidden_per_token = i.dim * F32_BYTES
        ffn_per_token = i.intermediate * F32_BYTES
        scores = batch * i.n_heads * seq * seq * F32_BYTES
        attention = 2 * scores + math.ceil(ATTN_HIDDEN_BLOCKS * batch * seq * hidden_per_token)
        long_ffn = batch * seq * (2 * ffn_per_token + FFN_HIDDEN_BLOCKS * hidden_per_token)
        short = self.short_seq()
        short_ffn = batch * min(seq, short) * (2 * ffn_per_token + SHORT_FFN_HIDDEN_BLOCKS * hidden_per_token)
        return max(attention, long_ffn, short_ffn) + RUN_OVERHEAD_BYTES

    # -- per request ---------------------------------------------------------------
    def request_bytes(self, lengths: Sequence[int], batch_size: int) -> int:
        """Peak bytes of a request of inputs of ``lengths`` wrapped tokens, computed in chunks of
        ``batch_size`` in input order, each padded to its longest: the largest chunk's
        activations plus the fragmentation allowance. No inputs, no bytes."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        peak = 0
        for start in range(0, len(lengths), batch_size):
            chunk = lengths[start : start + batch_size]
            peak = max(peak, self.activation_bytes(len(chunk), max(chunk)))
        return peak + int(peak * self.fragmentation_ratio)
