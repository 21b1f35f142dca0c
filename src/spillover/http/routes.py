"""What every route shares: its plain JSON answer, the signal headers of a served answer, and
the guard that checks the API key and shapes its errors (OpenAI's, or Ollama's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spillover.errors import SpilloverError
from spillover.runtime.prepare import new_request_id

__all__ = ["Handler", "guard", "plain_json", "signal_headers"]

Handler = Callable[[Request], Awaitable[Response]]


def plain_json(data: Any, status: int = 200) -> JSONResponse:
    """A JSON answer that is not a generation (still with the request-id and route headers)."""
    headers = {"X-Spillover-Request-Id": new_request_id(), "X-Spillover-Route": "none"}
    return JSONResponse(data, status_code=status, headers=headers)


def signal_headers(sp: dict[str, Any]) -> dict[str, str]:
    """The ``X-Spillover-*`` headers every served answer carries, from its ``spillover``
    object (request id, route, degraded, model, attempts, and the reason when there is one)."""
    h = {
        "X-Spillover-Request-Id": sp["request_id"],
        "X-Spillover-Route": sp["route"],
        "X-Spillover-Degraded": "1" if sp["degraded"] else "0",
        "X-Spillover-Model": sp["model"],
        "X-Spillover-Attempts": str(sp["attempts"]),
    }
    if sp["reason"]:
        h["X-Spillover-Reason"] = sp["reason"]
    return h


def guard(
    authorize: Callable[[Request], None], refuse: Callable[[SpilloverError, str], Response]
) -> Callable[[Handler], Handler]:
    """A decorator: the route needs the API key (when one is set), and its errors leave
    through ``refuse``."""

    def guarded(route: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                authorize(request)
                return await route(request)
            except SpilloverError as exc:
                return refuse(exc, new_request_id())

        return run

    return guarded


def content_codings(request: Request) -> list[str]:
    """Every ``Content-Encoding`` a body says it went through, in order, lower-case; none when
    it says only ``identity`` (the body as it is)."""
    codings = [
        c.strip().lower() for v in request.headers.getlist("content-encoding") for c in v.split(",") if c.strip()
    ]
    return [] if codings == ["identity"] else codings
