"""Audio in: any file PyAV (FFmpeg's libraries, bundled in its wheel; no ffmpeg program)
can read, decoded to what Whisper hears, 16 kHz mono float32.

Rules:

1. ``decode`` is the one decoder: the gateway runs it to check an upload before the request
   is accepted, and each transcription worker runs it again on the stored file, so the GPU
   worker and its CPU replica transcribe the same samples.
2. A file that is not audio, holds no audio stream, decodes to nothing, stops well short of
   the duration its own header declares (truncated), or runs longer than ``max_s`` raises
   ``BadAudio`` with a sentence a person understands; ``reason`` tells which (the HTTP layer
   maps ``too_long`` to 413 and the rest to 400).
3. Decoding stops as soon as ``max_s`` is passed: a long file costs no more than the limit.
4. Audio sampled below ``MIN_SAMPLE_RATE`` is refused (``low_rate``): a 3.6 KB WAV that
   declared 1 Hz was 30 minutes of audio once resampled, 34 s of CPU for a few bytes sent.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MIN_SAMPLE_RATE", "SAMPLE_RATE", "BadAudio", "Decoded", "decode"]

SAMPLE_RATE = 16000
MIN_SAMPLE_RATE = 4000  # below any speech codec's rate (telephony is 8000): rule 4
TRUNCATED_RATIO = 0.9  # decoded under this share of the declared duration: the file was cut


class BadAudio(ValueError):
    """An upload that cannot be transcribed (rule 2)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "not_audio" | "empty" | "truncated" | "too_long" | "low_rate"


@dataclass(frozen=True)
class Decoded:
    """The samples and what the container said about them."""

    samples: np.ndarray  # float32, mono, SAMPLE_RATE
    duration_s: float
    declared_s: float | None  # the container's own duration, when it gives one
    codec: str


def decode(path: str, *, max_s: float) -> Decoded:
    """Rules 1-3."""
    import av
    import numpy as np

    try:
        container = av.open(path, mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise BadAudio("the file is not audio that can be decoded", "not_audio") from exc
    chunks: list[Any] = []
    samples = 0
    limit = int(max_s * SAMPLE_RATE)
    try:
        with container:
            if not container.streams.audio:
                raise BadAudio("the file holds no audio stream", "not_audio")
            stream = container.streams.audio[0]
            declared = _declared_s(container, stream)
            if declared is not None and declared > max_s + 1:
                raise BadAudio(f"the audio is {declared:.0f} s long; at most {max_s:.0f} s per request", "too_long")
            resampler = av.audio.resampler.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            try:
                for frame in container.decode(stream):
                    if (frame.sample_rate or MIN_SAMPLE_RATE) < MIN_SAMPLE_RATE:  # rule 4
                        raise BadAudio(
                            f"the audio's sample rate is {frame.sample_rate} Hz; at least {MIN_SAMPLE_RATE} Hz"
                            " (speech needs more)",
                            "low_rate",
                        )
                    for out in resampler.resample(frame):
                        chunks.append(out.to_ndarray().reshape(-1).copy())
                        samples += chunks[-1].size
                    if samples > limit:
                        raise BadAudio(f"the audio runs past {max_s:.0f} s, the limit per request", "too_long")
                for out in resampler.resample(None):
                    chunks.append(out.to_ndarray().reshape(-1).copy())
                    samples += chunks[-1].size
            except av.error.FFmpegError as exc:
                if samples == 0:
                    raise BadAudio("the file is not audio that can be decoded", "not_audio") from exc
                raise BadAudio("the audio is damaged part way through (truncated or corrupt)", "truncated") from exc
            finally:
                del resampler
                gc.collect()  # PyAV's resampler keeps buffers until collected (faster-whisper#390)
            codec = stream.codec_context.name
    except (av.error.FFmpegError, OSError) as exc:
        raise BadAudio("the file is not audio that can be decoded", "not_audio") from exc
    if samples > limit:
        raise BadAudio(f"the audio runs past {max_s:.0f} s, the limit per request", "too_long")
    if samples == 0:
        raise BadAudio("the file holds no audio (zero samples)", "empty")
    duration = samples / SAMPLE_RATE
    cut = _wav_cut(path)
    if cut is not None:
        raise BadAudio(f"the file ends {cut} bytes short of the audio its WAV header declares (truncated)", "truncated")
    if declared is not None and declared > 0.5 and duration < TRUNCATED_RATIO * declared:
        raise BadAudio(
            f"the audio stops at {duration:.1f} s of the {declared:.1f} s its header declares (truncated)",
            "truncated",
        )
    pcm = np.concatenate(chunks).astype(np.float32) / 32768.0
    return Decoded(pcm, duration, declared, codec)


def _declared_s(container: Any, stream: Any) -> float | None:
    """The duration the file's header declares: the stream's, else the container's."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000
    return None


def _wav_cut(path: str) -> int | None:
    """For a RIFF/WAVE file, how many bytes of its ``data`` chunk are missing (None: whole,
    or not a WAV, or a streamed WAV whose header declares no size). FFmpeg sizes a WAV by
    the bytes present, so a cut WAV would otherwise decode as a shorter, whole one."""
    import os
    import struct

    with open(path, "rb") as fh:
        head = fh.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        size = os.fstat(fh.fileno()).st_size
        pos = 12
        while pos + 8 <= size:
            fh.seek(pos)
            cid, clen = struct.unpack("<4sI", fh.read(8))
            if cid == b"data":
                if clen in (0, 0xFFFFFFFF):
                    return None
                present = size - pos - 8
                return clen - present if present < clen else None
            pos += 8 + clen + (clen & 1)
    return None
