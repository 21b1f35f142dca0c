"""The transcription memory model: what a Whisper model (CTranslate2, as faster-whisper runs
it) and one transcription request occupy.

A model (``WhisperShape``: width ``d``, ``heads`` H, encoder and decoder layers ``Le``/``Ld``,
vocabulary ``V``, ``n_mels`` M, ``T`` audio positions (1500 for a 30 s window), ``P`` text
positions (448)) is loaded once per worker:

- **weights** at the worker's compute type: ``int8`` (the CPU path) stores each linear
  matrix as one byte per element plus a float32 scale per row, the rest in float32;
  ``float16`` (CUDA) two bytes per element; ``float32`` four. Plus ``RUNTIME_BYTES``, the
  runtime's own structures and the code pages its kernels touch (measured).

A request of ``s`` seconds of audio decoded with ``beam`` beams adds (float32 activations):

- **encoder**, one 30 s window at a time (windows run one after another and give their
  activations back): the attention scores of one layer ``H·T²·4``, ``ENCODER_BLOCKS``
  hidden-size tensors ``T·d·4`` (projections, feed-forward, residuals), the window's mel
  features ``M·2T·4``;
- **cross-attention keys and values** of every decoder layer, computed once per window and
  shared by the beams: ``2·Ld·T·d·4``;
- **decoder state per beam**: the self-attention cache for the ``P/2`` tokens a window may
  generate ``2·Ld·(P/2)·d·4`` and two vocabulary-size rows of logits ``2·V·4``;
- **the audio itself**, whole: the decoded samples twice (decoded and padded, float32 at
  16 kHz), the mel features of the whole file, and the short-time Fourier transform they are
  computed from (NumPy, float64 frames of ``n_fft`` = 400 samples and their complex128
  spectrum of 201 bins, 100 frames a second): ``(2·16000 + 100·M)·4 + 100·(400·8 + 201·16)``
  per second (measured slope 0.3-0.6 MiB/s; predicted 0.73);
- ``RUN_BYTES`` of allocations a run first touches, then ``fragmentation_ratio`` of the sum.

The constants were fit by ``benchmarks/transcribe_estimate.py`` (peak RSS delta of a fresh
process per cell on the CPU path; the table is in
``tests/core/data/transcribe_memory_table.json``, with the command that regenerates it).
On ``cuda:N`` the activations run in float16, so these float32 figures over-estimate them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TranscribeMemoryModel", "WhisperShape"]

MIB = 1024 * 1024
F32 = 4
SAMPLE_RATE = 16000
MEL_FRAMES_PER_S = 100
AUDIO_COPIES = 2  # the decoded samples and their padded copy
ENCODER_BLOCKS = 12  # hidden-size tensors live beside the scores in one encoder layer
N_FFT = 400  # Whisper's STFT window, in samples
STFT_BYTES_PER_FRAME = N_FFT * 8 + (N_FFT // 2 + 1) * 16  # float64 frame + complex128 spectrum
RUNTIME_BYTES = 34 * MIB  # runtime structures and kernel code pages of a loaded model (measured)
RUN_BYTES = 8 * MIB  # small allocations and first-touched code of one run
COMPUTE_TYPES = ("int8", "float16", "float32")


@dataclass(frozen=True)
class WhisperShape:
    """A Whisper model's dimensions and its weights' element counts (``engine.whisper_meta``)."""

    d_model: int
    vocab: int
    n_mels: int
    encoder_layers: int
    decoder_layers: int
    heads: int
    text_positions: int
    audio_positions: int
    matrix_elems: int  # elements of the linear layers' 2-D weight matrices
    matrix_rows: int  # their rows (an int8 matrix keeps one float32 scale per row)
    other_elems: int  # every other weight element (biases, norms, convolutions, positions)


@dataclass(frozen=True)
class TranscribeMemoryModel:
    """Predicts the bytes of a Whisper model and of its requests (rules in the module docstring)."""

    shape: WhisperShape
    fragmentation_ratio: float = 0.02

    def weights_bytes(self, compute_type: str) -> int:
        """Resident bytes of a loaded model at ``compute_type``."""
        s = self.shape
        if compute_type == "int8":
            stored = s.matrix_elems + s.matrix_rows * F32 + s.other_elems * F32
        elif compute_type == "float16":
            stored = (s.matrix_elems + s.other_elems) * 2
        elif compute_type == "float32":
            stored = (s.matrix_elems + s.other_elems) * F32
        else:
            raise ValueError(f"compute type must be one of {', '.join(COMPUTE_TYPES)} (got {compute_type!r})")
        return stored + RUNTIME_BYTES

    def window_bytes(self) -> int:
        """One 30 s window's encoder activations and the decoder's cross-attention keys and values."""
        s = self.shape
        t = s.audio_positions
        encoder = s.heads * t * t * F32 + ENCODER_BLOCKS * t * s.d_model * F32 + s.n_mels * 2 * t * F32
        cross = 2 * s.decoder_layers * t * s.d_model * F32
        return encoder + cross

    def beam_bytes(self) -> int:
        """One beam's decoder state: its self-attention cache and its logits."""
        s = self.shape
        return 2 * s.decoder_layers * (s.text_positions // 2) * s.d_model * F32 + 2 * s.vocab * F32

    def audio_bytes(self, seconds: float) -> int:
        """The whole file's samples and mel features."""
        if seconds < 0:
            raise ValueError(f"audio cannot be {seconds} s long")
        per_s = (AUDIO_COPIES * SAMPLE_RATE + MEL_FRAMES_PER_S * self.shape.n_mels) * F32
        per_s += MEL_FRAMES_PER_S * STFT_BYTES_PER_FRAME
        return math.ceil(seconds * per_s)

    def request_bytes(self, seconds: float, beam: int) -> int:
        """Peak bytes of transcribing ``seconds`` of audio with ``beam`` beams, with the
        fragmentation allowance."""
        if beam < 1:
            raise ValueError(f"beam must be >= 1 (got {beam})")
        peak = self.window_bytes() + beam * self.beam_bytes() + self.audio_bytes(seconds) + RUN_BYTES
        return peak + int(peak * self.fragmentation_ratio)
