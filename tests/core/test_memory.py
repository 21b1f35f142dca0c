"""Memory model arithmetic on the real default model's GGUF metadata."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.memory import GRAPH_SLACK_BYTES, MemoryModel, ModelSpec, ollama_estimate


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
SLACK = GRAPH_SLACK_BYTES  # every path's fixed bytes (graph inputs, alignment)
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
        # 256 cells, ub 100 (the context): logits 100 x 1000 x 4 + 6 rows of 100 x 8 x 4 = 419_200
        # beats attention 100 x 256 x 2 x 4 + mask 256 x 128 x 4 + 8.5 x 100 x 8 x 4 = 363_072;
        # each path has the graph's fixed 16_384 on top.
        (100, 419_200 + SLACK),
        # 512 cells, ub 300: attention 300 x 512 x 8 + mask 512 x 320 x 4 + 8.5 x 300 x 32 = 1_965_760
        # beats logits 1_200_000 + 57_600 = 1_257_600.
        (300, 1_965_760 + SLACK),
        # 1024 cells, ub capped at 512: attention 4_194_304 + 2_097_152 + 139_264 = 6_430_720.
        (1000, 6_430_720 + SLACK),
    ],
)
def test_tiny_compute_bytes(n_ctx: int, expected: int) -> None:
    """The compute envelope is the larger of the logits and attention paths."""
    assert MemoryModel(TINY).compute_bytes(n_ctx) == expected


def test_flash_attention_keeps_no_scores_but_keeps_the_mask() -> None:
    """With flash attention no scores are kept, but the f16 mask (1024 cells x 512 x 2 =
    1_048_576) stays allocated beside the logits with three rows: 2_048_000 + 1_048_576 +
    49_152 beats six rows (98_304) and the attention path 1_048_576 + 139_264 (each with the
    graph's fixed 16_384)."""
    assert MemoryModel(TINY, flash_attn=True).compute_bytes(1000) == 3_145_728 + SLACK


def test_feed_forward_path_wins_for_a_wide_ffn() -> None:
    """Three ub x n_ff f32 tensors (gate, up, activated): n_ff 5000 at ub 100 is 6_000_000; with
    more than one layer the f32 mask (256 cells x 128 x 4 = 131_072) is still there beside 5.5
    rows (17_600), more than 6 rows (19_200); and the graph's fixed 16_384."""
    assert MemoryModel(replace(TINY, n_ff=5000)).compute_bytes(100) == 6_000_000 + 131_072 + 17_600 + SLACK
    # one layer: the mask is freed before its feed-forward, and the 6 rows are the larger
    one = replace(TINY, n_ff=5000, n_layers=1, layer_sizes=(4001,), layer_repack_sizes=(1001,))
    assert MemoryModel(one).compute_bytes(100) == 6_000_000 + 19_200 + SLACK


@pytest.mark.parametrize(
    ("n_batch", "n_ubatch", "n_ctx", "ub"),
    [(512, 512, 1000, 512), (64, 512, 1000, 64), (512, 32, 1000, 32), (512, 512, 100, 100), (2048, 2048, 777, 777)],
)
def test_micro_batch_is_clamped_like_llama_cpp(n_batch: int, n_ubatch: int, n_ctx: int, ub: int) -> None:
    """n_batch is clamped to the context and n_ubatch to n_batch."""
    assert MemoryModel(TINY, n_batch=n_batch, n_ubatch=n_ubatch).ubatch(n_ctx) == ub


KV4 = replace(TINY, n_head_kv=2, head_dim_k=32, head_dim_v=32)  # rows of 64 values


@pytest.mark.parametrize(
    ("kv_type", "per_token"),
    [("f32", 4 * 2 * 64 * 4), ("f16", 4 * 2 * 64 * 2), ("q8_0", 4 * 2 * 2 * 34), ("q4_0", 4 * 2 * 2 * 18)],
)
def test_kv_cache_types(kv_type: str, per_token: int) -> None:
    """A quantized cache stores whole blocks of 32 values: q8_0 34 bytes, q4_0 18."""
    assert MemoryModel(KV4, kv_type=kv_type, flash_attn=True).kv_bytes_per_token() == per_token


def test_impossible_caches_are_refused() -> None:
    """llama.cpp refuses a quantized V cache without flash attention, and a block type needs
    rows that are whole blocks; so does the model, with a sentence saying which."""
    with pytest.raises(ValueError, match="flash attention"):
        MemoryModel(KV4, kv_type="q8_0")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        MemoryModel(TINY, kv_type="q4_0", flash_attn=True)
    with pytest.raises(ValueError, match="unknown KV cache type"):
        MemoryModel(TINY, kv_type="q3_x")
    with pytest.raises(ValueError, match="at least 1"):
        MemoryModel(TINY, n_ubatch=0)


def test_tiny_context_bytes_is_kv_plus_compute_plus_output() -> None:
    """A 300-token context: 512 cells of KV (32_768), the compute envelope, one logits row."""
    assert MemoryModel(TINY).context_bytes(300) == 32_768 + 1_965_760 + SLACK + 4_000


def test_tiny_request_footprint() -> None:
    """40 + 60 tokens take 7 pages of 16 (112 tokens): KV, compute for a micro-batch of the 256
    padded cells (logits 1_024_000 + 49_152, the graph's fixed 16_384) and the output row, 2 % on top."""
    fp = MemoryModel(TINY).request_footprint(40, 60)
    assert (fp.kv_tokens, fp.pages, fp.kv_bytes, fp.compute_bytes) == (112, 7, 7_168, 1_093_536)
    assert fp.fragmentation_bytes == 22_014  # int((7_168 + 1_093_536) x 0.02)
    assert fp.total_bytes == 7_168 + 1_093_536 + 22_014


def test_empty_request_still_takes_one_token() -> None:
    """A request of no tokens is sized as one token (one page of one)."""
    fp = MemoryModel(TINY, page_tokens=1).request_footprint(0, 0)
    assert (fp.kv_tokens, fp.pages, fp.kv_bytes) == (1, 1, 64)


@pytest.mark.parametrize(
    ("spec", "n_gpu_layers", "cpu_repack", "layers", "weights"),
    [
        (TINY, -1, False, 4, 4_001 + 500),  # all layers and the non-layer tensors
        (TINY, -1, True, 4, 4_001 + 1_001 + 500),  # ... and the repacked copy (no GGUF read)
        (replace(TINY, cpu_model_bytes=4_321), -1, True, 4, 4_321),  # the CPU buffers, as read
        # every repeating layer, not the output layer: llama.cpp offloads it only past them
        (TINY, 4, False, 4, 4_001),
        (replace(TINY, cpu_model_bytes=4_321), 4, True, 4, 4_001 + 1_001),
        (TINY, 5, False, 4, 4_001 + 500),  # n_layers + 1: the output layer too
        (TINY, 10, True, 4, 4_001 + 1_001 + 500),  # more than there are: all of them
        (TINY, 3, False, 3, 3_000),  # 4_001 x 3 // 4, no non-layer tensors
        (TINY, 3, True, 3, 3_000 + 750),  # ... and 1_001 x 3 // 4 repacked
        (TINY, 1, True, 1, 1_000 + 250),
        (TINY, 0, True, 0, 0),  # nothing on the device
        (replace(TINY, n_layers=1), -1, True, 1, 4_001 + 1_001 + 500),  # a single layer is all of it
    ],
)
def test_tiny_weights_bytes(spec: ModelSpec, n_gpu_layers: int, cpu_repack: bool, layers: int, weights: int) -> None:
    """Weights on the device: the placed share of the layers (and their repacked copy), the rest only
    when the output layer is offloaded too (``n_gpu_layers`` -1 or above the layer count)."""
    m = MemoryModel(spec, n_gpu_layers=n_gpu_layers, cpu_repack=cpu_repack)
    assert m.layers_on_device() == layers
    assert m.weights_bytes() == weights


def test_no_layers_on_the_device_means_no_kv() -> None:
    """With n_gpu_layers=0 nothing of the model, KV cache included, is on the device."""
    assert MemoryModel(TINY, n_gpu_layers=0).kv_bytes_per_token() == 0


def test_flash_attention_mask_grows_with_the_context() -> None:
    """4096 cells, ub 512: the kept mask 4096 x 512 x 2 under the logits: 2_048_000 + 4_194_304 + 49_152."""
    assert MemoryModel(TINY, flash_attn=True).compute_bytes(4096) == 6_291_456 + SLACK
    assert MemoryModel(TINY, flash_attn=True).compute_paths(4096)[1] == 4_194_304 + 139_264 + SLACK


def test_flash_attention_casts_an_f32_cache_to_f16() -> None:
    """Flash attention reads an f32 cache's K and V views as f16 copies, both at once: 4096
    cells x 1 KV head x (4 + 4) dims x 2 bytes = 65_536 on the attention path; other cache
    types are read as they are."""
    paths = {t: MemoryModel(TINY, kv_type=t, flash_attn=True).compute_paths(4096)[1] for t in ("f32", "f16", "bf16")}
    attention = 4_194_304 + 139_264 + SLACK
    assert paths == {"f32": attention + 65_536, "f16": attention, "bf16": attention}
    assert MemoryModel(TINY, kv_type="f32").compute_paths(4096)[1] == MemoryModel(TINY).compute_paths(4096)[1]


def test_heads_llama_cpp_cannot_build_are_refused() -> None:
    """Query heads must be a multiple of KV heads, and a block-type cache quantizes each head's
    row: heads of 16 values cannot be q8_0 even when two of them make 32."""
    with pytest.raises(ValueError, match="6 query heads cannot share 4 KV heads"):
        MemoryModel(replace(TINY, n_head=6, n_head_kv=4))
    with pytest.raises(ValueError, match="cannot share 0"):
        MemoryModel(replace(TINY, n_head_kv=0))
    with pytest.raises(ValueError, match="heads hold 16"):
        MemoryModel(replace(TINY, n_head_kv=2, head_dim_k=16, head_dim_v=16), kv_type="q8_0", flash_attn=True)


def test_compute_paths_by_hand() -> None:
    """(logits, attention, feed-forward) at 300 tokens (512 cells, ub 300), n_ff 40, each with the
    graph's fixed 16_384: 1_257_600; 1_228_800 + 655_360 + 81_600; 3 x 300 x 40 x 4 + the f32
    mask (655_360, kept beside all layers' feed-forward but the last) + 5.5 rows (52_800)."""
    paths = MemoryModel(replace(TINY, n_ff=40)).compute_paths(300)
    assert paths == (1_257_600 + SLACK, 1_965_760 + SLACK, 144_000 + 655_360 + 52_800 + SLACK)


def test_smallest_contexts_and_batches() -> None:
    """One token still takes a cell block and a micro-batch of one; batches of one are allowed."""
    m = MemoryModel(TINY, n_batch=1, n_ubatch=1)
    assert (m.cells(0), m.cells(1), m.ubatch(1), m.ubatch(1000)) == (256, 256, 1, 1)
    with pytest.raises(ValueError, match="at least 1"):
        MemoryModel(TINY, n_batch=0)


def test_v_rows_are_checked_too() -> None:
    """Keys of 32 but values of 4 values a row cannot be a q8_0 cache."""
    with pytest.raises(ValueError, match="hold 4"):
        MemoryModel(replace(TINY, head_dim_k=32), kv_type="q8_0", flash_attn=True)
    assert MemoryModel(replace(TINY, head_dim_k=32, head_dim_v=32), kv_type="f32").kv_bytes_per_token() == 4 * 64 * 4


def test_partial_offload_places_the_last_layers_own_bytes() -> None:
    """n_gpu_layers = k puts the last k layers on the device: their own sizes (a quantization
    mix makes the last layers larger), with their repacked copies on the CPU backend; the
    whole model adds the other tensors and the output matrix's copy."""
    mixed = replace(
        TINY, layer_sizes=(100, 100, 300, 500), layer_bytes=1000, repack_bytes=70, layer_repack_sizes=(0, 10, 20, 40)
    )
    assert MemoryModel(mixed, n_gpu_layers=2).weights_bytes() == 800  # not 2/4 of 1000
    assert MemoryModel(mixed, n_gpu_layers=2, cpu_repack=True).weights_bytes() == 800 + 60
    whole = replace(mixed, output_repack_bytes=9)
    assert MemoryModel(whole, cpu_repack=True).weights_bytes() == 1000 + 70 + 500 + 9  # no cpu_model_bytes known
    assert MemoryModel(whole).weights_bytes() == 1000 + 500


@pytest.mark.parametrize(
    ("head", "rotation"),
    [(64, 4 * (64**2 + 64**2)), (128, 4 * (128**2 + 64**2)), (192, 4 * (64**2 + 64**2)), (256, 4 * (256**2 + 64**2))]
    + [(320, 4 * (64**2 + 64**2)), (512, 4 * (512**2 + 64**2)), (96, 0), (32, 0)],
)
def test_a_quantized_cache_of_64_value_heads_adds_its_rotation_matrices(head: int, rotation: int) -> None:
    """q8_0 or q4_0 against f16 (flash attention both): every path gains the two f32 rotation
    matrices, head x head for the largest power of two from 64 dividing the head size, and
    64 x 64; heads that are not whole blocks of 64 are not rotated."""
    spec = replace(TINY, n_head_kv=2, head_dim_k=head, head_dim_v=head)
    plain = MemoryModel(spec, flash_attn=True).compute_paths(100)
    for kv in ("q8_0", "q4_0"):
        paths = MemoryModel(spec, kv_type=kv, flash_attn=True).compute_paths(100)
        assert [q - f for q, f in zip(paths, plain, strict=True)] == [rotation] * 3


def test_a_query_wider_than_a_row_by_hand() -> None:
    """Heads of 128 on an embedding of 8 (2 heads: a query 32 rows wide), 100 tokens (256 cells):
    - flash attention: the logits (400_000) beside the f16 mask (65_536), the query (102_400)
      and 4 rows (12_800): a query of another width than a row, one row fewer for a wider one
      (round 72); the attention path is 8.5 query-wide rows
      (870_400) and the mask; the feed-forward (no n_ff) the mask and 5.5 rows (83_136), and the
      query beyond a row (99_200);
    - without it: no query below the logits (6 rows), and the f32 mask (131_072) beside the
      feed-forward, a layer of four not being the last."""
    spec = replace(TINY, head_dim_k=128, head_dim_v=128)
    fa = MemoryModel(spec, flash_attn=True).compute_paths(100)
    assert fa == (400_000 + 65_536 + 115_200 + SLACK, 870_400 + 65_536 + SLACK, 83_136 + 99_200 + SLACK)
    plain = MemoryModel(spec).compute_paths(100)
    assert plain[0] == 400_000 + 19_200 + SLACK
    assert plain[2] == 131_072 + 17_600 + 99_200 + SLACK


def test_a_query_narrower_than_a_row_by_hand() -> None:
    """Round 72: heads of 2 on an embedding of 8 (a query half a row wide), 100 tokens (256 cells),
    flash attention: the logits (400_000) beside the f16 mask (65_536), the query (1_600) and 5
    rows (16_000), more than the mask and 3 rows (75_136). A query as wide as a row (heads of 4)
    is reused: the mask and 3 rows; so is a query a row wide whose V heads are wider (the
    attention output's width counts too). Without flash attention (round 74) the narrower query
    sits there beside the f32 mask (131_072) and 5 rows; one a row wide beside 6 rows only."""
    narrow = MemoryModel(replace(TINY, head_dim_k=2, head_dim_v=2), flash_attn=True).compute_paths(100)
    assert narrow[0] == 400_000 + 65_536 + 1_600 + 16_000 + SLACK
    assert MemoryModel(TINY, flash_attn=True).compute_paths(100)[0] == 400_000 + 65_536 + 9_600 + SLACK
    wide_v = MemoryModel(replace(TINY, head_dim_v=8), flash_attn=True).compute_paths(100)[0]
    assert wide_v == 400_000 + 65_536 + 3_200 + 16_000 + SLACK
    plain = MemoryModel(replace(TINY, head_dim_k=2, head_dim_v=2)).compute_paths(100)[0]
    assert plain == 400_000 + 131_072 + 1_600 + 16_000 + SLACK
    assert MemoryModel(TINY).compute_paths(100)[0] == 400_000 + 19_200 + SLACK


def test_per_layer_kv_heads_and_recurrent_state_by_hand() -> None:
    """KV heads layer by layer (0, 1, 0, 2: a hybrid's recurrent layers have none) and a state of
    1000 bytes in each recurrent layer; heads of 4 values, f16, 512 cells:
    - flash attention: K and V per layer of their own heads: (8 + 8) + (16 + 16) = 48 a token;
    - without it, V is transposed and every layer's is as wide as the widest (2 heads): the
      layer of one head holds 8 + 16;
    - the state is in the KV bytes, with any context and in every request's footprint, and a
      placement of the last two layers holds their own heads and states only."""
    spec = replace(TINY, layer_kv_heads=(0, 1, 0, 2), layer_state_bytes=(1000, 0, 1000, 0), n_head_kv=2)
    fa = MemoryModel(spec, flash_attn=True)
    assert fa.kv_bytes_per_token() == 48 and fa.state_bytes() == 2000
    assert fa.layer_kv_bytes(300) == [1000, 16 * 512, 1000, 32 * 512]
    assert fa.kv_bytes(300) == 48 * 512 + 2000
    plain = MemoryModel(spec)
    assert plain.kv_bytes_per_token() == (8 + 16) + (16 + 16)
    assert plain.request_footprint(10, 6).kv_bytes == 16 * 56 + 2000
    last_two = MemoryModel(spec, flash_attn=True, n_gpu_layers=2)
    assert (last_two.kv_bytes_per_token(), last_two.state_bytes()) == (32, 1000)
    # 2 query heads cannot share 3 KV heads, unless the file gives its heads layer by layer
    with pytest.raises(ValueError, match="cannot share"):
        MemoryModel(replace(TINY, n_head_kv=3))
    MemoryModel(replace(TINY, n_head_kv=3, layer_kv_heads=(1, 1, 3, 1)))


def test_the_envelopes_terms_for_other_architectures_by_hand() -> None:
    """100 tokens (256 cells, ub 100), without flash attention:
    - a sliding window adds a second f32 mask (256 x 128 x 4 = 131_072) to the attention path;
    - a biased fused Q/K/V of width 24 adds 100 x 24 x 4 to it;
    - a mixture of experts (2 of width 16, no n_ff) adds 3.5 rows of 8 to it, and its shared
      expert of width 40 three rows of 40 (48_000) to the feed-forward, and a row (3_200)
      beside the logits: 7 rows, not 6 (round 74, qwen2moe);
    - a hybrid's Mamba2 layers leave 9 rows beside the logits (round 74, granite-hybrid)."""
    base = MemoryModel(TINY).compute_paths(100)
    swa = MemoryModel(replace(TINY, sliding_window=64)).compute_paths(100)
    assert swa[1] - base[1] == 131_072 and swa[2] - base[2] == 131_072
    qkv = MemoryModel(replace(TINY, qkv_bias_width=24)).compute_paths(100)
    assert (qkv[1] - base[1], qkv[2] - base[2]) == (9_600, 0)
    moe = replace(TINY, n_expert_used=2, n_ff_expert=16)
    routed = MemoryModel(moe).compute_paths(100)
    assert routed[1] - base[1] == 3.5 * 100 * 8 * 4
    shared = MemoryModel(replace(moe, n_ff_shared=40)).compute_paths(100)
    assert shared[2] - routed[2] == 3 * 100 * 40 * 4 and shared[1] == routed[1]
    assert (routed[0] - base[0], shared[0] - base[0]) == (0, 3_200)
    hybrid = MemoryModel(replace(TINY, ssm_row_floats=10)).compute_paths(100)
    assert hybrid[0] - base[0] == 3 * 3_200


def test_a_mamba_layers_scan_by_hand() -> None:
    """A hybrid's Mamba layer of 1000 values a row and a state of 5_000 bytes: 100 rows of it
    (400_000) beside the state and the f32 mask (131_072) pass the tiny model's attention path
    (379_456); a micro-batch of one row (4_000 beside the state and a 65_536-byte mask) passes it
    too (84_240); one of 10 values and a state of 1_000 does not, and the attention path stays."""
    spec = replace(TINY, ssm_row_floats=1000, layer_state_bytes=(5_000, 0, 0, 0))
    assert MemoryModel(spec).compute_paths(100)[1] == 400_000 + 5_000 + 131_072 + SLACK
    assert MemoryModel(spec, n_batch=1, n_ubatch=1).compute_paths(100)[1] == 4_000 + 5_000 + 65_536 + SLACK
    small = replace(TINY, ssm_row_floats=10, layer_state_bytes=(1_000, 0, 0, 0))
    assert MemoryModel(small, n_batch=1, n_ubatch=1).compute_paths(100)[1] == 84_240


def test_layers_without_attention_or_feed_forward_by_hand() -> None:
    """deci-like: KV heads 1, 0, 1, 2 (no recurrent layer: the head-less layer is still cached).
    Without flash attention every cached layer's V row is as wide as the widest (2 heads of 4):
    K of 4, 0, 4 and 8 values and V of 8 in each of the 4 layers, f16: 2 x 16 + 2 x 32 = 96 bytes
    a token; with it V is each layer's own (2 x 16 x 2 = 64). A last layer without a feed-forward keeps the f32
    mask (512 x 320 x 4 = 655_360) and 7 rows (300 x 8 x 4 each) beside the logits."""
    spec = replace(TINY, layer_kv_heads=(1, 0, 1, 2), n_head_kv=2)
    assert MemoryModel(spec).kv_bytes_per_token() == 2 * (4 + 0 + 4 + 8) + 2 * 4 * 8
    assert MemoryModel(spec, flash_attn=True).kv_bytes_per_token() == 2 * (4 + 0 + 4 + 8) * 2
    plain = MemoryModel(TINY).compute_paths(300)
    unfed = MemoryModel(replace(TINY, last_layer_ffn=False)).compute_paths(300)
    assert unfed[0] == 300 * 1000 * 4 + 655_360 + 7 * 300 * 8 * 4 + SLACK and unfed[1:] == plain[1:]


def test_rows_kept_through_the_graph_are_beside_every_path() -> None:
    """gemma3n-like: 50 values a row kept from the first layer to the logits: 100 rows x 50 x 4
    = 20_000 more on each path."""
    plain = MemoryModel(TINY).compute_paths(100)
    kept = MemoryModel(replace(TINY, kept_row_floats=50)).compute_paths(100)
    assert [k - p for k, p in zip(kept, plain, strict=True)] == [20_000] * 3
