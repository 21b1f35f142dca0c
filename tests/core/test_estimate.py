"""core.estimate: device and host bytes by component, every figure worked out by hand on a
made-up model (see tests/core/test_memory.py's TINY: 64 KV bytes a token, output row 4_000)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.estimate import estimate, largest_context, largest_gpu_layers
from spillover.core.memory import MemoryModel
from tests.core.test_memory import SLACK, TINY

SPEC = replace(
    TINY,  # 4 layers, 64 KV bytes a token, vocabulary 1000
    repack_bytes=0,
    layer_sizes=(1_000, 1_000, 1_000, 1_001),
    input_bytes=200,
    output_layer_bytes=300,
    cpu_model_bytes=4_555,
)
COMPUTE_300 = 1_965_760 + SLACK  # MemoryModel(SPEC).compute_bytes(300): attention path, fixed bytes
KV_300 = 512 * 64  # 512 cells


def test_cpu_placement_is_all_host() -> None:
    """A build without a GPU backend: the CPU buffers of the weights, KV, compute, output on the
    host; the margin is 2 % of what the context adds, kept out of total_bytes."""
    e = estimate(SPEC, 300)
    assert e.device.total_bytes == 0 and e.gpu_layers == 0
    h = e.host
    assert (h.weights_bytes, h.kv_bytes, h.compute_bytes, h.output_bytes) == (4_555, KV_300, COMPUTE_300, 4_000)
    assert h.margin_bytes == int((KV_300 + COMPUTE_300 + 4_000) * 0.02)
    assert e.total_bytes == 4_555 + KV_300 + COMPUTE_300 + 4_000
    assert e.total_with_margin_bytes == e.total_bytes + h.margin_bytes
    assert e.compute_source == "memory model envelope"
    assert (e.cells, e.n_batch, e.n_ubatch) == (512, 300, 300)


def test_the_plan_replaces_the_envelope() -> None:
    e = estimate(SPEC, 300, compute=lambda n: n * 10)
    assert e.host.compute_bytes == 3_000 and e.compute_source == "llama.cpp plan"


def test_a_splits_compute_says_where_each_side_comes_from() -> None:
    """Helper round 81: with some of the layers on the device, the device's compute buffer is the
    envelope's share of them, but the output said "compute buffer from the llama.cpp plan"."""
    plan = lambda n: n * 10  # noqa: E731
    for layers, source in ((0, "llama.cpp plan"), (5, "llama.cpp plan"), (4, None), (1, None)):
        e = estimate(SPEC, 300, placement="gpu", gpu_layers=layers, compute=plan)
        assert e.compute_source == (
            source or "llama.cpp plan on the host; the device's share of the layers from the memory model envelope"
        )
        if source is None:
            assert e.device.compute_bytes == MemoryModel(SPEC, n_batch=512, n_ubatch=512).layers_compute_bytes(300)
            assert e.host.compute_bytes == 3_000
    split = estimate(SPEC, 300, placement="gpu", gpu_layers=2)  # without a plan: the envelope everywhere
    assert split.compute_source == "memory model envelope"


def test_gpu_all_layers_and_the_output_layer() -> None:
    """-1 places every layer and the output layer (n_layers + 1); token_embd stays on the host."""
    e = estimate(SPEC, 300, placement="gpu")
    assert e.gpu_layers == 5
    d, h = e.device, e.host
    assert (d.weights_bytes, d.kv_bytes, d.compute_bytes, d.output_bytes) == (4_001 + 300, KV_300, COMPUTE_300, 4_000)
    assert (h.weights_bytes, h.kv_bytes, h.compute_bytes, h.output_bytes) == (200, 0, 0, 0)


