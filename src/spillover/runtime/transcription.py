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
5. Streamed (``on_segment``), each segment is handed on as it is decoded. After a failover
   the replay's first segments must equal those already sent (text, times and tokens); they
   are not sent again and the stream continues from the first new one. A replay that
   differs (another compute type on ``cuda``) ends the request with a resumable
   ``failover_interrupted`` error instead: nothing is sent twice or changed under the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.core.transcribe_memory import TranscribeMemoryModel
from spillover.errors import FailoverInterrupted, InvalidRequest, WorkerFailed
from spillover.runtime.events import AudioInfo, Progress, RequestEvent, Segment
from spillover.runtime.service import DeviceService, StallSteps

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


WINDOW_S = 30.0  # Whisper decodes its audio in windows this long, the last one padded


def windows_s(seconds: float) -> float:
    """The audio a transcription decodes, in seconds: whole windows, at least one."""
    return WINDOW_S * max(1, math.ceil(seconds / WINDOW_S - 1e-9))


class _Windows(StallSteps):
    """A transcription's steps (``runtime.service`` rule 3), in seconds of audio: until the
    worker says what it heard, the whole file in windows (its decoding, the language's); then
    one window, since each event (a segment, a window's ``Progress``,
    ``engine.transcribe_worker`` rule 4) comes within one window's decoding. A cancelled
    attempt's worker may take as long as the audio after the last segment (``stop_units``,
    rule 4): it stops at its next window, and a wait cut to one window's average killed a
    healthy worker busy with a dense one (round 31)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(windows_s(seconds))
        self._total = seconds
        self._left = windows_s(seconds)

    @property
    def stop_units(self) -> float:
        return self._left

    def after(self, ev: RequestEvent) -> None:
        if isinstance(ev, AudioInfo):
            self._total = ev.duration_s
            self._left = windows_s(ev.duration_s)
        elif isinstance(ev, Segment):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self._left = windows_s(max(0.0, self._total - float(ev.data["end"])))
        if isinstance(ev, AudioInfo | Progress | Segment):  # ``Started`` comes before the file is decoded
            self.units = WINDOW_S


class TranscriptionService(DeviceService):
    """One ``[[services]]`` entry of kind ``transcription``."""

    kind = "transcription"
    op = "transcribe"
    initial_rate = {"gpu": 0.2, "cpu": 0.3}  # real-time factors until measured
    work_is_size = True  # its work is the file's seconds
    initial_stall_rate = 0.2  # the GPU's, for the stall bound (its units: seconds of audio)

    def stall_units(self, msg: dict[str, Any], work: float) -> float:
        return windows_s(work)

    def stall_steps(self, msg: dict[str, Any], work: float) -> StallSteps:
        return _Windows(work)

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

    def host_weights_bytes(self) -> int:
        """Its CPU replica runs int8 (``engine.transcribe_worker.compute_type``)."""
        return self.memory.weights_bytes("int8") if self.memory else 0

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
        on_segment: Callable[[dict[str, Any], str, str, int], None] | None = None,
    ) -> Transcript:
        """Transcribe a stored upload (``fields``: the worker op's) on whichever lane takes it;
        ``on_segment(segment, lane, reason, attempt)`` sees each new segment (rule 5)."""
        continuity = _Continuity(on_segment) if on_segment is not None else None
        got = await self.serve(
            rid,
            {**fields, "beam_size": self.cfg.beam_size, "max_s": self.cfg.max_audio_s},
            nbytes=self.predicted_bytes(seconds),
            work=max(seconds, 0.1),
            attempt=attempt,
            on_move=on_move,
            on_part=continuity,
        )
        if continuity is not None:
            continuity.ended(got.attempts, got.lane)
        info = next((p for p in got.parts if isinstance(p, AudioInfo)), None)
        if info is None:
            raise WorkerFailed(f"the {got.lane} worker ended without a transcript", retry_after_s=1.0)
        segments = [p.data for p in got.parts if isinstance(p, Segment)]
        words = [w for s in segments for w in s.get("words", ())]
        return Transcript(info.language, info.duration_s, segments, got.lane, got.reason, got.attempts, words)


class _Continuity:
    """Rule 5: hands on new segments; checks a replay's first ones against those sent."""

    def __init__(self, on_segment: Callable[[dict[str, Any], str, str, int], None]) -> None:
        self.on_segment = on_segment
        self.sent: list[dict[str, Any]] = []
        self.attempt = -1
        self.index = 0

    def __call__(self, ev: RequestEvent, *, lane: str, reason: str, attempt: int) -> None:
        if not isinstance(ev, Segment):
            return
        if attempt != self.attempt:
            self.attempt, self.index = attempt, 0
        i = self.index
        self.index += 1
        if i < len(self.sent):
            if not _same(self.sent[i], ev.data):
                raise FailoverInterrupted(
                    f"the replay on the {lane} worker decoded segment {i} differently from what was already "
                    "sent; the stream cannot continue unchanged: send the request again",
                    retry_after_s=1.0,
                )
            return
        self.sent.append(ev.data)
        self.on_segment(ev.data, lane, reason, attempt)

    def ended(self, attempt: int, lane: str) -> None:
        """The answer came from attempt ``attempt``: it must hold every segment already sent (a
        replay that ends sooner would leave the client with text the answer does not have)."""
        decoded = self.index if attempt == self.attempt else 0  # an attempt with no segment never set it
        if decoded < len(self.sent):
            raise FailoverInterrupted(
                f"the replay on the {lane} worker ended after {decoded} segments, and {len(self.sent)} were "
                "already sent; the stream cannot continue unchanged: send the request again",
                retry_after_s=1.0,
            )


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("text", "start", "end", "tokens"))
