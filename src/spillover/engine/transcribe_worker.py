"""The transcription worker: one faster-whisper (CTranslate2) model serving ``transcribe`` ops.

Gateway -> worker::

    {"op": "transcribe", "rid", "path", "task", "language", "prompt", "temperature", "seed",
     "beam_size", "words", "max_s", "reserve_bytes"}

Worker -> gateway (besides ``ready``, ``pong`` and ``fatal``, as for chat)::

    {"ev": "started", "rid"}                          its device memory is granted
    {"ev": "audio", "rid", "language", "duration"}    the language heard (or given), the seconds
    {"ev": "segment", "rid", "seg": {...}}            one decoded segment, in order
    {"ev": "progress", "rid", "done"}                 a 30 s window is decoded and another begins
    {"ev": "done", "rid", "finish_reason": "stop", "prompt_tokens": 0, "completion_tokens", "timings"}
    {"ev": "error", "rid", "kind", "message"}         alloc_failed | oom | engine | cancelled | bad_audio

Rules:

1. The audio is decoded here from the stored upload by ``engine.audio.decode``, the
   gateway's own check, so every worker hears the same samples.
2. Decoding is deterministic: the given ``temperature`` only (no fallback ladder), no
   previous-text conditioning, no VAD, and at a temperature above 0 CTranslate2's sampler is
   seeded with the request's ``seed``. The same file with the same fields gives the same
   segments on the GPU worker and its CPU replica (same compute type on ``sim``; ``cuda``
   runs float16, so a failover there may word a segment differently: nothing of it was
   delivered, so the replay is still a whole, fresh answer).
3. Between segments the worker checks for a cancel, a device hang (progress stops) and, on
   ``sim``, an injected running fault (``oom``), as the embeddings worker does between chunks.
4. Each 30 s window's start (faster-whisper's ``encode``) after the first says ``progress``,
   after a cancel and hang check of its own: a window without speech gives no segment, so
   without it the gateway's stall bound had to cover all the audio after the last segment
   (a hung device went unnoticed for 305 s in a 600 s file: round 70).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from spillover.engine.worker import UnaryWorker, _error

__all__ = ["PROBE_SAMPLES", "TranscribeWorker", "compute_type"]

PROBE_SAMPLES = 8000  # the readiness probe: half a second of silence at 16 kHz


def compute_type(kind: str) -> str:
    """CTranslate2's compute type for a worker on device ``kind`` (rule 2)."""
    return "float16" if kind == "cuda" else "int8"


class _Ended(Exception):
    """A window's check found its request ended (a cancel): its last event (rule 4)."""

    def __init__(self, end: dict[str, Any]) -> None:
        super().__init__(end.get("kind"))
        self.end = end


