"""A bare ASGI app for ``request_cost``'s streaming floor: no framework, no gateway work. A
POST streams ``n`` SSE chunks of a chat completion chunk's size, one per ``every_s`` seconds
(the query string), so one chunk costs what the HTTP server and the event loop's wake-up cost
on their own. Run by uvicorn as ``benchmarks._bare_stream:app``."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qs

CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764633600,'
    b'"model":"smollm2","choices":[{"index":0,"delta":{"content":'
)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    q = parse_qs(scope.get("query_string", b"").decode())
    n, every_s = int(q.get("n", ["100"])[0]), float(q.get("every_s", ["0.025"])[0])
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(n):
        await asyncio.sleep(every_s)
        body = CHUNK + json.dumps(f" {i},").encode() + b'},"logprobs":null,"finish_reason":null}]}\n\n'
        await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
