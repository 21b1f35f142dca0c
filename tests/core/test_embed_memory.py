"""Embedding memory model: hand-worked arithmetic, and the prediction against measured peaks.

The measured table (``tests/core/data/embed_memory_table.json``) is written by
``benchmarks/embed_estimate.py --record``: the peak RSS of one chunk of bge-small-en under
ONNX Runtime, a fresh process per cell. No engine runs here.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from spillover.core.embed_memory import EmbedMemoryModel
from spillover.engine.embedder import EmbedModelInfo

MIB = 1024 * 1024
TABLE = json.loads((Path(__file__).parent / "data" / "embed_memory_table.json").read_text())
CELLS: list[dict[str, Any]] = TABLE["cells"]
BGE = EmbedModelInfo(**TABLE["model"])
UNDER_LIMIT = 0.01  # never charge less than 99 % of the measured peak
BIG_CELL_BYTES = 64 * MIB  # cells at least this big are held to BIG_OVER_LIMIT
BIG_OVER_LIMIT = 0.10
OVER_FACTOR, OVER_SLACK_BYTES = 1.5, 3.5 * MIB  # every cell: charged <= 1.5 x measured + 3.5 MiB


def charged(model: EmbedMemoryModel, batch: int, seq: int) -> int:
    """What the gateway charges for a one-chunk request of ``batch`` inputs of ``seq`` tokens."""
    return model.request_bytes([seq] * batch, batch)


def cell_id(cell: dict[str, Any]) -> str:
    return f"{cell['batch']}x{cell['seq']}"


# -- the recorded table -----------------------------------------------------------------------------
def test_table_is_bge_small_with_big_and_small_cells() -> None:
    """The table holds bge-small-en's shape, measured with the pinned allocator, from 1x8 up to 16x512."""
    assert (BGE.dim, BGE.n_layers, BGE.n_heads, BGE.intermediate, BGE.max_tokens) == (384, 12, 12, 1536, 512)
    assert TABLE["allocator"] == "pinned"
    shapes = {(c["batch"], c["seq"]) for c in CELLS}
    assert {(1, 8), (64, 8), (1, 512), (16, 512), (32, 256), (64, 128)} <= shapes
    assert sum(1 for c in CELLS if c["peak_bytes"] >= BIG_CELL_BYTES) >= 8


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_never_under_estimates_a_measured_cell(cell: dict[str, Any]) -> None:
    """The charge for every measured cell is at least 99 % of its measured peak."""
    assert charged(EmbedMemoryModel(BGE), cell["batch"], cell["seq"]) >= (1 - UNDER_LIMIT) * cell["peak_bytes"]


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_over_estimate_is_bounded(cell: dict[str, Any]) -> None:
    """Big cells (>= 64 MiB) are charged at most 10 % over; every cell at most 1.5 x measured + 3.5 MiB."""
    pred, measured = charged(EmbedMemoryModel(BGE), cell["batch"], cell["seq"]), cell["peak_bytes"]
    if measured >= BIG_CELL_BYTES:
        assert pred <= (1 + BIG_OVER_LIMIT) * measured
    assert pred <= OVER_FACTOR * measured + OVER_SLACK_BYTES


def test_weights_cover_the_measured_load_tightly() -> None:
    """A session is charged its file plus 15 MiB: within [-1 %, +5 %] of every measured load."""
    model = EmbedMemoryModel(BGE)
    assert model.weights_bytes() == 34_015_106 + 15 * MIB
    for cell in CELLS:
        assert cell["load_resident_bytes"] * (1 - UNDER_LIMIT) <= model.weights_bytes()
        assert model.weights_bytes() <= cell["load_resident_bytes"] * 1.05


# -- monotonicity -------------------------------------------------------------------------------------
def test_monotonic_in_seq_at_every_batch() -> None:
    """A longer padded length never costs less, at any batch up to 64, across the short-sequence switch."""
    model = EmbedMemoryModel(BGE)
    for batch in range(1, 65):
        row = [model.activation_bytes(batch, seq) for seq in range(1, BGE.max_tokens + 1)]
        assert all(a <= b for a, b in itertools.pairwise(row)), batch


def test_monotonic_in_batch_at_every_seq() -> None:
    """More inputs in a chunk never cost less, at any padded length up to the window."""
    model = EmbedMemoryModel(BGE)
    for seq in range(1, BGE.max_tokens + 1):
        col = [model.activation_bytes(batch, seq) for batch in range(1, 65)]
        assert all(a < b for a, b in itertools.pairwise(col)), seq