def test_gpu_split_places_the_last_layers() -> None:
    """Two layers on the device: the last two (1_000 + 1_001) and half the KV. The device needs
    the attention part of the compute buffer; the host, holding the output layer, the whole."""
    e = estimate(SPEC, 300, placement="gpu", gpu_layers=2)
    attention = MemoryModel(SPEC).compute_paths(300)[1]
    d, h = e.device, e.host
    assert (d.weights_bytes, d.kv_bytes, d.compute_bytes, d.output_bytes) == (2_001, KV_300 // 2, attention, 0)
    assert (h.weights_bytes, h.kv_bytes, h.compute_bytes, h.output_bytes) == (
        2_000 + 200 + 300,
        KV_300 // 2,
        COMPUTE_300,
        4_000,
    )


def test_gpu_every_layer_but_not_the_output() -> None:
    """n_gpu_layers = n_layers: all layers on the device, the output layer on the host, so the
    host has no layers' compute but the logits."""
    e = estimate(SPEC, 300, placement="gpu", gpu_layers=4)
    assert (e.device.weights_bytes, e.host.weights_bytes) == (4_001, 500)
    assert e.device.kv_bytes == KV_300 and e.host.kv_bytes == 0
    assert e.host.compute_bytes == COMPUTE_300


def test_gpu_zero_layers_is_the_cpu_backends_own_figure() -> None:
    """Nothing offloaded: the host holds what the CPU backend reports (cpu_model_bytes), and
    without that figure the file's bytes plus the CPU's repacked copies."""
    e = estimate(SPEC, 300, placement="gpu", gpu_layers=0)
    assert e.device.total_bytes == 0
    assert e.host.weights_bytes == 4_555 and e.host.compute_bytes == COMPUTE_300
    assert e.total_bytes == estimate(SPEC, 300).total_bytes
    unknown = replace(SPEC, cpu_model_bytes=0, layer_repack_sizes=(10, 20, 30, 40), output_repack_bytes=7)
    assert estimate(unknown, 300, placement="gpu", gpu_layers=0).host.weights_bytes == 4_001 + 100 + 500 + 7


def test_the_hosts_layers_carry_the_cpu_backends_repacked_copies() -> None:
    """Layers left on the host are run by the CPU backend, which holds a repacked copy of its
    repackable matrices beside the mapped file; the device holds the file's bytes only. The
    output matrix's copy goes with the output layer."""
    packed = replace(SPEC, layer_repack_sizes=(10, 20, 30, 40), output_repack_bytes=7)
    two = estimate(packed, 300, placement="gpu", gpu_layers=2)
    assert (two.device.weights_bytes, two.host.weights_bytes) == (2_001, 2_000 + 10 + 20 + 200 + 300 + 7)
    four = estimate(packed, 300, placement="gpu", gpu_layers=4)
    assert (four.device.weights_bytes, four.host.weights_bytes) == (4_001, 200 + 300 + 7)
    assert estimate(packed, 300, placement="gpu").host.weights_bytes == 200


def test_a_tied_output_is_copied_only_onto_the_device() -> None:
    """Without output.weight the logits multiply by token_embd: on the device that is a second
    copy (output_layer_bytes counts it), on the host the same tensor."""
    tied = replace(SPEC, tied_output=True, output_layer_bytes=200 + 50)
    on = estimate(tied, 300, placement="gpu")
    assert (on.device.weights_bytes, on.host.weights_bytes) == (4_001 + 250, 200)
    off = estimate(tied, 300, placement="gpu", gpu_layers=4)
    assert off.host.weights_bytes == 200 + 50


def test_more_layers_than_there_are_is_all() -> None:
    assert estimate(SPEC, 300, placement="gpu", gpu_layers=99).gpu_layers == 5


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        estimate(SPEC, 0)
    with pytest.raises(ValueError, match="placement"):
        estimate(SPEC, 300, placement="tpu")
    with pytest.raises(ValueError, match="flash attention"):
        estimate(replace(SPEC, head_dim_k=32, head_dim_v=32), 300, kv_type="q8_0")


def test_json_shape() -> None:
    """One object: total_bytes, the components summed over both sides, each side's parts."""
    d = estimate(SPEC, 300, placement="gpu", gpu_layers=2).as_dict()
    parts = ("weights_bytes", "kv_bytes", "compute_bytes", "output_bytes")
    assert d["total_bytes"] == sum(d["components"][k] for k in parts)
    assert d["components"]["margin_bytes"] == d["device"]["margin_bytes"] + d["host"]["margin_bytes"]
    assert d["device"]["total_bytes"] + d["host"]["total_bytes"] == d["total_bytes"]


def _bytes(n: int, per_cell: int = 10, per_ubatch: int = 3, ubatch: int = 512) -> int:
    """A model's bytes as llama.cpp's: KV per whole 256-token cell, compute per micro-batch
    token (the micro-batch clamped to a shorter context)."""
    return -(-max(1, n) // 256) * 256 * per_cell + min(ubatch, n) * per_ubatch


def test_largest_context_in_whole_cells() -> None:
    """Binary search over 256-token cells up to the limit; a context one token past a cell costs
    the next cell, so past the micro-batch the answer is a whole number of cells."""
    for budget_ctx in (1000, 2048, 3000):
        budget = _bytes(budget_ctx)
        found = largest_context(lambda n, b=budget: _bytes(n) <= b, limit=4096).largest  # type: ignore[misc]
        assert found % 256 == 0 and _bytes(found) <= budget < _bytes(found + 1)
    assert largest_context(lambda n: True, limit=4096).largest == 4096
    assert largest_context(lambda n: False, limit=4096).largest == 0


def test_largest_context_inside_a_cell_where_the_micro_batch_clamps() -> None:
    """A context shorter than the micro-batch clamps it: one that does not fill its cell can fit
    where the whole cell does not (round 15: a 100 MiB device said "no context fits" for
    SmolLM2, which fits at a context of 10). The answer is exact: it fits, one more does not."""
    heavy = {"per_cell": 1, "per_ubatch": 100}  # compute dominates, as on a small model
    for budget in (_bytes(10, **heavy), _bytes(300, **heavy), _bytes(257, **heavy) - 1):
        found = largest_context(lambda n, b=budget: _bytes(n, **heavy) <= b, limit=4096).largest  # type: ignore[misc]
        assert found > 0 and _bytes(found, **heavy) <= budget < _bytes(found + 1, **heavy)
    assert largest_context(lambda n: _bytes(n, **heavy) <= _bytes(1, **heavy) - 1, limit=4096).largest == 0


def _dipping(n: int) -> int:
    """Bytes as llama.cpp plans them for some models (SmolLM2 with a q8_0 cache): 10 a cell, but
    a compute buffer 25 smaller from the fifth cell on."""
    cells = -(-max(1, n) // 256)
    return cells * 10 + (100 if cells < 5 else 75)


def test_a_context_past_a_dip_in_the_planned_bytes_is_found_and_the_ones_before_it_named() -> None:
    """Helper round 81: llama.cpp's plan does not grow steadily with the context, and the binary
    search answered 768 where 1280 fits (and, the other way, a context past shorter ones that
    do not). With ``floor_fits`` (the bytes without the compute buffer, which grow steadily)
    every cell of the first ``scan_cells`` is asked: the answer is the largest that fits, and the
    cells below it that do not are named. ``prefetch`` hears every context asked that way, first."""
    budget = 134  # cells 1-3 fit (110, 120, 130), 4 does not (140), 5-5 fit again (125), 6 (135) not
    asked: list[list[int]] = []
    fit = largest_context(
        lambda n: _dipping(n) <= budget,
        limit=4096,
        floor_fits=lambda n: -(-max(1, n) // 256) * 10 <= budget,
        scan_cells=64,
        prefetch=lambda contexts: asked.append(contexts) is None,
    )
    assert (fit.largest, fit.gaps, fit.scanned_cells) == (1280, ((769, 1024),), 13)
    assert asked == [[n * 256 for n in range(1, 14)]]  # the floor: 13 cells of 10 fit in 134
    # Without the scan, a binary search (monotone bytes assumed): what it answered before.
    assert largest_context(lambda n: _dipping(n) <= budget, limit=4096).largest == 768
    # Past the scanned cells, the search is binary: a budget no scanned cell fits finds none.
    assert largest_context(lambda n: False, limit=4096, floor_fits=lambda n: True, scan_cells=4).largest == 0
    far = largest_context(lambda n: n <= 3000, limit=4096, floor_fits=lambda n: True, scan_cells=4)
    assert (far.largest, far.gaps, far.scanned_cells) == (3000, (), 4)
    # The contexts could not each be planned (prefetch says so): a binary search, as without a scan.
    plain = largest_context(lambda n: _dipping(n) <= budget, limit=4096, floor_fits=lambda n: True, scan_cells=64,
                            prefetch=lambda contexts: False)  # fmt: skip
    assert (plain.largest, plain.gaps, plain.scanned_cells) == (768, (), 0)


def test_a_limit_inside_a_cell_is_asked_where_the_whole_cell_below_does_not_fit() -> None:
    """Round 82: a training context of 1100 ends in the fifth cell, whose bytes fit where the
    fourth cell's do not (the dip above): 768 was answered beside "fits" for --ctx 1100. The
    part of a cell at the limit is asked first; its contexts cost the fifth cell."""
    budget = 134
    fit = largest_context(lambda n: _dipping(n) <= budget, limit=1100, floor_fits=lambda n: True, scan_cells=64)
    assert (fit.largest, fit.gaps) == (1100, ((769, 1024),))
    short = largest_context(lambda n: _dipping(n) <= 124, limit=1100, floor_fits=lambda n: True, scan_cells=64)
    assert (short.largest, short.gaps) == (512, ())  # cells 3 and 4 (130, 140) and the part (125) do not fit


def test_a_gap_below_the_micro_batch_starts_where_the_contexts_stop_fitting() -> None:
    """Round 82: a cell that does not fit at its end may fit for its shorter contexts, which
    clamp the micro-batch (``clamped_below``): the gap starts at the first one that does not."""

    def dipping_clamped(n: int) -> int:  # cell 1's compute grows with the context up to 256
        return _dipping(n) - (0 if n > 256 else (256 - n) // 10)

    fit = largest_context(lambda n: dipping_clamped(n) <= 105, limit=4096, floor_fits=lambda n: True,
                          scan_cells=64)  # fmt: skip
    assert fit.largest == 206  # inside cell 1: 110 - (256 - 206) // 10 = 105
    # Cell 1 does not fit at 256, but its contexts up to 206 do; cells 2-4 do not (200); 5 does (100).
    fit = largest_context(
        lambda n: (dipping_clamped(n) if n <= 256 else 100 if -(-n // 256) == 5 else 200) <= 105,
        limit=4096, floor_fits=lambda n: True, scan_cells=64, clamped_below=512,
    )  # fmt: skip
    assert (fit.largest, fit.gaps) == (1280, ((207, 1024),))


def test_a_context_two_cells_past_the_last_whole_cell_that_fits_is_found_under_a_wide_micro_batch() -> None:
    """Round 84: with a micro-batch of 2048 a context of 1025-1032 fits SmolLM2 in 344 MiB where
    neither 1024 nor 1280 does (the micro-batch is clamped to the context, and the plan dips
    past 1024); only the cell after the last whole one that fits (768) was searched inside. Each
    further cell below the micro-batch has its shortest context asked, and the gap below the
    answer starts where cell 4's contexts stop fitting."""

    def clamped(n: int) -> int:  # KV 10 a cell; compute 1 per 16 micro-batch tokens, 40 less past 1024
        cells = -(-n // 256)
        return cells * 10 + min(n, 2048) // 16 - (40 if cells > 4 else 0)

    budget = 74  # whole cells: 256 (26) and 512 (52) fit, 768 (78) and 1024 (104) do not, 1280 (90) not
    assert [n for n in range(256, 4097, 256) if clamped(n) <= budget] == [256, 512]
    asked: list[list[int]] = []
    fit = largest_context(
        lambda n: clamped(n) <= budget, limit=4096, floor_fits=lambda n: True, scan_cells=16,
        prefetch=lambda contexts: asked.append(contexts) is None, clamped_below=2048,
    )  # fmt: skip
    assert fit.largest == max(n for n in range(1, 4097) if clamped(n) <= budget) == 1039
    assert fit.gaps == ((720, 1024),)  # cell 3 fits up to 719 (30 + 44), cell 4 not at all
    assert asked == [list(range(256, 4097, 256)), [769, 1025, 1281, 1537, 1793]]  # cells 4-8's shortest
    # Round 85: nothing scanned (the envelope, `--no-plan`: its bytes grow steadily), nothing
    # further asked either (a llama.cpp dry run of 28 contexts, for --no-plan, before).
    asked.clear()
    largest_context(lambda n: clamped(n) <= budget, limit=4096, floor_fits=lambda n: True, scan_cells=0,
                    prefetch=lambda contexts: asked.append(contexts) is None, clamped_below=2048)  # fmt: skip
    assert asked == []
    # The micro-batch within one cell (the default 512 past 256 cells): as before, no further cell asked.
    assert largest_context(lambda n: clamped(n) <= budget, limit=4096, floor_fits=lambda n: True,
                           scan_cells=16, clamped_below=512).largest == 719  # fmt: skip


def test_largest_gpu_layers() -> None:
    assert largest_gpu_layers(lambda n: n <= 2, 4) == 2
    assert largest_gpu_layers(lambda n: True, 4) == 5
    assert largest_gpu_layers(lambda n: False, 4) == -1
    for fit in range(-1, 7):  # every answer of a 5-layer model
        assert largest_gpu_layers(lambda n, fit=fit: n <= fit, 5) == min(fit, 6)


def test_all_layers_is_asked_first() -> None:
    """Device bytes can fall from n layers to all of them (the planned whole buffer under the
    envelope's share of the layers): all fits while n does not, and the answer is all."""
    assert largest_gpu_layers(lambda n: n <= 2 or n == 5, 4) == 5
    assert largest_gpu_layers(lambda n: n == 5, 4) == 5


def test_largest_gpu_layers_asks_a_logarithm_of_the_layers() -> None:
    """Each answer sums over the layers: asking every count made a file claiming 80,000 layers
    run for minutes."""
    asked: list[int] = []
    assert largest_gpu_layers(lambda n: asked.append(n) is None and n <= 12345, 80_000) == 12345
    assert len(asked) <= 19


def test_defaults_and_clamps_by_hand() -> None:
    """Defaults: n_batch and n_ubatch 512, f16, no flash attention, 2 % margin: at 1000 tokens the
    micro-batch is 512 and the compute the attention path, 6_430_720 (1024 cells), with the
    graph's fixed 16_384."""
    e = estimate(SPEC, 1000)
    assert (e.cells, e.n_batch, e.n_ubatch, e.kv_type, e.flash_attn) == (1024, 512, 512, "f16", False)
    assert e.host.compute_bytes == 6_430_720 + SLACK and e.host.kv_bytes == 1024 * 64
    assert e.host.margin_bytes == int((1024 * 64 + 6_430_720 + SLACK + 4_000) * 0.02)
    small = estimate(SPEC, 1000, n_batch=64, n_ubatch=32, margin_ratio=0.1)
    assert (small.n_batch, small.n_ubatch) == (64, 32)
    assert small.host.margin_bytes == int((small.host.kv_bytes + small.host.compute_bytes + 4_000) * 0.1)


def test_as_dict_in_full() -> None:
    e = estimate(SPEC, 300, compute=lambda _n: 1_000)
    h = {"weights_bytes": 4_555, "kv_bytes": KV_300, "compute_bytes": 1_000, "output_bytes": 4_000}
    margin = int((KV_300 + 1_000 + 4_000) * 0.02)
    total = 4_555 + KV_300 + 1_000 + 4_000
    zero = {k: 0 for k in ("weights_bytes", "kv_bytes", "compute_bytes", "output_bytes", "margin_bytes")}
    assert e.as_dict() == {
        "n_ctx": 300,
        "cells": 512,
        "n_batch": 300,
        "n_ubatch": 300,
        "kv_type": "f16",
        "flash_attn": False,
        "placement": "cpu",
        "gpu_layers": 0,
        "n_layers": 4,
        "compute_source": "llama.cpp plan",
        "total_bytes": total,
        "total_with_margin_bytes": total + margin,
        "components": {**h, "margin_bytes": margin},
        "device": {**zero, "total_bytes": 0, "total_with_margin_bytes": 0},
        "host": {**h, "margin_bytes": margin, "total_bytes": total, "total_with_margin_bytes": total + margin},
    }


def test_split_kv_type_and_flash_attention_carry_through() -> None:
    """A q8_0 cache with flash attention on a split: rows of 64 values, 4 x 34 bytes a layer."""
    spec = replace(SPEC, head_dim_k=32, head_dim_v=32, n_head_kv=2)
    e = estimate(spec, 300, placement="gpu", gpu_layers=1, kv_type="q8_0", flash_attn=True)
    per_layer = 512 * 2 * 2 * 34
    assert (e.device.kv_bytes, e.host.kv_bytes) == (per_layer, 3 * per_layer)
    assert e.flash_attn and e.kv_type == "q8_0" and e.gpu_layers == 1


def test_a_split_places_each_layers_own_cache_and_state() -> None:
    """A hybrid: a recurrent first layer (its 5000-byte state, no KV) and attention layers of 1,
    1 and 2 KV heads; with the last two layers on the device, the device holds their own 3 heads'
    KV (f16, flash attention, 512 cells of 2 x 4 values a head) and the host the rest."""
    spec = replace(SPEC, n_head_kv=2, layer_kv_heads=(0, 1, 1, 2), layer_state_bytes=(5000, 0, 0, 0))
    e = estimate(spec, 300, placement="gpu", gpu_layers=2, flash_attn=True)
    head = 512 * 2 * 4 * 2  # K and V of one head, f16
    assert (e.device.kv_bytes, e.host.kv_bytes) == (3 * head, 5000 + head)
    assert estimate(spec, 300, flash_attn=True).host.kv_bytes == 5000 + 4 * head


def test_search_edges() -> None:
    """A limit that is not a whole number of cells (a training context of 1000, or of 100, below one
    cell) is itself the answer when it fits, else the largest below it that does; a step other
    than 256; only zero layers."""
    assert largest_context(lambda n: True, limit=1000).largest == 1000
    assert largest_context(lambda n: n <= 900, limit=1000).largest == 900
    assert largest_context(lambda n: n <= 300, limit=4096, step=100).largest == 300
    assert largest_context(lambda n: True, limit=100).largest == 100
    assert largest_context(lambda n: n < 100, limit=100).largest == 99
    assert largest_context(lambda n: False, limit=100).largest == 0
    assert largest_gpu_layers(lambda n: n == 0, 4) == 0
    assert largest_gpu_layers(lambda n: n <= 5, 4) == 5


def test_llama_cpps_refusal_names_its_error_not_its_notes() -> None:
    """The reason quotes the lines llama.cpp logs at its error level (with their
    continuations), not notes whose words look like errors (a model named 'Invalid-Requires')."""
    from spillover.engine.plan import _reason

    lines = [
        (2, "print_info: general.name = Invalid-Requires-Errors-7B\n"),
        (3, "done_getting_tensors: tensor 'token_embd.weight' cannot be used with CPU_REPACK, using CPU instead\n"),
        (4, "llama_init_from_model: failed to initialize the context:"),
        (5, " std::bad_alloc\n"),
        (2, "llama_kv_cache: not supported here, fine\n"),
    ]
    assert _reason(lines) == (
        "llama.cpp refuses these settings: llama_init_from_model: failed to initialize the context: std::bad_alloc"
    )
    two = [(4, "first error\n"), (2, "note\n"), (5, "a note's continuation\n"), (4, "second error\n")]
    assert _reason(two).endswith("first error; second error")
    assert _reason([(2, "only notes\n")]).endswith("refused to create the context")


def test_a_type_the_bindings_do_not_export_has_ggmls_value() -> None:
    import llama_cpp

    from spillover.engine.calibrate import ggml_type

    assert ggml_type("bf16") == 30  # GGML_TYPE_BF16 in ggml.h
    assert ggml_type("q8_0") == llama_cpp.GGML_TYPE_Q8_0 and ggml_type("F16") == llama_cpp.GGML_TYPE_F16
