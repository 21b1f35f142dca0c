"""core.transcribe_memory: the Whisper memory model, its arithmetic pinned by hand and its
predictions held against the table measured by ``benchmarks/transcribe_estimate.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spillover.core import transcribe_memory as tm
from spillover.core.transcribe_memory import TranscribeMemoryModel, WhisperShape

MIB = 1024 * 1024
TABLE = json.loads((Path(__file__).parent / "data" / "transcribe_memory_table.json").read_text())
TINY = WhisperShape(d_model=384, vocab=51864, n_mels=80, encoder_layers=4, decoder_layers=4, heads=6,
                    text_positions=448, audio_positions=1500, matrix_elems=36430848, matrix_rows=85656,
                    other_elems=1334016)  # fmt: skip
SMALL = WhisperShape(d_model=8, vocab=10, n_mels=2, encoder_layers=1, decoder_layers=3, heads=2,
                     text_positions=5, audio_positions=7, matrix_elems=100, matrix_rows=10,
                     other_elems=20)  # fmt: skip


def test_weights_by_compute_type_by_hand() -> None:
    m = TranscribeMemoryModel(SMALL)
    assert m.weights_bytes("int8") == 100 + 10 * 4 + 20 * 4 + tm.RUNTIME_BYTES
    assert m.weights_bytes("float16") == 120 * 2 + tm.RUNTIME_BYTES
    assert m.weights_bytes("float32") == 120 * 4 + tm.RUNTIME_BYTES
    with pytest.raises(ValueError, match="compute type"):
        m.weights_bytes("int4")


def test_window_beam_and_audio_bytes_by_hand() -> None:
    m = TranscribeMemoryModel(SMALL, fragmentation_ratio=0.0)
    t, d = 7, 8
    encoder = 2 * t * t * 4 + tm.ENCODER_BLOCKS * t * d * 4 + 2 * 2 * t * 4
    assert m.window_bytes() == encoder + 2 * 3 * t * d * 4
    assert m.beam_bytes() == 2 * 3 * 2 * d * 4 + 2 * 10 * 4
    per_s = tm.AUDIO_COPIES * 16000 * 4 + 100 * 2 * 4 + tm.STFT_BYTES_PER_FRAME * 100
    assert m.audio_bytes(2.5) == int(-(-2.5 * per_s // 1))
    assert m.audio_bytes(0) == 0
    with pytest.raises(ValueError):
        m.audio_bytes(-1)


def test_request_bytes_sum_the_parts_plus_fragmentation() -> None:
    m = TranscribeMemoryModel(SMALL, fragmentation_ratio=0.1)
    peak = m.window_bytes() + 3 * m.beam_bytes() + m.audio_bytes(4) + tm.RUN_BYTES
    assert m.request_bytes(4, 3) == peak + int(peak * 0.1)
    assert m.request_bytes(4, 4) > m.request_bytes(4, 3) and m.request_bytes(5, 3) > m.request_bytes(4, 3)
    with pytest.raises(ValueError, match="beam"):
        m.request_bytes(4, 0)


@pytest.mark.parametrize("cell", TABLE["cells"], ids=lambda c: f"{c['compute_type']}-b{c['beam']}-{c['seconds']:.0f}s")
def test_the_model_holds_against_every_measured_cell(cell: dict[str, float]) -> None:
    """Never under by more than 1 % (an under-estimate is an OOM), never over by more than
    a third (room taken from other work)."""
    m = TranscribeMemoryModel(TINY, fragmentation_ratio=0.0)
    for predicted, measured in (
        (m.weights_bytes(str(cell["compute_type"])), cell["load_bytes"]),
        (m.request_bytes(cell["seconds"], int(cell["beam"])), cell["run_bytes"]),
    ):
        err = (predicted - measured) / measured
        assert -0.01 <= err <= 0.34, f"{predicted / MIB:.1f} MiB predicted, {measured / MIB:.1f} MiB measured"
