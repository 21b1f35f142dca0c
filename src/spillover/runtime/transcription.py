"""The transcription service: a ``runtime.service.DeviceService`` whose requests are stored
audio uploads and whose answer is the worker's ``AudioInfo`` and ``Segment`` events.

Rules (beside the service's own):

1. A request's device bytes are ``core.transcribe_memory``'s prediction for its audio's
   length and beam count; its GPU weights are the model's at float16 (what ``cuda`` runs).
2. Its work, for the ETA, is the audio's seconds: each lane's speed is measured as a
   real-time factor (seconds of work per second of audio).
3. A worker's ``bad_audio`` failure is the request's own (a 400), never a failover.
4. The same upload with the same fields gives the same text on every worker of the same
   compute type (``engine.transcribe_worker`` rule 2), so a failover replays it whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.core.transcribe_memory import TranscribeMemoryModel
from spillover.errors import InvalidRequest, WorkerFailed
from spillover.runtime.events import AudioInfo, Segment
from spillover.runtime.service import DeviceService

if TYPE_CHECKING:
    from spillover.core.transcribe_memory import WhisperShape

__all__ = ["Transcript", "TranscriptionService"]


@dataclass(frozen=True)
class Transcript:
    """A finished transcription and where it was computed."""

    language: str
    duration_s: float
    segments: list[dict[str, Any]]
    lane: str
    reason: str
    attempts: int
    words: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(s["text"] for s in self.segments).strip()


class TranscriptionService(DeviceService):
    """One ``[[services]]`` entry of kind ``transcription``."""

    kind = "transcription"
    op = "transcribe"
    unit = "seconds of audio"
    initial_rate = {"gpu": 0.2, "cpu": 0.3}  # real-time factors until measured

    shape: WhisperShape | None = None
    memory: TranscribeMemoryModel | None = None
    english_only = True

    async def load_model(self) -> None:
        from spillover.engine.whisper_meta import default_whisper_model_dir, read_whisper_shape

        self.model_dir = self.cfg.path or await asyncio.to_thread(default_whisper_model_dir)
        self.shape = await asyncio.to_thread(read_whisper_shape, self.model_dir)
        self.memory = TranscribeMemoryModel(self.shape, self.gw.cfg.admission.fragmentation_ratio)
        self.english_only = self.shape.vocab < 51865  # the multilingual vocabularies are 51865+

    def weights_bytes(self) -> int:
        return self.memory.weights_bytes("float16") if self.memory else 0

    def probe_bytes(self) -> int:
        return self.predicted_bytes(5.0)

    def predicted_bytes(self, seconds: float) -> int:
        return self.memory.request_bytes(seconds, self.cfg.beam_size) if self.memory else 0

    def request_error(self, kind: str, message: str) -> None:
        if kind == "bad_audio":  # rule 3
            raise InvalidRequest(f"the audio cannot be transcribed: {message}", param="file")

    async def transcribe(
        self,
        rid: str,
        fields: dict[str, Any],
        seconds: float,
        *,
        attempt: int,
        on_move: Callable[[str, dict[str, Any]], Awaitable[None]],
    ) -> Transcript:
        """Transcribe a stored upload (``fields``: the worker op's) on whichever lane takes it."""
        got = await self.serve(
            rid,
            {**fields, "beam_size": self.cfg.beam_size, "max_s": self.cfg.max_audio_s},
            nbytes=self.predicted_bytes(seconds),
            work=max(seconds, 0.1),
            attempt=attempt,
            on_move=on_move,
        )
        info = next((p for p in got.parts if isinstance(p, AudioInfo)), None)
        if info is None:
            raise WorkerFailed(f"the {got.lane} worker ended without a transcript", retry_after_s=1.0)
        segments = [p.data for p in got.parts if isinstance(p, Segment)]
        words = [w for s in segments for w in s.get("words", ())]
        return Transcript(info.language, info.duration_s, segments, got.lane, got.reason, got.attempts, words)
