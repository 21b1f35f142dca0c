"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (OpenAI's shape) over the
transcription service (``runtime.transcription``) through the request service's unary path.

Rules:

1. The body is ``multipart/form-data`` with one ``file`` and OpenAI's fields: ``model``,
   ``language``, ``prompt``, ``response_format`` (json, text, srt, vtt, verbose_json),
   ``temperature`` (0-1), ``timestamp_granularities[]`` (segment, word; verbose_json only)
   and ``stream``. Any other field is a 400 naming it.
2. The upload limit (the largest ``max_upload_mib`` of the transcription services, then the
   chosen service's own) is counted while the body is read: reading stops at the limit (413).
3. The upload is stored once, fsynced, under the state folder by its SHA-256
   (``uploads/<sha256>``) before the request is accepted, and checked by the one decoder
   (``engine.audio``): not audio, no samples, truncated is a 400 naming ``file``; longer
   than ``max_audio_s`` a 413. The journaled body names the upload by its digest, so a
   replay after a restart, or an Idempotency-Key retry, transcribes the same bytes, and a
   key reused with another file is a 422.
4. An upload is deleted once nothing holds it: its HTTP request holds it from the moment it
   is stored until that request is answered (a refusal, a stored answer for its key, its
   own answer), and each run of a request holds it while it runs. Requests that send the
   same bytes share one file, and none of them deletes it while another holds it. A client
   that retries (with its key) sends the file again. What a crash leaves (an accepted
   request, whose replay after the restart reads it) is not deleted while the start-up's
   orphans wait for their replay; the replay's end deletes it, or the sweep at a start once
   it is older than ``[journal].retention_s``.
5. Every answer carries ``X-Spillover-*`` headers; ``json`` and ``verbose_json`` also carry
   the ``spillover`` object (route, degraded, reason, attempts). An answer computed on the
   CPU path is degraded.
6. ``/v1/audio/translations`` asks the model to translate into English: a 400
   ``model_not_supported`` for an English-only model (``*.en``), which cannot.
7. ``stream=true`` (with ``json`` or ``text``) answers in OpenAI's streamed transcription
   events: a ``transcript.text.delta`` per segment as it is decoded (with the segment's id
   and times; the first, and the first after a failover, with the ``spillover`` object),
   then ``transcript.text.done`` with the whole text, usage and the ``spillover`` object,
   then ``[DONE]``. A failover mid-stream continues only where the
   replay is provably the same (``runtime.transcription`` rule 5); the stream is journaled
   whole, so an Idempotency-Key retry gets the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from spillover.errors import (
    ClientDisconnected,
    InvalidRequest,
    PayloadTooLarge,
    SpilloverError,
    UnsupportedMediaType,
    to_http,
)
from spillover.http.fields import model_field
from spillover.http.routes import content_codings, signal_headers
from spillover.runtime.run import Encoded
from spillover.runtime.unary import SSE, Emit, OnMove, UnaryEndpoint

log = logging.getLogger("spillover.audio")

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway
    from spillover.runtime.transcription import Transcript, TranscriptionService

__all__ = ["UploadHold", "audio_endpoints", "read_audio_form", "sweep_uploads"]

JSON = "application/json"
FORMATS = {"json": JSON, "verbose_json": JSON, "text": "text/plain; charset=utf-8",
           "srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8"}  # fmt: skip
FIELDS = ("model", "language", "prompt", "response_format", "temperature", "timestamp_granularities", "stream")
MAX_PROMPT_CHARS = 4000
COPY_CHUNK = 1 << 20
TAIL_BYTES = 256  # of a multipart body, kept to tell a cut-short one (its closing boundary missing)
LANGUAGE_NAMES = {
    "en": "english", "de": "german", "es": "spanish", "fr": "french", "it": "italian", "ja": "japanese",
    "nl": "dutch", "pl": "polish", "pt": "portuguese", "ru": "russian", "zh": "chinese", "ko": "korean",
}  # fmt: skip


@dataclass(frozen=True)
class TranscribeRequest:
    """A validated transcription request; ``upload`` is its audio's SHA-256."""

    model: str
    service: str
    upload: str
    seconds: float
    task: str
    language: str | None
    prompt: str | None
    temperature: float
    response_format: str
    granularities: tuple[str, ...]
    stream: bool = False


def uploads_dir(gw: Gateway) -> Path:
    return gw.cfg.state_path() / "uploads"


def _limit_bytes(gw: Gateway) -> int:
    mibs = [s.max_upload_mib for s in gw.cfg.services if s.kind == "transcription"]
    return max(mibs, default=25) * 1024 * 1024


class UploadHold:
    """Uploads held by one HTTP request until it is answered, or by one run while it runs
    (rule 4): ``with UploadHold(gw) as hold``, and ``hold.take(digest)`` inside; leaving the
    block releases them, and deletes each that nothing else holds then."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.digests: list[str] = []

    def __enter__(self) -> UploadHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def take(self, digest: str) -> None:
        self.digests.append(digest)
        self.gw.upload_holds[digest] = self.gw.upload_holds.get(digest, 0) + 1

    def release(self) -> None:
        """Let go of the uploads: each goes unless another request or run holds it."""
        digests, self.digests = self.digests, []
        holds = self.gw.upload_holds
        for digest in digests:
            holds[digest] -= 1
            if not holds[digest]:
                del holds[digest]
            _forget_upload(self.gw, digest)


async def read_audio_form(request: Request, gw: Gateway, task: str, hold: UploadHold) -> dict[str, Any]:
    """Rules 1-3: the multipart body as the journaled body (the upload stored by digest and
    held by ``hold`` until the request is answered: rule 4)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):  # a media type's name has no case
        raise InvalidRequest("the body must be multipart/form-data with a 'file' part (OpenAI's audio API)")
    codings = content_codings(request)
    if codings:  # an upload is read as it is: audio is compressed already
        raise UnsupportedMediaType(
            f"Content-Encoding {', '.join(codings)} is not supported for an upload: send it as it is",
            param="Content-Encoding",
        )
    limit = _limit_bytes(gw)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"the upload of {declared} bytes exceeds the {limit // (1024 * 1024)} MiB limit", param="file"
        )
    seen = 0
    tail = b""  # the body's last bytes: whether it ended with the closing boundary

    async def receive() -> Message:  # rule 2: counted as it arrives
        nonlocal seen, tail
        msg = await request.receive()
        if msg["type"] == "http.request":
            chunk = msg.get("body", b"")
            seen += len(chunk)
            tail = (tail + chunk)[-TAIL_BYTES:]
            if seen > limit:
                raise PayloadTooLarge(f"the upload exceeds the {limit // (1024 * 1024)} MiB limit", param="file")
        return msg

    from starlette.exceptions import HTTPException
    from starlette.formparsers import MultiPartException

    try:
        form = await Request(request.scope, receive).form(max_files=1, max_fields=32, max_part_size=64 * 1024)
    except ClientDisconnect as exc:  # gone mid-upload (or its body broke: http/server.py rule 7): no traceback
        raise ClientDisconnected("the client went away before its upload ended", param="file") from exc
    except MultiPartException as exc:  # the form that carries the upload: named ``file``, as a bad upload is
        raise InvalidRequest(f"the multipart body cannot be read: {exc.message}", param="file") from exc
    except HTTPException as exc:  # Starlette's own 400 for the same, inside an app: it had no code
        raise InvalidRequest(f"the multipart body cannot be read: {exc.detail}", param="file") from exc
    try:
        body: dict[str, Any] = {"task": task}
        granularities: list[str] = []
        for key, value in form.multi_items():
            name = key.removesuffix("[]")
            if name == "file":
                continue
            if name not in FIELDS:
                raise InvalidRequest(f"unknown field '{key}'", param=key)
            if not isinstance(value, str):
                raise InvalidRequest(f"'{name}' must be a text field, not a file", param=name)
            if name == "timestamp_granularities":
                granularities.append(value)
            elif name in body:
                raise InvalidRequest(f"'{name}' is given twice", param=name)
            else:
                body[name] = value
        if granularities:
            body["timestamp_granularities"] = granularities
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            if not _closed(ctype, tail):
                raise InvalidRequest(
                    "the multipart body ended before its closing boundary, so its 'file' part was cut off:"
                    " check the Content-Length",
                    param="file",
                )
            raise InvalidRequest("'file' is required: the audio, as a file part", param="file")
        folder = uploads_dir(gw)
        part, digest, size = await asyncio.to_thread(_write, upload, folder)
        hold.take(digest)  # before it is in place: no other request's end can delete it from here
        try:
            _place(part, folder / digest)
        except OSError:
            part.unlink(missing_ok=True)
            raise
        if size == 0:
            raise InvalidRequest("the file is empty (0 bytes): send the audio to transcribe", param="file")
        body["file"] = {"sha256": digest, "bytes": size, "name": (upload.filename or "audio")[:200]}
        model = model_field(body)
        svc = _service(gw, model)
        if size > svc.cfg.max_upload_mib * 1024 * 1024:
            raise PayloadTooLarge(f"the upload exceeds {svc.name}'s {svc.cfg.max_upload_mib} MiB limit", param="file")
        body["duration_s"] = await _check_audio(gw, svc, digest)
        return body
    finally:
        await form.close()


