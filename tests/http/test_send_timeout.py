"""The listener's rule 6 (``http.server``) on its own, with a transport that reports its write
buffer: a paused connection whose buffer does not shrink for ``send_timeout_s`` is aborted and
counted; one whose buffer shrinks (a slow reader of a large answer: uvicorn writes a whole body
at once) starts its clock again and is never cut off, even when it is already closing."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState

from spillover.http.server import bounded_protocol

SEND_TIMEOUT_S = 0.2


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.buffered = 0
        self.aborted = False
        self.closing = False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closing or self.aborted

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closing = True

    def write(self, data: Any) -> None:
        pass


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def connection() -> tuple[Any, Transport]:
    config = UvicornConfig(app=_app, log_config=None)
    config.load()
    proto = bounded_protocol(8, 10.0, SEND_TIMEOUT_S)(config, ServerState(), {}, asyncio.get_running_loop())
    transport = Transport()
    proto.connection_made(transport)
    return proto, transport


def test_a_reader_that_takes_nothing_is_aborted_and_counted() -> None:
    async def body() -> None:
        proto, t = connection()
        t.buffered = 5_000_000
        proto.pause_writing()
        await asyncio.sleep(SEND_TIMEOUT_S * 2)
        assert t.aborted and proto.guard.send_timeouts == 1

    asyncio.run(body())


def test_a_slow_reader_that_takes_bytes_keeps_its_connection_closing_or_not() -> None:
    async def body() -> None:
        for closing in (False, True):
            proto, t = connection()
            t.buffered, t.closing = 5_000_000, closing
            proto.pause_writing()
            for _ in range(6):  # three bounds long, a piece taken every half bound
                await asyncio.sleep(SEND_TIMEOUT_S / 2)
                t.buffered -= 100_000
            assert not t.aborted and proto.guard.send_timeouts == 0, closing
            await asyncio.sleep(SEND_TIMEOUT_S * 2.5)  # then it stops taking any: cut off, closing too
            assert t.aborted and proto.guard.send_timeouts == 1, closing

    asyncio.run(body())


def test_a_buffer_that_drains_disarms_the_clock() -> None:
    async def body() -> None:
        proto, t = connection()
        t.buffered = 5_000_000
        proto.pause_writing()
        t.buffered = 0
        proto.resume_writing()
        await asyncio.sleep(SEND_TIMEOUT_S * 2)
        assert not t.aborted and proto.guard.send_timeouts == 0

    asyncio.run(body())