class TranscribeWorker(UnaryWorker):
    """A transcription worker (``--kind transcription``)."""

    request_op = "transcribe"
    _decoding = threading.local()  # the request this slot's thread decodes, and its windows begun (rule 4)

    def _window(self) -> None:
        """A window begins (rule 4): after the first, ``progress``; then the cancel and hang check."""
        rid = getattr(self._decoding, "rid", None)
        if rid is None:  # the readiness probe
            return
        if self._decoding.windows:
            self.chan.send({"ev": "progress", "rid": rid, "done": self._decoding.windows})
        self._decoding.windows += 1
        if (end := self.between_steps(rid, "encoder", faults=False)) is not None:
            raise _Ended(end)

    def model_fingerprint(self) -> dict[str, str]:
        from pathlib import Path

        from spillover.engine.llama_engine import file_digest

        digest = file_digest(f"{self.args.model}/model.bin", cache_dir=Path(self.args.state_dir))
        return {
            "model": digest[:16],
            "compute_type": compute_type(self.kind),
            "backend": "cuda" if self.kind == "cuda" else "cpu",
        }

    def load_model(self) -> Any:
        from faster_whisper import WhisperModel

        index = int(self.args.device.split(":", 1)[1]) if self.kind == "cuda" else 0
        model = WhisperModel(
            self.args.model,
            device="cuda" if self.kind == "cuda" else "cpu",
            device_index=index,
            compute_type=compute_type(self.kind),
            cpu_threads=self.args.n_threads,
            num_workers=1,
            local_files_only=True,
        )
        encode = model.encode

        def each_window(features: Any) -> Any:  # faster-whisper encodes each 30 s window once (rule 4)
            self._window()
            return encode(features)

        model.encode = each_window
        return model

    def probe(self, model: Any) -> None:
        import numpy as np

        segments, _ = model.transcribe(
            np.zeros(PROBE_SAMPLES, dtype=np.float32),
            language="en",
            beam_size=1,
            temperature=[0.0],
            condition_on_previous_text=False,
            vad_filter=False,
        )
        list(segments)  # decoded lazily

    def compute(self, model: Any, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
        from spillover.engine.audio import BadAudio, decode

        self.chan.send({"ev": "started", "rid": rid})
        t0 = time.monotonic()
        try:
            audio = decode(str(msg["path"]), max_s=float(msg["max_s"]))
        except BadAudio as exc:
            return _error(rid, "bad_audio", str(exc))
        except OSError as exc:
            return _error(rid, "engine", f"the stored upload cannot be read: {exc}")
        self._decoding.rid, self._decoding.windows = rid, 0
        try:
            return self._transcribe(model, rid, msg, audio, t0)
        except _Ended as ended:
            return ended.end
        finally:
            self._decoding.rid = None

    def _transcribe(self, model: Any, rid: str, msg: dict[str, Any], audio: Any, t0: float) -> dict[str, Any]:
        temperature = float(msg.get("temperature") or 0.0)
        if temperature > 0:
            import ctranslate2

            ctranslate2.set_random_seed(int(msg.get("seed") or 0))
        segments, info = model.transcribe(
            audio.samples,
            task=str(msg.get("task") or "transcribe"),
            language=msg.get("language") or None,
            initial_prompt=msg.get("prompt") or None,
            beam_size=max(1, int(msg.get("beam_size") or 1)),
            temperature=[temperature],
            condition_on_previous_text=False,
            vad_filter=False,
            word_timestamps=bool(msg.get("words")),
        )
        self.chan.send({"ev": "audio", "rid": rid, "language": info.language, "duration": round(audio.duration_s, 3)})
        t_first: float | None = None
        tokens = 0
        for seg in segments:  # decoded lazily: one window per step
            if (end := self.between_steps(rid, "decoder")) is not None:
                return end
            t_first = t_first or time.monotonic()
            tokens += len(seg.tokens)
            self.progress += 1
            self.chan.send({"ev": "segment", "rid": rid, "seg": _segment(seg)})
        total = time.monotonic() - t0
        return {
            "ev": "done",
            "rid": rid,
            "finish_reason": "stop",
            "prompt_tokens": 0,
            "completion_tokens": tokens,
            "timings": {"prefill_s": round((t_first or t0) - t0, 6), "total_s": round(total, 6)},
        }


def _segment(seg: Any) -> dict[str, Any]:
    """A faster-whisper segment as OpenAI's ``verbose_json`` segment (plus its words)."""
    out: dict[str, Any] = {
        "id": int(seg.id) - 1,
        "seek": int(seg.seek),
        "start": round(float(seg.start), 3),
        "end": round(float(seg.end), 3),
        "text": str(seg.text),
        "tokens": [int(t) for t in seg.tokens],
        "temperature": float(seg.temperature or 0.0),
        "avg_logprob": float(seg.avg_logprob),
        "compression_ratio": float(seg.compression_ratio),
        "no_speech_prob": float(seg.no_speech_prob),
    }
    if seg.words:
        out["words"] = [
            {"word": str(w.word), "start": round(float(w.start), 3), "end": round(float(w.end), 3)} for w in seg.words
        ]
    return out
