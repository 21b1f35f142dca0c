"""The HTTP listener's own bounds: open connections, request-head time, file descriptors.

uvicorn bounds none of these: a connection that never sends a byte, or sends a request
head one byte at a time, stays open for ever, and enough of them exhaust the process's
file descriptors (asyncio then logs ``EMFILE`` on every accept, and every other part of
the gateway that opens a file or a pipe fails). ``bounded_protocol`` builds uvicorn's
httptools protocol (llhttp, a C parser: about half the CPU per request of its pure-Python
h11 one, ``benchmarks.request_cost``) with those bounds; ``raise_fd_limit`` makes sure the
bounds fit the process.

Rules:

1. At most ``max_connections`` connections are open. One more is answered at once with
   the OpenAI-shaped 503 (``code=too_many_connections``, ``Retry-After``) and closed; it
   never reaches the app.
2. A connection must deliver a complete request head within ``header_timeout_s`` of
   connecting or of the end of its previous response (so the bound covers idle keep-alive
   too, and the rest of a body the app answered without reading). Partial bytes do not
   restart the clock. Late connections are closed; one that has not read its previous
   response by then is aborted.
3. A request head (with the empty lines a client may send before it) larger than
   ``MAX_HEAD_BYTES`` is answered 431 (``request_head_too_large``, rule 7) and the connection
   closed (llhttp itself sets no bound; h11's was 16 KiB). A head that begins in the same read
   as the end of the request before it (pipelining) is counted from the next read: one read at
   most goes uncounted.
   A refusal (this 431, or the 400 for a request llhttp cannot parse) behind pipelined
   requests still being answered waits for their answers, reading nothing more.
4. Refusals, time-outs, oversized heads and requests that are not HTTP (rule 7) are counted
   (``statistics()``) and logged at most once per ``LOG_EVERY_S``: an attack cannot grow the
   log (uvicorn's own line for each request it cannot parse is dropped).
5. uvicorn's listen backlog is ``max_connections``, so one accept burst adds at most that
   many descriptors before rule 1 closes them. ``raise_fd_limit`` raises the soft
   ``RLIMIT_NOFILE`` to the hard limit and refuses to serve unless two bursts' worth of
   connections plus ``FD_RESERVE`` fit under it.
6. A response whose client takes none of its bytes for ``send_timeout_s`` (the transport's
   write buffer stays above its high-water mark and does not shrink: a client that stopped
   reading; a slow reader of a large answer shrinks it, and its clock starts again) is aborted,
   counted (``send_timeouts``) and logged as rule 4 says. The app sees the client go away, so
   the request it answers ends as a disconnected client's does and its worker slot is free:
   a reader that never reads cannot hold a slot, however long its request may run.
7. What the listener answers itself is an error like the app's (``raw_error``): JSON in
   OpenAI's shape (Ollama's when the request's target, as far as it was read, is under
   ``/api/``), its ``x-should-retry``, a request id, and ``connection: close``. A request llhttp
   cannot parse (a Content-Length beside a Transfer-Encoding, two Content-Lengths, an unknown
   method, a bad header character) is a 400 ``invalid_http`` naming the parser's fault, not
   uvicorn's plain-text "Invalid HTTP request received.". Nothing of it is accepted. A fault
   in the body of the request being read (a bad chunk) is that request's: answered at once
   (its app sees the client go away), or, when it was answered already, the connection closes
   with no second answer.
8. An absolute-form request target (``GET http://host:port/path``) names the request's host:
   its authority replaces the Host header (RFC 9112 3.2.2), so the Host guard judges what
   the request is really for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.config import Config as UvicornConfig
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import Server, ServerState

from spillover.errors import CapacityError, ConfigError, InvalidRequest, SpilloverError, to_http
from spillover.http.ollama import ollama_error_body
from spillover.http.ollama_api import OLLAMA_PREFIX
from spillover.runtime import ticks
from spillover.runtime.prepare import new_request_id
from spillover.runtime.unary import STOPPING_WAIT_S

__all__ = [
    "FD_RESERVE",
    "MAX_HEAD_BYTES",
    "BoundedHttpProtocol",
    "ConnectionGuard",
    "ConnectionStatistics",
    "bounded_protocol",
    "raise_fd_limit",
]

log = logging.getLogger("spillover.http.server")

FD_RESERVE = 128  # descriptors kept for worker pipes, the journal, the sim ledger, logs, the listener
LOG_EVERY_S = 10.0
MAX_HEAD_BYTES = 64 * 1024  # a request line and headers (rule 3)
HEAD_FIRST_BYTES = 64  # kept of a head's start, for its target's route (rule 7): "GET /api/..." is in them


@dataclass(frozen=True)
class ConnectionStatistics:
    """Frozen snapshot of the listener's connection bounds."""

    open: int
    max_connections: int
    header_timeout_s: float
    refused: int
    head_timeouts: int
    heads_too_large: int
    send_timeout_s: float
    send_timeouts: int
    not_http: int  # requests llhttp could not parse (rule 7)


