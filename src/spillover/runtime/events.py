"""Typed events: what a worker says about a request, and what a supervisor says about its
worker. Worker lines are decoded once, here (``decode_request_event``); nothing above the
worker channel looks at raw JSON or matches free text.

Rules:

1. A request's stream is ``Started``, then ``Token``s (chat), ``Progress`` after each chunk but
   the last and one ``Vectors`` (embeddings), or one ``AudioInfo`` and ``Segment``s
   (transcription), then exactly one of ``Done`` or
   ``Failed`` (the worker's own last word, sent once its slot and device memory are free),
   or ``WorkerGone`` when the process ends first. ``Interrupted`` is put in the stream by
   the gateway itself when it stops the request; the worker's last word still follows.
2. A line that is not a known request event is ``None`` (ignored, and logged by the caller).
3. Supervisor events have a kind from ``SupervisorEventKind`` and a human ``detail``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "AudioInfo",
    "Done",
    "Failed",
    "Interrupted",
    "Progress",
    "RequestEvent",
    "Segment",
    "Started",
    "SupervisorEvent",
    "SupervisorEventKind",
    "Token",
    "TokenLogprob",
    "Vectors",
    "WorkerGone",
    "decode_request_event",
]


@dataclass(frozen=True)
class Started:
    """The worker has the request's memory and begins (prefill)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A token as OpenAI's ``logprobs`` names it: its text, bytes and log-probability."""

    token: str
    bytes: tuple[int, ...]
    logprob: float

    @staticmethod
    def decode(raw: Any) -> TokenLogprob:
        b = bytes(int(x) for x in raw[1])
        return TokenLogprob(b.decode("utf-8", "replace"), tuple(b), float(raw[2]))


@dataclass(frozen=True)
class Token:
    """One generated token (``id`` -1: text released at the end, no new token), with its
    log-probability and the likeliest alternatives when the request asked for them; or
    several plain tokens the worker sent as one event (``ids``: each one's id, in order;
    ``id`` the last one's, ``text`` all of theirs)."""

    id: int
    text: str
    logprob: TokenLogprob | None = None
    top: tuple[TokenLogprob, ...] = ()
    ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every generated token the event carries, in order (none: text released at the end)."""
        if self.ids:
            return self.ids
        return (self.id,) if self.id >= 0 else ()


@dataclass(frozen=True)
class Vectors:
    """An embeddings request's vectors: ``n`` rows of ``dim`` float32 (little-endian) values."""

    n: int
    dim: int
    data: bytes


@dataclass(frozen=True)
class AudioInfo:
    """A transcription's language (heard or given) and its audio's length in seconds."""

    language: str
    duration_s: float


@dataclass(frozen=True)
class Progress:
    """A step of a request is done and more follow (an embeddings chunk: ``done`` inputs so far):
    what the gateway's stall bound is reset by (``runtime.service`` rule 3)."""

    done: int


@dataclass(frozen=True)
class Segment:
    """One decoded transcription segment, as OpenAI's ``verbose_json`` names its fields."""

    data: dict[str, Any]


@dataclass(frozen=True)
class Done:
    """The request ended normally; the worker's timings feed the lane's speed estimate."""

    finish_reason: str
    completion_tokens: int
    prefill_s: float
    total_s: float


@dataclass(frozen=True)
class Failed:
    """The worker ended the request with an error of ``kind`` (alloc_failed, oom, engine, ...)."""

    kind: str
    message: str


@dataclass(frozen=True)
class Interrupted:
    """The gateway stopped the request (cancel, time limit); the worker's last word follows."""


@dataclass(frozen=True)
class WorkerGone:
    """Queued to every in-flight request when the worker process ends."""

    kind: str  # "exited" | "hung" (killed for it) | "device_lost" | "not_ready" | ...
    message: str


RequestEvent = Started | Token | Progress | Vectors | AudioInfo | Segment | Done | Failed | Interrupted | WorkerGone
FINAL = (Done, Failed, WorkerGone)  # rule 1: what ends a request's stream


def decode_request_event(msg: dict[str, Any]) -> RequestEvent | None:
    """A worker line about one request as a typed event, or None (rule 2)."""
    ev = msg.get("ev")
    try:
        if ev == "started":
            return Started()
        if ev == "token":
            lp = msg.get("lp")
            if lp is None:
                ids = msg.get("ids")
                return Token(int(msg["id"]), str(msg["text"]), ids=() if ids is None else tuple(int(i) for i in ids))
            chosen = TokenLogprob.decode([None, lp[1], lp[0]])
            return Token(int(msg["id"]), str(msg["text"]), chosen, tuple(TokenLogprob.decode(a) for a in lp[2]))
        if ev == "vectors":
            import base64

            n, dim = int(msg["n"]), int(msg["dim"])
            data = base64.b64decode(msg["data"], validate=True)
            if len(data) != n * dim * 4:
                return None
            return Vectors(n, dim, data)
        if ev == "progress":
            return Progress(int(msg["done"]))
        if ev == "audio":
            return AudioInfo(str(msg["language"]), float(msg["duration"]))
        if ev == "segment":
            seg = msg["seg"]
            if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
                return None
            return Segment(seg)
        if ev == "done":
            timings = msg.get("timings") or {}
            return Done(
                str(msg["finish_reason"]),
                int(msg["completion_tokens"]),
                float(timings.get("prefill_s", 0.0)),
                float(timings.get("total_s", 0.0)),
            )
        if ev == "error":
            return Failed(str(msg.get("kind") or "engine"), str(msg.get("message")))
    except (KeyError, TypeError, ValueError):  # binascii.Error is a ValueError
        return None
    return None


class SupervisorEventKind(str, Enum):
    """What happened to a supervised worker."""

    STARTING = "starting"
    READY = "ready"
    START_FAILED = "start_failed"
    DIED = "died"
    RESTARTING = "restarting"
    NOT_RELEASED = "not_released"  # its device memory was not seen released in time
    UNHEALTHY = "unhealthy"  # no pong: killed
    STALLED = "stalled"  # no token progress: killed by the gateway
    PARKED = "parked"  # its owner stops it for now (a demoted service): not restarted
    UNLOADED = "unloaded"  # a parked worker's process has ended: its memory is given back
    RESUMED = "resumed"  # its owner lets it start again
    SUPERVISOR_ERROR = "supervisor_error"


@dataclass(frozen=True)
class SupervisorEvent:
    """One supervisor event; ``str()`` is the line shown in /v1/status and the log."""

    kind: SupervisorEventKind
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value
