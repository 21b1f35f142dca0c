"""Memory model arithmetic on the real default model's GGUF metadata."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.memory import MemoryModel, ModelSpec, ollama_estimate


def test_spec_of_default_model(smol_spec: ModelSpec) -> None:
    """SmolLM2-135M: 30 layers, 3 KV heads of 64, vocab 49152, ~92 MiB of tensors."""
    s = smol_spec
    assert (s.n_layers, s.n_head, s.n_head_kv, s.head_dim_k, s.n_vocab) == (30, 9, 3, 64, 49152)
    assert 90 * 2**20 < s.weights_bytes < 95 * 2**20


def test_kv_bytes_match_llama_cpp_formula(memory: MemoryModel) -> None:
    """KV per token = layers x kv_heads x (k+v) x 2 bytes; context padded to 256."""
    assert memory.kv_bytes_per_token() == 30 * 3 * 128 * 2
    assert memory.kv_bytes(512) == 512 * 30 * 3 * 128 * 2  # llama.cpp reported 11.25 MiB
    assert memory.kv_bytes(1000) == memory.kv_bytes(1024)


def test_request_footprint_rounds_up_to_pages(memory: MemoryModel) -> None:
    """A request reserves whole pages for prompt+max_tokens plus compute and fragmentation."""
    fp = memory.request_footprint(37, 30)
    assert fp.kv_tokens == 80 and fp.pages == 5
    assert fp.kv_bytes == 80 * memory.kv_bytes_per_token()
    assert fp.total_bytes == fp.kv_bytes + fp.compute_bytes + fp.fragmentation_bytes
    assert fp.fragmentation_bytes == int((fp.kv_bytes + fp.compute_bytes) * 0.02)
    assert memory.request_footprint(37, 31).total_bytes >= fp.total_bytes


def test_partial_offload_counts_only_placed_layers(smol_spec: ModelSpec) -> None:
    """With n_gpu_layers=15 only half the layers' weights and KV are on the device."""
    full = MemoryModel(smol_spec)
    half = MemoryModel(smol_spec, n_gpu_layers=15)
    assert half.kv_bytes_per_token() * 2 == full.kv_bytes_per_token()
    assert half.weights_bytes() < full.weights_bytes() // 2 + 1


def test_ollama_rule_is_file_plus_f16_kv(smol_spec: ModelSpec) -> None:
    """Ollama's rule of thumb, as published, for comparison in the benchmark."""
    assert ollama_estimate(smol_spec, 1024) == smol_spec.file_bytes + 2 * 30 * 3 * 64 * 1024 * 2


# -- arithmetic on a small made-up model, every figure worked out by hand -------------------------
# 4 layers, 1 KV head of 4+4 dims in f16: 4 x 1 x 8 x 2 = 64 KV bytes per token. A vocabulary of
# 1000 and 8-wide embeddings make the logits path the larger one at 256 cells and the attention
# path from 512 cells on. Byte counts are odd so that a true division would show.
TINY = ModelSpec(
    name="tiny",
    arch="llama",
    n_layers=4,
    n_embd=8,
    n_head=2,
    n_head_kv=1,
    head_dim_k=4,
    head_dim_v=4,
    n_vocab=1000,
    n_ctx_train=4096,
    layer_bytes=4001,
    other_bytes=500,
    file_bytes=4600,
    repack_bytes=1001,
)


def test_tiny_kv_bytes() -> None:
    """64 bytes a token, the context padded to whole 256-cell blocks."""
    m = MemoryModel(TINY)
    assert m.kv_bytes_per_token() == 64
    assert m.kv_bytes(256) == 16_384
    assert m.kv_bytes(257) == 32_768


@pytest.mark.parametrize(
    ("n_ctx", "expected"),
    [
        # 256 cells, ub 256: logits 256 x (1000 + 2x8) x 4 = 1_040_384 beats attention
        # 256 x 256 x 3 x 4 + 6 x 256 x 8 x 4 = 835_584; plus one logits row 1000 x 4.
        (100, 1_040_384 + 4_000),
        # 512 cells, ub 512: attention 512 x 512 x 3 x 4 + 6 x 512 x 8 x 4 = 3_244_032
        # beats logits 512 x 1016 x 4 = 2_080_768.
        (300, 3_244_032 + 4_000),
        # 1024 cells, ub capped at n_ubatch 512: attention 512 x 1024 x 12 + 98_304 = 6_389_760.
        (1000, 6_389_760 + 4_000),
    ],
)
def test_tiny_compute_bytes(n_ctx: int, expected: int) -> None:
    """The compute buffer is the larger of the logits and attention paths, plus one logits row."""
    assert MemoryModel(TINY).compute_bytes(n_ctx) == expected


def test_tiny_context_bytes_is_kv_plus_compute() -> None:
    """A 300-token context: 512 cells of KV (32_768) plus the 3_248_032-byte compute buffer."""
    assert MemoryModel(TINY).context_bytes(300) == 32_768 + 3_248_032


def test_tiny_request_footprint() -> None:
    """40 + 60 tokens take 7 pages of 16 (112 tokens): KV, compute for 256 cells, 2 % on top."""
    fp = MemoryModel(TINY).request_footprint(40, 60)
    assert (fp.kv_tokens, fp.pages, fp.kv_bytes, fp.compute_bytes) == (112, 7, 7_168, 1_044_384)
    assert fp.fragmentation_bytes == 21_031  # int((7_168 + 1_044_384) x 0.02)
    assert fp.total_bytes == 7_168 + 1_044_384 + 21_031


def test_empty_request_still_takes_one_token() -> None:
    """A request of no tokens is sized as one token (one page of one)."""
    fp = MemoryModel(TINY, page_tokens=1).request_footprint(0, 0)
    assert (fp.kv_tokens, fp.pages, fp.kv_bytes) == (1, 1, 64)


@pytest.mark.parametrize(
    ("spec", "n_gpu_layers", "cpu_repack", "layers", "weights"),
    [
        (TINY, -1, False, 4, 4_001 + 500),  # all layers and the non-layer tensors
        (TINY, -1, True, 4, 4_001 + 1_001 + 500),  # ... and the repacked copy
        (TINY, 4, False, 4, 4_001 + 500),  # exactly all layers counts as full offload
        (TINY, 10, True, 4, 4_001 + 1_001 + 500),  # more than there are: all of them
        (TINY, 3, False, 3, 3_000),  # 4_001 x 3 // 4, no non-layer tensors
        (TINY, 3, True, 3, 3_000 + 750),  # ... and 1_001 x 3 // 4 repacked
        (TINY, 1, True, 1, 1_000 + 250),
        (TINY, 0, True, 0, 0),  # nothing on the device
        (replace(TINY, n_layers=1), -1, True, 1, 4_001 + 1_001 + 500),  # a single layer is all of it
    ],
)
def test_tiny_weights_bytes(spec: ModelSpec, n_gpu_layers: int, cpu_repack: bool, layers: int, weights: int) -> None:
    """Weights on the device: the placed share of the layers (and their repacked copy), the rest only when full."""
    m = MemoryModel(spec, n_gpu_layers=n_gpu_layers, cpu_repack=cpu_repack)
    assert m.layers_on_device() == layers
    assert m.weights_bytes() == weights


def test_no_layers_on_the_device_means_no_kv() -> None:
    """With n_gpu_layers=0 nothing of the model, KV cache included, is on the device."""
    assert MemoryModel(TINY, n_gpu_layers=0).kv_bytes_per_token() == 0