# -- arithmetic, worked out by hand ----------------------------------------------------------------
# A made-up encoder: 8 dims, 2 heads (head_dim 4, so the short-sequence layout holds up to
# s = 5), 32 intermediate. Per token: hidden 32 B, feed-forward 128 B; long feed-forward path
# 2 x 128 + 2 x 32 = 320 B, short 2 x 128 + 5 x 32 = 416 B; attention 2 x b x 2 x s^2 x 4 =
# 16 b s^2 plus 5.5 x 32 = 176 B a token. Every activation adds the 3 MiB run overhead.
TINY = EmbedModelInfo(
    name="tiny", dim=8, n_layers=2, n_heads=2, intermediate=32, max_tokens=64, vocab_size=100, file_bytes=1_001
)
RUN = 3 * MIB


@pytest.mark.parametrize(
    ("batch", "seq", "expected"),
    [
        (1, 4, 4 * 416 + RUN),  # short layout 1_664 beats attention 256 + 704 = 960
        (1, 5, 5 * 416 + RUN),  # the last short length
        (1, 6, 5 * 416 + RUN),  # held at the s = 5 level 2_080 (long path is 1_920, attention 1_632)
        (1, 7, 7 * 320 + RUN),  # the long path 2_240 overtakes (attention 784 + 1_232 = 2_016)
        (1, 20, 16 * 400 + 176 * 20 + RUN),  # attention 9_920 beats the long path 6_400
        (32, 3, 32 * 3 * 416 + RUN),  # 39_936
        (1, 50, 16 * 2_500 + 176 * 50 + RUN),  # 48_800
        (32, 50, 16 * 32 * 2_500 + 176 * 32 * 50 + RUN),  # 1_561_600
    ],
)
def test_tiny_activation_bytes(batch: int, seq: int, expected: int) -> None:
    """One chunk: the largest of the attention, long and (held) short feed-forward paths, plus 3 MiB."""
    assert EmbedMemoryModel(TINY).activation_bytes(batch, seq) == expected


def test_bge_small_big_cell_by_hand() -> None:
    """16x512 on bge-small-en: scores 2 x 201_326_592 plus 5.5 x 12_582_912 hidden, plus 3 MiB."""
    assert EmbedMemoryModel(BGE).activation_bytes(16, 512) == 402_653_184 + 69_206_016 + 3 * MIB


def test_bge_small_short_cell_by_hand() -> None:
    """32x24 on bge-small-en takes the short feed-forward layout: 768 tokens x 19_968 B, plus 3 MiB."""
    assert EmbedMemoryModel(BGE).activation_bytes(32, 24) == 768 * 19_968 + 3 * MIB


def test_tiny_weights_bytes() -> None:
    """A session costs its file plus the 15 MiB session overhead."""
    assert EmbedMemoryModel(TINY).weights_bytes() == 1_001 + 15 * MIB


# -- requests: chunking and fragmentation -----------------------------------------------------------
def test_request_is_its_largest_chunk_padded_to_its_own_longest() -> None:
    """33 inputs at batch 32 are two chunks: 32x3 (3_185_664) then 1x50 (3_194_528); the larger counts."""
    assert EmbedMemoryModel(TINY, fragmentation_ratio=0.0).request_bytes([3] * 32 + [50], 32) == 3_194_528


def test_long_input_pads_only_its_own_chunk() -> None:
    """The long input first: the first chunk is 32x50 (4_707_328), the second 1x3; 2 % on top."""
    assert EmbedMemoryModel(TINY).request_bytes([50] + [3] * 32, 32) == 4_707_328 + 94_146


def test_one_chunk_when_batch_size_covers_the_request() -> None:
    """With batch_size 33 the same 33 inputs are one 33x50 chunk: 4_756_128, and 2 % on top."""
    assert EmbedMemoryModel(TINY).request_bytes([3] * 32 + [50], 33) == 4_756_128 + 95_122


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [(0.0, 475_004_928), (0.02, 475_004_928 + 9_500_098), (0.1, 475_004_928 + 47_500_492)],
)
def test_fragmentation_allowance_is_added(ratio: float, expected: int) -> None:
    """The allowance is int(ratio x the largest chunk's activations), added once per request."""
    model = EmbedMemoryModel(BGE, fragmentation_ratio=ratio)
    assert model.request_bytes([512] * 20, 16) == expected  # chunks 16x512 and 4x512


def test_empty_request_costs_nothing() -> None:
    """A request with no inputs has no chunks and no bytes."""
    assert EmbedMemoryModel(BGE).request_bytes([], 32) == 0


@pytest.mark.parametrize(("batch", "seq"), [(0, 8), (8, 0), (-1, 8)])
def test_empty_chunk_is_a_bug(batch: int, seq: int) -> None:
    """A chunk of no inputs or of no tokens is refused: the caller sized nothing."""
    with pytest.raises(ValueError, match="at least one input"):
        EmbedMemoryModel(BGE).activation_bytes(batch, seq)


def test_zero_batch_size_is_a_bug() -> None:
    """A batch size below one would never chunk: refused."""
    with pytest.raises(ValueError, match="batch_size"):
        EmbedMemoryModel(BGE).request_bytes([8], 0)
