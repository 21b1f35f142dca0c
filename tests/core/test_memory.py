"""Memory model arithmetic on the real default model's GGUF metadata."""

from __future__ import annotations

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
