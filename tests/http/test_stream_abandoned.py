"""A stream whose client goes away before its first frame is read: the server cancels the
body unread (ASGI 2.3: Starlette's task group, cancelled by the disconnect while the response's
start waits to be written; 2.4: the start's send fails), and closing an async generator that
never started runs none of its code: the request ran on, its lease held and its journal row
open, for good. ``runtime.run.Frames`` ends the request then too (round 28)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from spillover.http.app import ClosingStream
from spillover.runtime.run import Frames


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_gone_before_the_first_frame_ends_the_request(spec: str) -> None:
    ended: list[str] = []

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()
        finally:
            ended.append("generator")

    async def abandoned() -> None:
        ended.append("abandoned")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # gone already: the body is cancelled before it is read

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            if spec == "2.4":
                raise OSError("the client is gone")  # 2.4: the server says so by failing the send
            await asyncio.sleep(0)  # 2.3: uvicorn waits for room to write (flow control): the cancel lands here

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "method": "POST", "headers": []}

    async def main() -> None:
        response = ClosingStream(Frames(body(), abandoned), media_type="text/event-stream")
        with contextlib.suppress(ClientDisconnect):  # 2.4: what Starlette raises for the failed send
            await response(scope, receive, send)  # type: ignore[arg-type]

    asyncio.run(main())
    assert ended == ["abandoned"], (ended, sent)


def test_frames_read_then_closed_end_through_the_generator_alone() -> None:
    ended: list[str] = []

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            yield b"a"
            yield b"b"
        finally:
            ended.append("generator")

    async def abandoned() -> None:
        ended.append("abandoned")

    async def main() -> list[bytes]:
        frames = Frames(body(), abandoned)
        got = [await anext(frames)]
        await frames.aclose()
        return got

    assert asyncio.run(main()) == [b"a"] and ended == ["generator"]
