"""engine.audio: the one decoder, and its verdict on bad uploads (rule 2), on files made here."""

from __future__ import annotations

import io
import math
import struct
import wave
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from spillover.engine.audio import SAMPLE_RATE, BadAudio, decode
from spillover.engine.whisper_meta import default_whisper_model_dir, read_whisper_shape

CLIP = Path(str(resources.files("spillover.testing").joinpath("data/speech.wav")))


def _wav(path: Path, seconds: float, rate: int = 8000, channels: int = 2) -> bytes:
    n = int(seconds * rate)
    t = np.arange(n) / rate
    tone = (np.sin(2 * math.pi * 440 * t) * 12000).astype("<i2")
    frames = np.repeat(tone[:, None], channels, axis=1).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def test_any_rate_and_layout_is_resampled_to_16k_mono_float(tmp_path: Path) -> None:
    _wav(tmp_path / "a.wav", 2.0, rate=8000, channels=2)
    got = decode(str(tmp_path / "a.wav"), max_s=60)
    assert got.samples.dtype == np.float32 and got.samples.ndim == 1
    assert abs(got.duration_s - 2.0) < 0.02 and abs(got.samples.size - 2 * SAMPLE_RATE) < 400
    assert 0.2 < float(np.abs(got.samples).max()) <= 1.0


def test_the_shipped_clip_decodes_the_same_twice() -> None:
    a, b = decode(str(CLIP), max_s=60), decode(str(CLIP), max_s=60)
    assert np.array_equal(a.samples, b.samples) and 5.5 < a.duration_s < 6.5


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: p.write_bytes(b"plain text, not audio"), "not_audio"),
        (lambda p: p.write_bytes(b""), "not_audio"),
        (lambda p: p.write_bytes(CLIP.read_bytes()[:44]), "empty"),
        (lambda p: p.write_bytes(CLIP.read_bytes()[: len(CLIP.read_bytes()) // 3]), "truncated"),
        (lambda p: _wav(p, 5.0), "too_long"),
        # 1 Hz: 1,799 such samples were 30 minutes once resampled, 34 s of CPU (round 45b)
        (lambda p: _wav(p, 2.0, rate=1, channels=1), "low_rate"),
        (lambda p: _wav(p, 2.0, rate=3999, channels=1), "low_rate"),
    ],
)
def test_bad_uploads_are_named(tmp_path: Path, make: object, reason: str) -> None:
    path = tmp_path / "f.wav"
    make(path)  # type: ignore[operator]
    with pytest.raises(BadAudio) as e:
        decode(str(path), max_s=3.0)
    assert e.value.reason == reason and str(e.value)


def test_a_streamed_wav_without_sizes_is_not_called_truncated(tmp_path: Path) -> None:
    """A WAV whose header declares no data size (0xFFFFFFFF, as a live recorder writes) is
    decoded by what is present."""
    raw = bytearray(_wav(tmp_path / "w.wav", 1.0))
    i = raw.index(b"data")
    raw[i + 4 : i + 8] = struct.pack("<I", 0xFFFFFFFF)
    (tmp_path / "w.wav").write_bytes(bytes(raw))
    assert abs(decode(str(tmp_path / "w.wav"), max_s=60).duration_s - 1.0) < 0.05


def test_the_packaged_whisper_shape_is_read_from_model_bin() -> None:
    s = read_whisper_shape(default_whisper_model_dir())
    assert (s.d_model, s.heads, s.encoder_layers, s.decoder_layers, s.n_mels) == (384, 6, 4, 4, 80)
    assert (s.audio_positions, s.text_positions, s.vocab) == (1500, 448, 51864)
    total = (s.matrix_elems + s.other_elems) * 2  # float16 on disk
    assert abs(total - (Path(default_whisper_model_dir()) / "model.bin").stat().st_size) < 1024 * 1024


def test_a_file_that_is_not_a_whisper_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(struct.pack("<I", 6) + struct.pack("<H", 5) + b"Nope\0")
    with pytest.raises(ValueError, match="not a Whisper model"):
        read_whisper_shape(str(tmp_path))
