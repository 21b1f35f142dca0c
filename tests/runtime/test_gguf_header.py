"""engine.gguf_header: the same metadata, tensor table and ModelSpec as gguf's GGUFReader, on
every shape the factory writes and on the default model; a file it refuses still reads (or
fails) as GGUFReader has it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from spillover.core.memory import MemoryModel
from spillover.engine.gguf_header import ARRAY_KEPT, Header, TensorInfo, read_header
from spillover.engine.gguf_meta import CPU_REPACK_TYPES, UnsupportedModel, header_by_reader, read_model_spec, spec_of
from spillover.testing.gguf_factory import TinyLlamaSpec, write_tiny_llama

SHAPES = [  # (the calibration tests read many more through read_model_spec, against real loads)
    TinyLlamaSpec(n_layers=2, n_embd=96, n_head=3, n_head_kv=1, n_ff=160, wtype="F32", tied=True, name="mqa-f32-tied"),
    TinyLlamaSpec(n_layers=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=64, wtype="Q4_0", n_expert=4, name="moe-q4_0"),
]


def _same(path: str | Path) -> None:
    fast, slow = read_header(path), header_by_reader(path)
    assert fast.tensors == slow.tensors
    assert fast.lengths == slow.lengths
    # GGUFReader adds the header's own counts as GGUF.* fields
    assert fast.fields == {k: v for k, v in slow.fields.items() if not k.startswith("GGUF.")}
    for repacks in ({}, CPU_REPACK_TYPES):
        assert spec_of(fast, path, repacks) == spec_of(slow, path, repacks)


def test_the_default_model_reads_as_gguf_reads_it(model_path: str) -> None:
    _same(model_path)
    h = read_header(model_path)
    assert h.lengths["tokenizer.ggml.tokens"] == 49152 and "tokenizer.ggml.tokens" not in h.fields


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_written_shape_reads_as_gguf_reads_it(tmp_path: Path, model_path: str, shape: TinyLlamaSpec) -> None:
    _same(write_tiny_llama(tmp_path / f"{shape.name}.gguf", model_path, shape))


def test_metadata_of_every_value_type_and_an_unaligned_table(tmp_path: Path) -> None:
    """Each scalar type, numeric arrays kept and stepped over, arrays of strings and of arrays,
    and a non-default alignment, written by gguf's own writer."""
    from gguf import GGUFWriter

    path = tmp_path / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e300)
    w.add_string("t.str", "héllo")
    w.add_array("t.short", [1, 2, 3])
    w.add_array("t.long", list(range(ARRAY_KEPT + 1)))
    w.add_array("t.strs", ["a", "bb", ""])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    w.add_tensor("a.weight", np.ones((3, 5), dtype=np.float32))
    w.add_tensor("b.weight", np.ones((7,), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = read_header(path)
    assert {k: v for k, v in h.fields.items() if k.startswith("t.")} == {
        "t.u8": 200, "t.i8": -100, "t.u16": 60000, "t.i16": -30000, "t.u32": 4_000_000_000,
        "t.i32": -2_000_000_000, "t.f32": pytest.approx(0.1), "t.bool": True, "t.u64": 2**64 - 1,
        "t.i64": -(2**63), "t.f64": 1e300, "t.str": "héllo", "t.short": [1, 2, 3],
    }  # fmt: skip
    assert h.lengths == {"t.short": 3, "t.long": ARRAY_KEPT + 1, "t.strs": 3, "t.nested": 2}
    assert [(t.name, t.shape, t.n_bytes) for t in h.tensors] == [("a.weight", (5, 3), 60), ("b.weight", (7,), 14)]
    assert h.tensors[1].data_offset % 64 == 0
    slow = header_by_reader(path)
    assert h.tensors == slow.tensors
    # GGUFReader counts a nested array's leaves (3), not its elements (2)
    assert {k: v for k, v in h.lengths.items() if k != "t.nested"} == {
        k: v for k, v in slow.lengths.items() if k != "t.nested"
    }


def test_a_truncated_or_damaged_file_is_refused_and_read_by_gguf_reader(tmp_path: Path, model_path: str) -> None:
    """A header that runs past the end, tensor data cut short, or not GGUF at all: read_header
    refuses (ValueError), GGUFReader refuses too, and read_model_spec raises read_header's error,
    which names the fault in the file's terms (round 20: GGUFReader's was "index 0 is out of
    bounds for axis 0")."""
    whole = Path(model_path).read_bytes()
    for n, name in ((40, "head.gguf"), (5000, "meta.gguf"), (3_000_000, "data.gguf")):
        cut = tmp_path / name
        cut.write_bytes(whole[:n])
        with pytest.raises(ValueError) as refused:
            read_header(cut)
        with pytest.raises(Exception):  # noqa: B017 (gguf raises assorted errors)
            header_by_reader(cut)
        with pytest.raises(ValueError) as got:
            read_model_spec(cut, cpu_repack=False)
        assert str(got.value) == str(refused.value)
    (tmp_path / "text.gguf").write_bytes(b"not a model at all, just text")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(tmp_path / "text.gguf")


def _header(arch: str, n_layers: int, **fields: object) -> Header:
    """A hand-made header: ``n_layers`` layers of one F32 tensor each, plus token_embd."""
    h = Header()
    h.fields = {"general.architecture": arch, f"{arch}.block_count": n_layers, f"{arch}.embedding_length": 64}
    h.fields.update({k.replace("ARCH", arch): v for k, v in fields.items()})
    h.lengths["tokenizer.ggml.tokens"] = 100
    f32 = GGMLQuantizationType.F32
    h.tensors = [TensorInfo("token_embd.weight", (64, 100), f32, 25600, 0)]
    h.tensors += [
        TensorInfo(f"blk.{i}.attn_q.weight", (64, 64), f32, 16384, 25600 + 16384 * i) for i in range(n_layers)
    ]
    return h


def test_an_encoder_keeps_no_kv_cache(tmp_path: Path) -> None:
    """llama.cpp makes no KV cache for bert and its kin (they attend over the batch only)."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    heads = {"ARCH.attention.head_count": 4, "ARCH.attention.head_count_kv": 4}
    bert = spec_of(_header("bert", 2, **heads), tmp_path / "m.gguf", {})
    llama = spec_of(_header("llama", 2, **heads), tmp_path / "m.gguf", {})
    assert not bert.kv_cache and llama.kv_cache
    assert MemoryModel(bert).kv_bytes(4096) == 0 < MemoryModel(llama).kv_bytes(4096)


def test_per_layer_head_counts_and_models_without_heads(tmp_path: Path) -> None:
    """A per-layer head_count list is read as its widest layer (llama.cpp loads such files), a
    per-layer head_count_kv list layer by layer; a list that is not one count a layer is refused
    as damaged (llama.cpp refuses it: "wrong array length"); none at all (a recurrent model)
    refuses in words, not as a damaged file."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    lists = {"ARCH.attention.head_count": [4, 4, 8, 8], "ARCH.attention.head_count_kv": [1, 2, 1, 2]}
    spec = spec_of(_header("openelm", 4, **lists), tmp_path / "m.gguf", {})
    assert (spec.n_head, spec.n_head_kv, spec.head_dim_k, spec.layer_kv_heads) == (8, 2, 8, (1, 2, 1, 2))
    short = {**lists, "ARCH.attention.head_count_kv": [1, 2]}
    with pytest.raises(ValueError, match="holds 2 values for 4 layers"):
        spec_of(_header("openelm", 4, **short), tmp_path / "m.gguf", {})
    for heads in ({}, {"ARCH.attention.head_count": 0}):
        with pytest.raises(UnsupportedModel, match="no attention heads"):
            spec_of(_header("mamba", 2, **heads), tmp_path / "m.gguf", {})


def test_a_layers_kv_heads_must_divide_its_query_heads(tmp_path: Path) -> None:
    """Helper round 81: a head_count_kv list of [3, 3] under 4 query heads passed (llama.cpp
    aborts on it; a scalar 3 was refused). Each layer is checked against its own query heads
    (a per-layer list's, not the widest layer's); a layer without KV (0) shares nothing."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    for heads, layer, q, kv in (
        ({"ARCH.attention.head_count": 4, "ARCH.attention.head_count_kv": [2, 3]}, 1, 4, 3),
        ({"ARCH.attention.head_count": [4, 6], "ARCH.attention.head_count_kv": [2, 4]}, 1, 6, 4),
        ({"ARCH.attention.head_count": [8, 6], "ARCH.attention.head_count_kv": 4}, 1, 6, 4),  # round 82
    ):
        with pytest.raises(ValueError, match=f"layer {layer}'s {q} query heads cannot share its {kv} KV heads"):
            spec_of(_header("llama", 2, **heads), tmp_path / "m.gguf", {})
    fine = {"ARCH.attention.head_count": [4, 6], "ARCH.attention.head_count_kv": [0, 3]}  # 6 % 3, and none
    assert spec_of(_header("llama", 2, **fine), tmp_path / "m.gguf", {}).layer_kv_heads == (0, 3)
    # Round 84: without a KV count each layer's is its own query count (llama.cpp's default), not
    # the widest layer's: [8, 6] heads and no KV key loads, its second layer's cache 6 heads wide.
    spec = spec_of(_header("openelm", 2, **{"ARCH.attention.head_count": [8, 6]}), tmp_path / "m.gguf", {})
    assert (spec.n_head_kv, spec.layer_kv_heads) == (8, (8, 6))


@pytest.mark.parametrize("key", ["context_length", "feed_forward_length", "attention.head_count_kv"])
def test_a_negative_shape_field_is_refused_as_llama_cpp_refuses_it(tmp_path: Path, key: str) -> None:
    """Helper round 81: with --no-plan a context_length of -5 or a feed_forward_length of -1 (a
    signed field) gave an estimate; llama.cpp refuses the file ("wrong type i32 but expected type
    u32"). Every shape field is an unsigned integer now, a per-layer list's values too."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    for value in (-1, [4, -1]):
        fields = {"ARCH.attention.head_count": 4, f"ARCH.{key}": value}
        with pytest.raises(ValueError, match=f"llama.{key} is -1: llama.cpp reads an unsigned integer there"):
            spec_of(_header("llama", 2, **fields), tmp_path / "m.gguf", {})
        if key == "context_length":
            break  # one number, never a list


def test_a_block_count_past_the_tensors_is_refused_before_any_list_of_it(tmp_path: Path) -> None:
    """A damaged block_count (10**8 layers, two tensors) refuses at once, in bounded memory."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    h = _header("llama", 1, **{"ARCH.attention.head_count": 4})
    h.fields["llama.block_count"] = 10**8
    with pytest.raises(ValueError, match="block_count is 100000000, but the file holds 2 tensors"):
        spec_of(h, tmp_path / "m.gguf", {})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"general.architecture": None}, "general.architecture is missing"),
        ({"general.architecture": ""}, "general.architecture is ''"),
        ({"llama.block_count": None}, "llama.block_count is missing"),
        ({"llama.embedding_length": None}, "llama.embedding_length is missing"),
        ({"llama.block_count": 0}, "llama.block_count is 0: a model has at least one layer"),
        ({"llama.embedding_length": list(range(5000))}, "llama.embedding_length is a list of 5000: llama.cpp"),
        ({"llama.block_count": -1}, "llama.block_count is -1"),
        ({"llama.block_count": "2"}, "llama.block_count is '2': llama.cpp reads an integer there"),
        ({"llama.embedding_length": 64.0}, "llama.embedding_length is 64.0: llama.cpp reads an integer"),
        ({"llama.attention.head_count": "4"}, "llama.attention.head_count is '4'"),
        ({"llama.attention.head_count": [4]}, "llama.attention.head_count holds 1 values for 2 layers"),
        ({"llama.attention.head_count": [4, "4"]}, "llama.attention.head_count is '4'"),
        ({"llama.attention.key_length": True}, "llama.attention.key_length is True"),
        ({"llama.context_length": "1024"}, "llama.context_length is '1024'"),
        ({"llama.feed_forward_length": [128, 128, 128]}, "feed_forward_length holds 3 values for 2 layers"),
        ({"llama.attention.head_count": 128}, "key_length is 0 (not in the file: embedding_length / head_count)"),
    ],
)
def test_a_damaged_or_missing_shape_field_is_refused_by_name(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    """Round 20: a count of the wrong type (a string, a float, a bool) was read as a number and
    estimated, though llama.cpp refuses the file ("has wrong type"); a missing key raised
    "int() argument must be ... not 'NoneType'", and a block_count of 0 or below "list index out
    of range". Each is now refused as damaged, naming the key (None: the key is left out)."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    h = _header("llama", 2, **{"ARCH.attention.head_count": 4, "ARCH.context_length": 1024})
    for key, value in fields.items():
        if value is None:
            del h.fields[key]
        else:
            h.fields[key] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        spec_of(h, tmp_path / "m.gguf", {})


def test_a_file_without_a_training_context_has_none(tmp_path: Path) -> None:
    """Round 20: a missing context_length read as a training context of 2048, which the fit
    search then called "the model's training context"; it is 0 now (none usable: the search
    goes up to llama.cpp's largest)."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    h = _header("llama", 2, **{"ARCH.attention.head_count": 4})
    assert spec_of(h, tmp_path / "m.gguf", {}).n_ctx_train == 0
    h.fields["llama.context_length"] = 1024
    assert spec_of(h, tmp_path / "m.gguf", {}).n_ctx_train == 1024


def test_multi_head_latent_attention_caches_k_only(tmp_path: Path) -> None:
    """DeepSeek's MLA (its decompressed head sizes given as *_mla): llama.cpp caches the latent
    K rows (kv_lora_rank + rope) and reads V from them (a file of that shape measured "V (f16):
    0.00 MiB"); without the *_mla keys it is an ordinary cache."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    heads = {
        "ARCH.attention.head_count": 4, "ARCH.attention.head_count_kv": 1, "ARCH.attention.key_length": 96,
        "ARCH.attention.value_length": 64,
    }  # fmt: skip
    mla = spec_of(
        _header(
            "deepseek2", 2, **heads, **{"ARCH.attention.key_length_mla": 64, "ARCH.attention.value_length_mla": 32}
        ),
        tmp_path / "m.gguf",
        {},
    )
    plain = spec_of(_header("deepseek2", 2, **heads), tmp_path / "m.gguf", {})
    assert not mla.v_cache and plain.v_cache
    assert MemoryModel(mla).kv_bytes(1024) == 1024 * 2 * 96 * 2  # cells x layers x K row x f16
    assert MemoryModel(plain).kv_bytes(1024) == 1024 * 2 * (96 + 64) * 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("block_count", "llama.block_count is 3, but the file holds no tensor of layer 2 (blk.2)"),
        ("layer_past", "llama.block_count is 2, but the file holds tensors of layer 5 (blk.5)"),
        ("layer_name", "tensor 'blk.x.attn_q.weight' names no layer"),
        ("width", "token_embd.weight is 64 wide, but llama.embedding_length is 128"),
        ("alignment", "tensor data starts at byte 8 (general.alignment 8), not a multiple of 32"),
    ],
)
def test_a_tensor_table_the_metadata_does_not_describe_is_refused(tmp_path: Path, change: str, message: str) -> None:
    """Round 39: ``--no-plan`` (which asks llama.cpp nothing) estimated files llama.cpp refuses
    or aborts on: a block_count past the layers the tensors hold, a token embedding of another
    width than embedding_length, tensor data at an alignment llama.cpp's CPU backend cannot map
    (general.alignment 8: "buffer pointer must be aligned"). Each is refused as damaged."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    h = _header("llama", 2, **{"ARCH.attention.head_count": 4})
    spec_of(h, tmp_path / "m.gguf", {})  # as written: read
    f32 = GGMLQuantizationType.F32
    if change == "block_count":
        h.fields["llama.block_count"] = 3
    elif change == "layer_past":
        h.tensors.append(TensorInfo("blk.5.attn_q.weight", (64, 64), f32, 16384, 2**20))
    elif change == "layer_name":
        h.tensors.append(TensorInfo("blk.x.attn_q.weight", (64, 64), f32, 16384, 2**20))
    elif change == "width":
        h.fields["llama.embedding_length"] = 128
    else:
        h.fields["general.alignment"] = 8
        h.tensors = [dataclasses.replace(t, data_offset=t.data_offset + 8) for t in h.tensors]
    with pytest.raises(ValueError, match=re.escape(message)):
        spec_of(h, tmp_path / "m.gguf", {})


def test_a_codecs_embedding_is_its_own_width(tmp_path: Path) -> None:
    """wavtokenizer-dec's token embedding is its features' width, not embedding_length's."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    h = _header("wavtokenizer-dec", 2, **{"ARCH.attention.head_count": 4})
    h.fields["wavtokenizer-dec.embedding_length"] = 128
    assert spec_of(h, tmp_path / "m.gguf", {}).n_embd == 128


def test_layers_named_otherwise_are_not_checked_and_a_shard_is_refused_in_words(tmp_path: Path) -> None:
    """Round 43: t5's layers are ``enc.blk.N`` / ``dec.blk.N`` (a codec's ``convnext.N``), which the
    layer check took for a file with no layers and refused as damaged; and the first file of a
    GGUF split into shards holds a part of the tensors, which the check refused as damaged too
    (and the estimate counted a part of the weights before): it is refused as such, in words."""
    (tmp_path / "m.gguf").write_bytes(b"x")
    h = _header("t5", 2, **{"ARCH.attention.head_count": 4})
    h.tensors = [dataclasses.replace(t, name="enc." + t.name) if t.name.startswith("blk.") else t for t in h.tensors]
    assert spec_of(h, tmp_path / "m.gguf", {}).n_layers == 2
    shard = _header("llama", 2, **{"ARCH.attention.head_count": 4, "split.count": 3, "split.no": 0})
    with pytest.raises(UnsupportedModel, match=re.escape("part 1 of a GGUF split into 3 files: merge them first")):
        spec_of(shard, tmp_path / "m.gguf", {})
    later = Header(fields={"split.count": 3, "split.no": 2})  # past the first, the split keys alone
    with pytest.raises(UnsupportedModel, match=re.escape("part 3 of a GGUF split into 3 files")):
        spec_of(later, tmp_path / "m.gguf", {})
