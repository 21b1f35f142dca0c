"""A spoken clip shipped with the product, and longer files made from it, for the tests, the
drill and the benchmarks (no text-to-speech needed where they run).

``data/speech.wav`` (5.9 s, 16 kHz mono, 16-bit) was made once with Debian's espeak-ng:
``espeak-ng -v en-us -s 150 -w s.wav "The quick brown fox jumps over the lazy dog. Spillover
keeps every request." && sox s.wav -r 16000 -c 1 -b 16 speech.wav``.
"""

from __future__ import annotations

import io
import wave
from importlib import resources

__all__ = ["SPOKEN_WORDS", "speech_clip", "speech_of"]

SPOKEN_WORDS = ("quick", "brown", "fox", "lazy", "dog")  # what a transcript of the clip holds


def speech_clip() -> bytes:
    """The clip's WAV bytes."""
    return resources.files("spillover.testing").joinpath("data/speech.wav").read_bytes()


def speech_of(seconds: float) -> bytes:
    """A WAV ``seconds`` long: the clip and a second of silence, repeated, cut to length."""
    with wave.open(io.BytesIO(speech_clip())) as w:
        params = w.getparams()
        frames = w.readframes(w.getnframes())
    unit = frames + b"\0\0" * params.framerate
    want = int(seconds * params.framerate) * 2
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setparams(params)
        w.writeframes((unit * (want // len(unit) + 1))[:want])
    return out.getvalue()
