"""The app factory: OpenAI-compatible routes plus /health, /ready, /v1/status and /.

Every response carries ``X-Spillover-Request-Id`` and ``X-Spillover-Route``; every error
leaves through ``errors.to_http`` in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hmac
import json
import logging
import traceback
import zlib
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from spillover.errors import (
    BodyTimeout,
    ClientDisconnected,
    ConfigError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SpilloverError,
    Unauthorized,
    UnsupportedMediaType,
    to_http,
)
from spillover.http.audio import UploadHold, audio_endpoints, read_audio_form, sweep_uploads
from spillover.http.embeddings import embedding_endpoints
from spillover.http.ollama_api import OLLAMA_PREFIX, ollama_endpoints, ollama_error, ollama_routes
from spillover.http.openai import encoding_for
from spillover.http.origin import HostPolicy, OriginGuard
from spillover.http.routes import content_codings, guard, plain_json
from spillover.http.schemas import parse_chat, parse_completion, positive_ms, stored_body
from spillover.runtime.gateway import Gateway
from spillover.runtime.prepare import new_request_id
from spillover.runtime.requests import Answer, Endpoint, Refused, Run
from spillover.runtime.unary import UnaryRun

__all__ = ["create_app"]

log = logging.getLogger("spillover.http")

OPEN_PATHS = frozenset({"/health"})


def _error_response(exc: BaseException, rid: str | None = None) -> JSONResponse:
    """An error answer in OpenAI's shape; one refused before any request id was made gets a
    fresh one (the id a log line or a bug report names: never an empty header)."""
    e = to_http(exc)
    headers = dict(e.headers)
    headers["X-Spillover-Request-Id"] = rid or new_request_id()
    headers.setdefault("X-Spillover-Route", "none")
    return JSONResponse(e.body, status_code=e.status, headers=headers)


def _unrouted_error(exc: BaseException, path: str) -> Response:
    """An error answer made outside a route (a refusal of the origin guard, no such route, a
    wrong method, an unexpected error), with a fresh request id: in Ollama's shape under
    ``/api/``, as the Ollama routes' own errors are (``ollama_error``), else OpenAI's."""
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error(exc, new_request_id())
    return _error_response(exc)


async def _within(timeout_s: float, reading: Awaitable[Any]) -> Any:
    """A body read (JSON or an audio form) within ``[server].body_timeout_s``: 408 after it."""
    try:
        async with asyncio.timeout(timeout_s):
            return await reading
    except TimeoutError as exc:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g}s") from exc


# Content-Encodings a JSON body may come in: gzip and deflate (zlib; zlib's window bits 47 read
# either header); an unknown one is a 415, never bytes handed to the JSON parser as they are.
_DECOMPRESSED = frozenset({"gzip", "x-gzip", "deflate"})


class _Inflater:
    """A gzip or deflate body undone as it arrives, at most ``limit`` bytes of it; one gzip
    member after another (a valid gzip stream) as one body."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._z = zlib.decompressobj(47)

    def feed(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            try:
                part = self._z.decompress(chunk, self.limit + 1 - self.size)
            except zlib.error as exc:
                raise InvalidRequest(f"the body is not valid gzip or deflate data: {exc}") from exc
            self.size += len(part)
            out.append(part)
            if self.size > self.limit or self._z.unconsumed_tail:
                raise PayloadTooLarge(f"the request body, decompressed, exceeds the {self.limit}-byte limit")
            chunk = self._z.unused_data if self._z.eof else b""  # the next member, if any
            if chunk:
                self._z = zlib.decompressobj(47)
        return b"".join(out)

    def end(self) -> None:
        if not self._z.eof:
            raise InvalidRequest("the body is not valid gzip or deflate data: it ends early")


def _inflater(request: Request, limit: int) -> _Inflater | None:
    """The body's decoder for its ``Content-Encoding``, or None for ``identity``."""
    codings = content_codings(request)
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in _DECOMPRESSED:
        return _Inflater(limit)
    raise UnsupportedMediaType(
        f"Content-Encoding {', '.join(codings)} is not supported: send the body as it is, or gzip or deflate it",
        param="Content-Encoding",
    )


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _one_value_a_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once. JSON leaves a repeated key's meaning open and
    Python keeps the last value: ``{"model": "a", "model": "b"}`` was served by ``b``, which a
    proxy that checks the first one would let through unseen."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return out


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON: at most ``limit`` bytes (counted while reading), and at most ``limit``
    once a gzip or deflate ``Content-Encoding`` is undone (also counted while reading)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                raise PayloadTooLarge(f"request body of {cl} bytes exceeds the {limit}-byte limit")
        except ValueError as exc:
            raise InvalidRequest("bad Content-Length header") from exc
    inflater = _inflater(request, limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
            chunks.append(chunk if inflater is None else inflater.feed(chunk))
    except ClientDisconnect as exc:  # gone mid-body (or its body broke: http/server.py rule 7): no traceback
        raise ClientDisconnected("the client went away before its request body ended") from exc
    if inflater is not None:
        inflater.end()
    try:
        return json.loads(b"".join(chunks), object_pairs_hook=_one_value_a_key)
    except DuplicateKey as exc:
        raise InvalidRequest(f"the body gives {exc.key!r} twice in one object: send it once", param=exc.key) from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, too many digits, too deep
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequest(f"the body is not valid JSON: {detail}") from exc


_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def _one_header(request: Request, name: str) -> str | None:
    """A header the request may carry once, without the whitespace around it (HTTP's optional
    whitespace is not part of a value); two of it are ambiguous: 400."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name} is given {len(values)} times: send it once", param=name)
    return values[0].strip(" \t") if values else None


def _deadline_header(request: Request) -> int | None:
    """``X-Spillover-Deadline-Ms``: the client's completion deadline, in ms from now."""
    raw = _one_header(request, "X-Spillover-Deadline-Ms")
    if raw is None:
        return None
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else -1
    return positive_ms(value, "X-Spillover-Deadline-Ms")


def _idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header: 1-255 visible ASCII characters, else 400."""
    key = _one_header(request, "Idempotency-Key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not set(key) <= _KEY_CHARS:
        raise InvalidRequest("Idempotency-Key must be 1-255 visible ASCII characters", param="Idempotency-Key")
    return key


class ClosingStream(StreamingResponse):
    """A streaming response that always closes its body when it ends, a client's disconnect
    included: the request it carries then ends (and is journaled) at once, not whenever the
    garbage collector finalizes the abandoned generator."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await asyncio.shield(aclose())


class _Client:
    """Whether a request's client is still there, while its answer is made: once it goes away
    (``http.disconnect``), the run it watches is cancelled, not by the user (resumable with
    its key). Its body has been read whole before this listens."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._listening: asyncio.Task[None] | None = None

    def watch(self, run: Run | UnaryRun) -> None:
        """Listen for the client's going away from now on, on ``run``'s behalf (once)."""
        if self._listening is None:
            self._listening = asyncio.create_task(self._listen(run))

    async def _listen(self, run: Run | UnaryRun) -> None:
        try:
            while (await self._request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server could not say: the client is taken to be there
            log.debug("receive() failed while watching for a disconnect", exc_info=True)
            return
        run.cancel(by_user=False)

    def stop(self) -> None:
        if self._listening is not None:
            self._listening.cancel()


def create_app(gw: Gateway) -> GatewayLifespan:
    """Build the ASGI app around a started (or starting) Gateway."""
    cfg = gw.cfg
    for ep in ollama_endpoints(gw):
        gw.requests.register(ep)
    for unary in (*embedding_endpoints(gw), *audio_endpoints(gw)):
        gw.requests.register(unary)
    for name, parse in (("chat", parse_chat), ("text", parse_completion)):  # also what recovery replays
        gw.requests.register(
            Endpoint(
                name,
                parse=functools.partial(parse, default_model=cfg.model.name, ignored=cfg.server.ignored_fields),
                stored=functools.partial(stored_body, kind=name),
                encoding=encoding_for,
            )
        )
    api_key = cfg.server.api_key.encode()

    def authorize(request: Request) -> None:
        if not api_key or request.url.path in OPEN_PATHS:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
            raise Unauthorized("a valid 'Authorization: Bearer <key>' header is required")

    guarded = guard(authorize, _error_response)  # the API key, and errors OpenAI-shaped

    async def _json_body(request: Request) -> Any:
        return await _read_json(request, cfg.server.max_body_bytes)

    async def _bounded_json(request: Request) -> Any:
        """A JSON body read as a generation request's is, outside ``generate``."""
        return await _within(cfg.server.body_timeout_s, _json_body(request))

    async def generate(
        request: Request,
        endpoint: str,
        refuse: Callable[[SpilloverError, str], Response] = _error_response,
        read: Callable[[Request], Awaitable[Any]] = _json_body,
    ) -> Response:
        """HTTP in, the request service's answer out: nothing here decides anything.
        ``refuse`` shapes an error before acceptance (OpenAI's, or Ollama's); ``read`` turns
        the body into the request's (JSON, or an audio form)."""
        try:
            authorize(request)
            body = await _within(cfg.server.body_timeout_s, read(request))
            key = _idempotency_key(request)
            deadline_ms = _deadline_header(request)
        except SpilloverError as exc:  # refused before acceptance: counted, nothing journaled
            gw.metrics.request_refused(exc)
            return refuse(exc, new_request_id())
        client = _Client(request)  # a client that goes away stops its request (resumable)
        try:
            try:
                got = await gw.requests.submit(
                    endpoint, body, idem_key=key, deadline_ms=deadline_ms, on_live=client.watch
                )
            except Refused as exc:
                if exc.answer is not None:  # refused as it was queued: its journaled error
                    return _answer(exc.answer)
                gw.metrics.request_refused(exc.error)
                return refuse(exc.error, exc.rid)
            if isinstance(got, Answer):  # a stored answer, or a whole one (embeddings, transcription)
                return _answer(got)
            client.watch(got)
            reply = await got.reply()
        finally:
            client.stop()
        if isinstance(reply, Answer):
            return _answer(reply)
        return ClosingStream(reply.frames, media_type=reply.content_type, headers=reply.headers)

    def _answer(a: Answer) -> Response:
        return Response(a.body, status_code=a.status, headers=a.headers, media_type=a.content_type)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "text")

    @guarded
    async def models(request: Request) -> Response:
        return plain_json({"object": "list", "data": gw.registry.listing()})

    @guarded
    async def model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if not model_id:  # /v1/models/: no route, as any other trailing slash (``on_http_exception``)
            raise HTTPException(404)
        return plain_json(gw.registry.retrieve(model_id))

    async def embeddings(request: Request) -> Response:
        return await generate(request, "embeddings")

    async def audio(request: Request, endpoint: str, task: str) -> Response:
        """An audio form's request: its upload is held until it is answered (``http.audio`` rule 4)."""
        with UploadHold(gw) as hold:
            read = functools.partial(read_audio_form, gw=gw, task=task, hold=hold)
            return await generate(request, endpoint, read=read)

    async def transcriptions(request: Request) -> Response:
        return await audio(request, "transcriptions", "transcribe")

    async def translations(request: Request) -> Response:
        return await audio(request, "translations", "translate")

    async def health(request: Request) -> Response:
        return plain_json({"status": "ok"})

    @guarded
    async def ready(request: Request) -> Response:
        ok = gw.ready()
        return plain_json({"ready": ok}, 200 if ok else 503)

    @guarded
    async def status(request: Request) -> Response:
        return plain_json(gw.status())

    async def index(request: Request) -> Response:  # keyless: static, no data; its JS sends the key
        page = resources.files("spillover.http").joinpath("static/status.html").read_text("utf-8")
        return HTMLResponse(page, headers={"X-Spillover-Request-Id": new_request_id(), "X-Spillover-Route": "none"})

    @guarded
    async def get_request(request: Request) -> Response:
        return plain_json(await _request_document(request.path_params["rid"]))

    @guarded
    async def delete_request(request: Request) -> Response:
        rid = request.path_params["rid"]
        await gw.requests.cancel(rid)  # returns once its end is journaled (bounded wait)
        return plain_json(await _request_document(rid))

    async def _request_document(rid: str) -> dict[str, Any]:
        if gw.journal is not None and rid in gw.requests.live:
            await gw.journal.flush()  # its noted moves (journal rule 7) are in what is read
        rec = await gw.journal.get(rid) if gw.journal else None
        if rec is None or gw.journal is None:
            raise NotFound(f"no request {rid!r} in the journal", code="request_not_found")
        response: Any = None
        if rec.response is not None:
            text = rec.response.decode("utf-8", "replace")
            response = json.loads(text) if rec.content_type == "application/json" else text
        return {
            "object": "spillover.request",
            "id": rec.id,
            "state": rec.state.value,
            "kind": rec.kind,
            "stream": rec.stream,
            "model": rec.model,
            "route": rec.route,
            "attempts": rec.attempts,
            "reason": rec.reason,
            "tokens_delivered": rec.tokens_delivered,
            "created": rec.created_s,
            "finished": rec.finished_s,
            "status_code": rec.status_code,
            "live": rid in gw.requests.live,
            # unfinished before a restart, and start-up recovery has not replayed or ended it yet
            "recovering": not gw.recovery_ended and rid in gw.requests.orphans and rid not in gw.requests.live,
            "history": await gw.journal.history(rid),
            "response": response,
            "error": json.loads(rec.error) if rec.error else None,
        }

    @guarded
    async def responses(request: Request) -> Response:
        # Decided: not served (README, "Endpoints"). A clear 404 naming what is, so an agent
        # that probes for the Responses API falls back to Chat Completions at once.
        raise NotFound(
            "the Responses API (/v1/responses) is not served here; use /v1/chat/completions "
            "(or /v1/completions, or Ollama's /api/chat and /api/generate)",
            code="endpoint_not_supported",
        )

    @guarded
    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        path = request.url.path
        if exc.status_code == 404:  # a trailing slash is not redirected (a 307 with no body): named
            hint = f" (without the trailing slash: {path.rstrip('/')})" if len(path) > 1 and path.endswith("/") else ""
            return _unrouted_error(NotFound(f"no route {request.method} {path}{hint}"), path)
        client = 400 <= exc.status_code < 500  # Starlette's own refusals: a code, never internal_error
        code = "method_not_allowed" if exc.status_code == 405 else "invalid_request" if client else None
        err = SpilloverError(str(exc.detail), code=code)
        err.status = exc.status_code
        err.type = "invalid_request_error"
        response = _unrouted_error(err, path)
        response.headers.update(exc.headers or {})  # a 405's Allow, as HTTP asks
        return response

    async def on_error(request: Request, exc: Exception) -> Response:
        return _unrouted_error(exc, request.url.path)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
        Route("/v1/audio/translations", translations, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST", "GET"]),
        Route("/v1/responses/{rest:path}", responses, methods=["POST", "GET", "DELETE"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/v1/requests/{rid}", get_request, methods=["GET"]),
        Route("/v1/requests/{rid}", delete_request, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/", index, methods=["GET"]),
        *ollama_routes(gw, generate, guard(authorize, ollama_error), _bounded_json),
    ]

    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(
                OriginGuard,
                policy=HostPolicy.from_config(cfg.server),
                refuse=_unrouted_error,
                on_refused=gw.metrics.request_refused,  # counted as every refusal before acceptance
            )
        ],
        exception_handlers={HTTPException: on_http_exception, Exception: on_error},
    )
    # Starlette answers a path with a trailing slash by a bare 307 to the one without: clients
    # that do not follow it (for a POST, most) saw an empty answer. It is a 404 that says so.
    app.router.redirect_slashes = False
    return GatewayLifespan(app, gw)


OPERATOR_ERRORS = (ConfigError,)  # a start failing on what the operator gave: said in one line


class GatewayLifespan:
    """The app, with the gateway's start and stop as its ASGI lifespan.

    A start that fails is reported in one line (uvicorn logs the lifespan's failure message as
    it is; Starlette's own lifespan sends a whole traceback): what was wrong, for an error in
    what the operator gave (a config error, a model file that cannot be read); a traceback only
    for anything else. What the start had made is stopped, and ``start_error`` keeps the
    error for the command line's exit status (``cli``)."""

    def __init__(self, app: Starlette, gw: Gateway) -> None:
        self.app = app
        self.gw = gw
        self.start_error: BaseException | None = None
        # Set by ``spillover serve``, whose process is the gateway's alone: a process hosting
        # others (a test's) would keep their garbage cycles for ever.
        self.freeze_gc = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        await receive()  # lifespan.startup
        try:
            await self.gw.start()
            await asyncio.to_thread(sweep_uploads, self.gw)
        except Exception as exc:
            self.start_error = exc
            with contextlib.suppress(Exception):
                await self.gw.stop()
            text = f"spillover could not start: {exc}"
            if not isinstance(exc, OPERATOR_ERRORS):
                text += "\n" + "".join(traceback.format_exception(exc))
            await send({"type": "lifespan.startup.failed", "message": text})
            return
        if self.freeze_gc:
            # What the start made (models' metadata, the templates, the app) lives as long as the
            # gateway: moved out of the collector's generations, a full collection no longer walks
            # it (issue 13 item 5: one took 32 ms of the event loop's time among 600 embeddings).
            gc.collect()
            gc.freeze()
        await send({"type": "lifespan.startup.complete"})
        try:
            await receive()  # lifespan.shutdown
        except asyncio.CancelledError:
            # uvicorn's forced exit (a second Ctrl-C) sends no shutdown event: the loop's end
            # cancels this task instead. The workers are stopped all the same, never left running
            # (the cancel is taken back first: the stop's own waits must not end at once). The
            # lifespan then ends as a finished one: the loop is ending anyway.
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            await self.gw.stop()
            return
        try:
            await self.gw.stop()
        except Exception:
            await send({"type": "lifespan.shutdown.failed", "message": traceback.format_exc()})
        else:
            await send({"type": "lifespan.shutdown.complete"})