def _closed(ctype: str, tail: bytes) -> bool:
    """Whether a multipart body's last bytes hold its closing boundary (``--<boundary>--``)."""
    params = (p.strip() for p in ctype.split(";")[1:])
    boundary = next((p.split("=", 1)[1].strip('"') for p in params if p.lower().startswith("boundary=")), "")
    return not boundary or f"--{boundary}--".encode("latin-1", "replace") in tail


def _write(upload: UploadFile, folder: Path) -> tuple[Path, str, int]:
    """Rule 3: copy the upload to a part file in ``folder``, fsynced; (its path, the upload's
    SHA-256, its size). ``_place`` puts it where its digest says."""
    folder.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    part = folder / f".part-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with open(part, "wb") as out:
            upload.file.seek(0)
            while chunk := upload.file.read(COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return part, h.hexdigest(), size


def _place(part: Path, path: Path) -> None:
    """The written upload under its digest (renamed into place: the same bytes as any file
    already there), young again for the sweep (rule 4)."""
    os.replace(part, path)
    os.utime(path)


async def _check_audio(gw: Gateway, svc: TranscriptionService, digest: str) -> float:
    """Rule 3: decode once; its length in seconds, or the 400/413."""
    from spillover.engine.audio import BadAudio, decode

    try:
        got = await asyncio.to_thread(decode, str(uploads_dir(gw) / digest), max_s=svc.cfg.max_audio_s)
    except BadAudio as exc:
        err: SpilloverError = InvalidRequest(f"the audio cannot be transcribed: {exc}", param="file")
        if exc.reason == "too_long":
            err = PayloadTooLarge(f"the audio is too long: {exc}", param="file")
        raise err from exc
    return round(got.duration_s, 3)


def _service(gw: Gateway, model: str) -> TranscriptionService:
    from spillover.runtime.transcription import TranscriptionService

    served = gw.registry.resolve(model, "transcription")
    svc = gw.services[served.id]
    assert isinstance(svc, TranscriptionService)
    return svc


def parse(body: Any, gw: Gateway) -> TranscribeRequest:
    """Rule 1 on a stored body (the upload must still be there)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a form")
    model = model_field(body)
    svc = _service(gw, model)
    task = body.get("task", "transcribe")
    if task == "translate" and svc.english_only:
        raise InvalidRequest(
            f"{svc.name} is an English-only model: it cannot translate; use /v1/audio/transcriptions",
            param="model",
            code="model_not_supported",
        )
    fmt = body.get("response_format", "json")
    if fmt not in FORMATS:
        raise InvalidRequest(f"'response_format' must be one of {', '.join(FORMATS)}", param="response_format")
    language = body.get("language") or None
    if language is not None:
        if not (isinstance(language, str) and language.isascii() and language.isalpha() and 2 <= len(language) <= 3):
            raise InvalidRequest("'language' must be an ISO-639-1 code such as 'en'", param="language")
        language = language.lower()
        if svc.english_only and language != "en":
            raise InvalidRequest(f"{svc.name} is an English-only model: 'language' must be 'en'", param="language")
    prompt = body.get("prompt") or None
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", param="prompt")
    temperature = _temperature(body.get("temperature"))
    granularities = tuple(body.get("timestamp_granularities", ()))
    for g in granularities:
        if g not in ("word", "segment"):
            raise InvalidRequest(
                "'timestamp_granularities[]' values are 'word' and 'segment'", param="timestamp_granularities[]"
            )
    if granularities and fmt != "verbose_json":
        raise InvalidRequest(
            "'timestamp_granularities[]' needs response_format 'verbose_json'", param="timestamp_granularities[]"
        )
    stream = str(body.get("stream", "false")).lower()
    if stream not in ("true", "false", "1", "0"):
        raise InvalidRequest("'stream' must be true or false", param="stream")
    if stream in ("true", "1") and fmt not in ("json", "text"):
        raise InvalidRequest("'stream' needs response_format 'json' or 'text'", param="stream")
    upload = body.get("file")
    if not isinstance(upload, dict) or not isinstance(upload.get("sha256"), str):
        raise InvalidRequest("'file' is required: the audio, as a file part", param="file")
    if not (uploads_dir(gw) / upload["sha256"]).is_file():
        raise InvalidRequest(
            "the request's stored upload is gone (swept after retention_s): send it again", param="file"
        )
    seconds = body.get("duration_s")
    if not isinstance(seconds, (int, float)):
        raise InvalidRequest("'file' was not checked as audio", param="file")
    return TranscribeRequest(model, svc.name, upload["sha256"], float(seconds), str(task), language, prompt,
                             temperature, str(fmt), granularities, stream in ("true", "1"))  # fmt: skip


def _temperature(raw: Any) -> float:
    if raw is None or raw == "":
        return 0.0
    try:
        t = float(raw)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest("'temperature' must be a number from 0 to 1", param="temperature") from exc
    if not 0.0 <= t <= 1.0 or math.isnan(t):
        raise InvalidRequest("'temperature' must be a number from 0 to 1", param="temperature")
    return t


def _timestamp(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    """SubRip (numbered cues, comma milliseconds) or WebVTT (a header, dot milliseconds)."""
    cues = []
    for i, s in enumerate(segments, start=1):
        sep = "," if fmt == "srt" else "."
        timing = f"{_timestamp(s['start'], sep)} --> {_timestamp(s['end'], sep)}"
        text = str(s["text"]).strip().replace("-->", "->")
        cues.append(f"{i}\n{timing}\n{text}\n" if fmt == "srt" else f"{timing}\n{text}\n")
    return ("" if fmt == "srt" else "WEBVTT\n\n") + "\n".join(cues)


def _spillover(rid: str, req: TranscribeRequest, lane: str, reason: str, attempts: int) -> dict[str, Any]:
    return {"request_id": rid, "route": lane, "degraded": lane != "gpu", "reason": reason, "model": req.service,
            "attempts": attempts}  # fmt: skip


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def delta_frame(seg: dict[str, Any], sp: dict[str, Any] | None = None) -> bytes:
    """Rule 7: one decoded segment as a ``transcript.text.delta`` event, with the ``spillover``
    object ``sp`` when given (the stream's first delta, and one whose route or attempt changed)."""
    doc = {"type": "transcript.text.delta", "delta": seg["text"],
           "segment": {"id": seg["id"], "start": seg["start"], "end": seg["end"]}}  # fmt: skip
    return _event(doc if sp is None else {**doc, "spillover": sp})


def encode_answer(rid: str, req: TranscribeRequest, res: Transcript) -> Encoded:
    """Rules 5 and 7: the whole answer in the asked format (or a stream's last events)."""
    sp = _spillover(rid, req, res.lane, res.reason, res.attempts)
    headers = signal_headers(sp)
    usage = {"type": "duration", "seconds": math.ceil(res.duration_s)}
    if req.stream:
        done = _event({"type": "transcript.text.done", "text": res.text, "usage": usage, "spillover": sp})
        return Encoded(200, [done, b"data: [DONE]\n\n"], headers, SSE)
    if req.response_format == "text":
        return Encoded(200, [(res.text + "\n").encode()], headers, FORMATS["text"])
    if req.response_format in ("srt", "vtt"):
        return Encoded(200, [subtitles(res.segments, req.response_format).encode()], headers,
                       FORMATS[req.response_format])  # fmt: skip
    doc: dict[str, Any] = {"text": res.text}
    if req.response_format == "verbose_json":
        doc = {
            "task": req.task,
            "language": LANGUAGE_NAMES.get(res.language, res.language),
            "duration": res.duration_s,
            "text": res.text,
            "segments": [{k: v for k, v in s.items() if k != "words"} for s in res.segments],
        }
        if "word" in req.granularities:
            doc["words"] = res.words
    doc["usage"] = usage
    doc["spillover"] = sp
    return Encoded(200, [json.dumps(doc, separators=(",", ":")).encode()], headers, JSON)


def encode_error(err: SpilloverError, rid: str) -> Encoded:
    e = to_http(err, rid)
    headers = {"X-Spillover-Request-Id": rid, "X-Spillover-Route": "none", **e.headers}
    return Encoded(e.status, [json.dumps(e.body).encode()], headers, JSON, error=e.body)


async def _execute(
    gw: Gateway, rid: str, req: TranscribeRequest, attempt: int, on_move: OnMove, emit: Emit | None
) -> Encoded:
    svc = _service(gw, req.model)

    told: list[dict[str, Any]] = []  # the spillover object the stream carries now (rule 7)

    def on_segment(seg: dict[str, Any], lane: str, reason: str, attempts: int) -> None:
        assert emit is not None
        sp = _spillover(rid, req, lane, reason, attempts)
        changed = not told or told[-1] != sp
        if changed:
            told.append(sp)
        emit(delta_frame(seg, sp if changed else None), signal_headers(sp))

    fields = {
        "path": str(uploads_dir(gw) / req.upload),
        "task": req.task,
        "language": req.language,
        "prompt": req.prompt,
        "temperature": req.temperature,
        "seed": int(req.upload[:8], 16),  # a sampled decode is seeded by its audio: a replay is exact
        "words": "word" in req.granularities,
    }
    with UploadHold(gw) as hold:  # rule 4: whichever way the run ends, it lets go (a retry sends the file again)
        hold.take(req.upload)
        res = await svc.transcribe(
            rid, fields, req.seconds, attempt=attempt, on_move=on_move, on_segment=on_segment if emit else None
        )
    return encode_answer(rid, req, res)


def _forget_upload(gw: Gateway, digest: str) -> None:
    """Rule 4: delete an upload nothing holds, unless the start-up's orphans (one may be a
    transcription of it) still wait for their replay. A file that cannot be deleted is left
    to the sweep: the request it served is answered already."""
    if digest in gw.upload_holds or gw.requests.orphans:
        return
    try:
        (uploads_dir(gw) / digest).unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("upload %s: cannot delete it (%s); left to the sweep at a start", digest, exc)


def sweep_uploads(gw: Gateway, now: float | None = None) -> int:
    """Rule 4: delete uploads older than ``[journal].retention_s``; how many went."""
    folder = uploads_dir(gw)
    if not folder.is_dir():
        return 0
    cutoff = (now if now is not None else time.time()) - gw.cfg.journal.retention_s
    gone = 0
    for f in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if f.stat().st_mtime < cutoff:
                f.unlink()
                gone += 1
    return gone


def audio_endpoints(gw: Gateway) -> list[UnaryEndpoint]:
    """The unary endpoints the request service runs (and replays after a restart)."""

    def hold(req: TranscribeRequest, rid: str, deadline_s: float | None) -> None:
        svc = _service(gw, req.model)
        svc.hold_place(rid, nbytes=svc.predicted_bytes(req.seconds), work=req.seconds, deadline_s=deadline_s)

    return [
        UnaryEndpoint(
            name=name,
            kind="transcription",
            parse=functools.partial(parse, gw=gw),
            stored=dict,
            hold_place=hold,
            release_place=lambda req, rid: _service(gw, req.model).release_place(rid),
            execute=functools.partial(_execute, gw),
            error=encode_error,
            streams=lambda req: bool(req.stream),
        )
        for name in ("transcriptions", "translations")
    ]