def raw_error(exc: SpilloverError, *, rid: str | None = None, ollama: bool = False) -> bytes:
    """A whole HTTP/1.1 error answer, written by the listener itself (rules 1, 3 and 7): the
    app's JSON error (``to_http``; Ollama's shape for an ``/api/`` path) with its headers, the
    request id when there is one, and ``connection: close``."""
    error = to_http(exc)
    body = json.dumps(ollama_error_body(exc) if ollama else error.body, separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json"]
    head += [f"{k.lower()}: {v}" for k, v in error.headers.items()]
    if rid is not None:
        head += [f"x-spillover-request-id: {rid}", "x-spillover-route: none"]
    head += ["connection: close", f"content-length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """The bounds and counters shared by every connection of one server (rules 1-4 and 6)."""

    def __init__(self, max_connections: int, header_timeout_s: float, send_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.send_timeout_s = send_timeout_s
        self.open = 0
        self.refused = 0
        self.head_timeouts = 0
        self.heads_too_large = 0
        self.send_timeouts = 0
        self.not_http = 0
        self._logged = (0, 0, 0, 0, 0)  # (refused, head_timeouts, heads_too_large, send_timeouts, not_http) logged
        self._last_log_s = float("-inf")
        self.refusal = raw_error(
            CapacityError(
                f"too many open connections (server.max_connections={max_connections}); retry shortly",
                code="too_many_connections",
            )
        )

    def __repr__(self) -> str:
        return f"<ConnectionGuard open={self.open}/{self.max_connections} refused={self.refused}>"

    def statistics(self) -> ConnectionStatistics:
        """A frozen snapshot of the counters."""
        return ConnectionStatistics(
            open=self.open,
            max_connections=self.max_connections,
            header_timeout_s=self.header_timeout_s,
            refused=self.refused,
            head_timeouts=self.head_timeouts,
            heads_too_large=self.heads_too_large,
            send_timeout_s=self.send_timeout_s,
            send_timeouts=self.send_timeouts,
            not_http=self.not_http,
        )

    def note(self, now_s: float) -> None:
        """Log what changed since the last line, at most once per ``LOG_EVERY_S`` (rule 4)."""
        if now_s - self._last_log_s < LOG_EVERY_S:
            return
        now = (self.refused, self.head_timeouts, self.heads_too_large, self.send_timeouts, self.not_http)
        refused, timeouts, too_large, stalled, not_http = (a - b for a, b in zip(now, self._logged, strict=True))
        if refused == 0 and timeouts == 0 and too_large == 0 and stalled == 0 and not_http == 0:
            return
        self._last_log_s = now_s
        self._logged = now
        log.warning(
            "connections: %d refused (max_connections=%d, open %d), %d closed without a request head "
            "within header_timeout_s=%g, %d heads over %d bytes, %d aborted for taking no response "
            "bytes within send_timeout_s=%g, %d requests that are not HTTP (counts since the last such line)",
            refused,
            self.max_connections,
            self.open,
            timeouts,
            self.header_timeout_s,
            too_large,
            MAX_HEAD_BYTES,
            stalled,
            self.send_timeout_s,
            not_http,
        )


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with rules 1-4 and 6; build it with ``bounded_protocol``.

    A connection waits for a head while no request of it is being answered (``_open_heads``
    is 0): from connecting, and from the end of each response. Pipelined requests whose
    heads are already parsed count as being answered. Head bytes (rule 3) are counted from
    reads that begin inside a head or between requests (not inside a body), up to the end
    of the head, which may be split across reads."""

    guard: ConnectionGuard

    def __init__(
        self,
        config: UvicornConfig,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._refused = False
        self._head_deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None  # rule 6, while writing is paused
        self._send_buffered = 0  # rule 6: the write buffer's size when its clock last started
        self._in_message = False  # a request has begun and its body is not complete
        self._in_head = False  # a request has begun and its head is not complete
        self._head_bytes = 0  # bytes of the head being received, and of empty lines before it (rule 3)
        self._head_tail = b""  # the last bytes of a head not yet complete: its end may be split
        self._open_heads = 0  # complete heads whose responses are not complete
        self._refusal: Callable[[], None] | None = None  # waits for the answers before it (rule 3)
        self._head_first = b""  # the first bytes of the head being read, when it opened at a read's start

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        g = self.guard
        if g.open >= g.max_connections:  # rule 1: never reaches the app
            self._refused = True
            g.refused += 1
            transport.write(g.refusal)
            transport.close()
            g.note(time.monotonic())
            return
        g.open += 1
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self.guard.open -= 1
        self._disarm_head_deadline()
        self.resume_writing()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._refusal is not None or self.transport.is_closing():
            return
        if self._in_head or not self._in_message:  # the read opens with head bytes (rule 3)
            rest = data if self._in_head else data.lstrip(b"\r\n")  # llhttp skips empty lines before a head
            probe = self._head_tail + rest
            end = probe.find(b"\r\n\r\n")
            used = len(rest) if end < 0 else max(0, end + 4 - len(self._head_tail))
            self._head_bytes += len(data) - len(rest) + used
            if not self._in_head:  # a head opens with this read: its first bytes name its target
                self._head_first = rest[:HEAD_FIRST_BYTES]
            elif 0 < len(self._head_first) < HEAD_FIRST_BYTES:
                self._head_first += data[: HEAD_FIRST_BYTES - len(self._head_first)]
            if self._head_bytes > MAX_HEAD_BYTES:
                self.guard.heads_too_large += 1
                self.guard.note(time.monotonic())
                # its request line may not be parsed yet: its target is read from the head's first bytes
                self._refuse(functools.partial(self._send_431, self._head_first))
                return
        super().data_received(data)
        self._head_tail = (self._head_tail + data)[-3:] if self._in_head else b""

    def on_message_begin(self) -> None:
        self._in_message = self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._open_heads += 1
        self._disarm_head_deadline()
        self._authority_is_host()
        super().on_headers_complete()

    def _authority_is_host(self) -> None:
        """Rule 8: an absolute-form target's authority is the request's host (RFC 9112 3.2.2:
        the Host header is then ignored), so the Host guard (``http.origin``) judges it:
        ``GET http://evil.example/v1/status`` with ``Host: 127.0.0.1`` was served."""
        if self.url[:1] in (b"/", b"*"):
            return
        try:
            url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return  # uvicorn's own parse refuses it
        if url.host:
            host = b"[" + url.host + b"]" if b":" in url.host else url.host  # an IPv6 literal, as Host writes it
            authority = host + (b":%d" % url.port if url.port else b"")
            self.headers[:] = [(n, v) for n, v in self.headers if n != b"host"] + [(b"host", authority)]

    def on_message_complete(self) -> None:
        self._in_message = False
        self._head_first = b""  # a head that opens later in this read is named by what llhttp parses
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._open_heads = max(0, self._open_heads - 1)
        super().on_response_complete()
        if self._open_heads > 0 or self.transport.is_closing():
            return
        if self._refusal is not None:
            self._refusal()
        elif self._head_deadline is None:
            self._arm_head_deadline()  # partial bytes of the next head never restart it

    def pause_writing(self) -> None:
        """The transport's buffer is past its high-water mark: the client has until
        ``send_timeout_s`` to take bytes again (rule 6)."""
        super().pause_writing()
        if self._send_deadline is None:
            self._arm_send_deadline()

    def _arm_send_deadline(self) -> None:
        self._send_buffered = self.transport.get_write_buffer_size()
        self._send_deadline = self.loop.call_later(self.guard.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
        super().resume_writing()

    def _send_timed_out(self) -> None:
        self._send_deadline = None
        if self.transport.get_write_buffer_size() < self._send_buffered:  # it took bytes: a slow reader
            self._arm_send_deadline()
            return
        self.guard.send_timeouts += 1
        self.transport.abort()  # closing or not: its buffer would never drain, and close() waits for it
        self.guard.note(time.monotonic())

    def send_400_response(self, msg: str) -> None:
        """Rule 7: a request llhttp cannot parse (uvicorn calls this inside its ``except`` for
        the parser's error, which names the fault), after the answers before it (rule 3). A
        fault in the body of the request being read (a bad chunk) refuses that request: its
        app stops waiting for the rest (it sees the client go away; nothing was accepted), and
        one it answered already gets no second answer: the connection just closes."""
        self.guard.not_http += 1
        self.guard.note(time.monotonic())
        cycle = getattr(self, "cycle", None)
        if self._in_message and not self._in_head and cycle is not None:  # the body of the request being read
            if cycle.response_started:  # answered (say 415), or half an answer is out: nothing may follow it
                self.transport.close()
                return
            cycle.disconnected = True  # its body will never come whole
            cycle.message_event.set()
            self._open_heads = max(0, self._open_heads - 1)  # its answer will never complete
        fault = sys.exc_info()[1]
        why = f"the request cannot be read as HTTP: {fault}" if fault is not None else msg.rstrip(".")
        answer = raw_error(InvalidRequest(why, code="invalid_http"), rid=new_request_id(), ollama=self._ollama())
        self._refuse(functools.partial(self._send_raw, answer))

    def _ollama(self, opening: bytes = b"") -> bool:
        """Whether the request being read is an Ollama route's: its target in ``opening`` (a
        read that opens a head, not parsed yet), else as far as llhttp parsed it."""
        target = opening.split(b"\r\n", 1)[0].split(b" ")[1:2] if opening else [bytes(getattr(self, "url", b"") or b"")]
        return bool(target) and target[0].startswith(OLLAMA_PREFIX.encode())

    def _send_raw(self, answer: bytes) -> None:
        self.transport.write(answer)
        self.transport.close()

    def _refuse(self, send: Callable[[], None]) -> None:
        """Answer and close now, or once the requests before it are answered (reading nothing more)."""
        if self._open_heads == 0:
            send()
            return
        self._refusal = send
        self._disarm_head_deadline()
        self.flow.pause_reading()

    def _send_431(self, opening: bytes = b"") -> None:
        err = InvalidRequest(
            f"the request head (its request line and headers) is larger than {MAX_HEAD_BYTES} bytes",
            code="request_head_too_large",
        )
        err.status = 431
        self._send_raw(raw_error(err, rid=new_request_id(), ollama=self._ollama(opening)))

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self._open_heads > 0:
            return
        self.guard.head_timeouts += 1
        if self.transport.get_write_buffer_size() > 0:
            self.transport.abort()  # it did not even read the previous response: do not wait for it
        else:
            self.transport.close()
        self.guard.note(time.monotonic())


class _NoParseWarnings(logging.Filter):
    """Drops uvicorn's own line for each request it cannot parse: rule 7 counts them and rule 4
    logs the count, so an attack cannot grow the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != UVICORN_PARSE_WARNING


UVICORN_PARSE_WARNING = "Invalid HTTP request received."  # uvicorn's httptools_impl: logged before send_400_response


def bounded_protocol(max_connections: int, header_timeout_s: float, send_timeout_s: float) -> type[BoundedHttpProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing these bounds; its
    ``guard`` holds the counters of every connection it serves."""
    shared = ConnectionGuard(max_connections, header_timeout_s, send_timeout_s)
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _NoParseWarnings) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_NoParseWarnings())

    class Configured(BoundedHttpProtocol):
        guard = shared

    return Configured


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit and return it; ``ConfigError``
    when ``max_connections`` does not stay well under it (rule 5)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY:
        target = soft
    if target > soft:
        with contextlib.suppress(ValueError, OSError):  # e.g. macOS caps it below the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    need = 2 * max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and need > soft:
        raise ConfigError(
            f"[server].max_connections={max_connections} needs {need} file descriptors "
            f"(2 x max_connections + {FD_RESERVE} for the gateway itself) but this process may open "
            f"{soft}: lower max_connections or raise the limit (ulimit -n)"
        )
    return int(soft)


# A second Ctrl-C: what the gateway's stopped requests have to answer: a unary run waits
# STOPPING_WAIT_S for its worker's batch, then journals its end and answers.
FORCE_GRACE_S = STOPPING_WAIT_S + 1.0


class TickingServer(Server):
    """uvicorn's server whose main loop (the Date header once a second, the check for a stop)
    runs on the gateway's shared tick (``runtime.ticks``) instead of a timer of its own every
    0.1 s: an idle gateway wakes once for it and its periodic loops. Same period, same checks.
    ``on_exit`` is called when the loop sees the stop (a signal), before uvicorn's shutdown
    gives open requests their grace and then cancels them. A second Ctrl-C (uvicorn's "stop at
    once") calls ``on_force`` first, which stops the requests (503 ``server_stopping``), and
    stops at once ``FORCE_GRACE_S`` (2 s) after: uvicorn cancelled their handlers at once, a bare 500
    with no request id (round 36). A third one does not wait."""

    def __init__(
        self,
        config: UvicornConfig,
        *,
        on_exit: Callable[[], None] = lambda: None,
        on_force: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self.on_force = on_force
        self._loop: asyncio.AbstractEventLoop | None = None
        self._forcing = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT and not self._forcing and self._loop is not None:
            self._forcing = True  # a signal handler: the loop does the work, between its callbacks
            self._loop.call_soon_threadsafe(self._force_soon)
            return
        super().handle_exit(sig, frame)

    def _force_soon(self) -> None:
        self.on_force()
        assert self._loop is not None
        self._loop.call_later(FORCE_GRACE_S, setattr, self, "force_exit", True)

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            await ticks.sleep(0.1)
            should_exit = await self.on_tick(counter)
        self.on_exit()
