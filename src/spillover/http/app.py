"""The app factory: OpenAI-compatible routes plus /health, /ready, /v1/status and /.

Every response carries ``X-Spillover-Request-Id`` and ``X-Spillover-Route``; every error
leaves through ``errors.to_http`` in the OpenAI shape.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from spillover.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SpilloverError,
    Unauthorized,
    to_http,
)
from spillover.http import generation as g
from spillover.http.schemas import GenerationRequest, parse_chat, parse_completion
from spillover.runtime.gateway import Gateway

__all__ = ["create_app"]

OPEN_PATHS = frozenset({"/health"})


def _error_response(exc: BaseException, rid: str | None = None) -> JSONResponse:
    e = to_http(exc)
    headers = dict(e.headers)
    headers["X-Spillover-Request-Id"] = rid or ""
    headers.setdefault("X-Spillover-Route", "none")
    return JSONResponse(e.body, status_code=e.status, headers=headers)


async def _read_json(request: Request, limit: int) -> Any:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                raise PayloadTooLarge(f"request body of {cl} bytes exceeds the {limit}-byte limit")
        except ValueError as exc:
            raise InvalidRequest("bad Content-Length header") from exc
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def create_app(gw: Gateway) -> Starlette:
    """Build the ASGI app around a started (or starting) Gateway."""
    cfg = gw.cfg
    api_key = cfg.server.api_key.encode()

    def authorize(request: Request) -> None:
        if not api_key or request.url.path in OPEN_PATHS:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
            raise Unauthorized("a valid 'Authorization: Bearer <key>' header is required")

    async def generate(request: Request, kind: str) -> Response:
        rid = g.new_request_id()
        try:
            authorize(request)
            body = await _read_json(request, cfg.server.max_body_bytes)
            req = (parse_chat if kind == "chat" else parse_completion)(body, cfg.model.name)
            prep = await g.prepare(gw, req, rid)
            run = await g.start(gw, prep)
        except SpilloverError as exc:
            return _error_response(exc, rid)
        if req.stream:
            return StreamingResponse(
                _stream(run, req),
                media_type="text/event-stream",
                headers=run.headers() | {"Cache-Control": "no-cache"},
            )
        try:
            await g.collect(run)
            tool_calls = g.tool_calls_from(run) if kind == "chat" else None
        except SpilloverError as exc:
            e = to_http(exc)
            return JSONResponse(e.body, status_code=e.status, headers=run.headers() | e.headers)
        return JSONResponse(_final_body(run, req, tool_calls), headers=run.headers())

    def _final_body(
        run: g.Run, req: GenerationRequest, tool_calls: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        created = int(time.time())
        text = "".join(run.text)
        if req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = run.finish_reason
            if tool_calls:
                message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
                finish = "tool_calls"
            return {
                "id": f"chatcmpl-{run.prep.rid}",
                "object": "chat.completion",
                "created": created,
                "model": cfg.model.name,
                "system_fingerprint": _sys_fp(run),
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": run.usage(),
                "spillover": run.spillover_object(),
            }
        return {
            "id": f"cmpl-{run.prep.rid}",
            "object": "text_completion",
            "created": created,
            "model": cfg.model.name,
            "system_fingerprint": _sys_fp(run),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": run.finish_reason}],
            "usage": run.usage(),
            "spillover": run.spillover_object(),
        }

    def _sys_fp(run: g.Run) -> str | None:
        fp = run.dispatch.worker.statistics().fingerprint or {}
        return f"fp_{fp.get('compat', '')}" if fp else None

    async def _stream(run: g.Run, req: GenerationRequest) -> AsyncIterator[bytes]:
        created = int(time.time())
        chat = req.kind == "chat"
        cid = f"chatcmpl-{run.prep.rid}" if chat else f"cmpl-{run.prep.rid}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        buffer_tools = chat and req.forced_tool is not None

        def chunk(delta: dict[str, Any] | str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta
            return {
                "id": cid,
                "object": obj,
                "created": created,
                "model": cfg.model.name,
                "choices": [choice],
                **extra,
            }

        try:
            yield _sse(
                chunk({"role": "assistant", "content": ""} if chat else "", spillover=run.spillover_object())
            )
            while True:
                ev = await run.next_event()
                if ev["ev"] == "token":
                    if ev["id"] >= 0:
                        run.completion_tokens += 1
                    run.text.append(ev["text"])
                    if ev["text"] and not buffer_tools:
                        yield _sse(chunk({"content": ev["text"]} if chat else ev["text"]))
                elif ev["ev"] == "done":
                    run.finish_reason = ev["finish_reason"]
                    break
            finish = run.finish_reason
            if buffer_tools:
                calls = g.tool_calls_from(run) or []
                yield _sse(chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}))
                finish = "tool_calls"
            run.outcome = "ok"
            yield _sse(chunk({} if chat else "", finish))
            if req.include_usage:
                yield _sse(
                    {
                        "id": cid,
                        "object": obj,
                        "created": created,
                        "model": cfg.model.name,
                        "choices": [],
                        "usage": run.usage(),
                    }
                )
            yield b"data: [DONE]\n\n"
        except SpilloverError as exc:
            run.outcome = "severe"
            body = to_http(exc).body
            body["error"]["request_id"] = run.prep.rid
            body["error"]["tokens_delivered"] = run.completion_tokens
            yield _sse(body)
            yield b"data: [DONE]\n\n"
        finally:
            run.outcome = run.outcome if run.outcome == "ok" or run.outcome == "severe" else "cancelled"
            await run.close()

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "text")

    def _plain(request: Request, data: Any, status: int = 200) -> JSONResponse:
        return JSONResponse(
            data,
            status_code=status,
            headers={"X-Spillover-Request-Id": g.new_request_id(), "X-Spillover-Route": "none"},
        )

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except SpilloverError as exc:
            return _error_response(exc)
        return _plain(
            request,
            {
                "object": "list",
                "data": [{"id": cfg.model.name, "object": "model", "created": 0, "owned_by": "spillover"}],
            },
        )

    async def health(request: Request) -> Response:
        return _plain(request, {"status": "ok"})

    async def ready(request: Request) -> Response:
        try:
            authorize(request)
        except SpilloverError as exc:
            return _error_response(exc)
        ok = gw.ready()
        return _plain(request, {"ready": ok}, 200 if ok else 503)

    async def status(request: Request) -> Response:
        try:
            authorize(request)
        except SpilloverError as exc:
            return _error_response(exc)
        return _plain(request, gw.status())

    async def index(request: Request) -> Response:
        try:
            authorize(request)
        except SpilloverError as exc:
            return _error_response(exc)
        page = resources.files("spillover.http").joinpath("static/status.html").read_text("utf-8")
        return HTMLResponse(
            page, headers={"X-Spillover-Request-Id": g.new_request_id(), "X-Spillover-Route": "none"}
        )

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return _error_response(NotFound(f"no route {request.method} {request.url.path}"))
        err = SpilloverError(str(exc.detail), code="method_not_allowed" if exc.status_code == 405 else None)
        err.status = exc.status_code
        err.type = "invalid_request_error"
        return _error_response(err)

    async def on_error(request: Request, exc: Exception) -> Response:
        return _error_response(exc)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/", index, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: on_http_exception, Exception: on_error},
    )
