"""The HTTP listener's own bounds: open connections, request-head time, file descriptors.

uvicorn bounds none of these: a connection that never sends a byte, or sends a request
head one byte at a time, stays open for ever, and enough of them exhaust the process's
file descriptors (asyncio then logs ``EMFILE`` on every accept, and every other part of
the gateway that opens a file or a pipe fails). ``bounded_protocol`` builds uvicorn's h11
protocol with those bounds; ``raise_fd_limit`` makes sure the bounds fit the process.

Rules:

1. At most ``max_connections`` connections are open. One more is answered at once with
   the OpenAI-shaped 503 (``code=too_many_connections``, ``Retry-After``) and closed; it
   never reaches the app.
2. A connection must deliver a complete request head within ``header_timeout_s`` of
   connecting or of the end of its previous response (so the bound covers idle keep-alive
   too). Partial bytes do not restart the clock. Late connections are closed; one that
   has not read its previous response by then is aborted.
3. Refusals and time-outs are counted (``statistics()``) and logged at most once per
   ``LOG_EVERY_S``: an attack cannot grow the log.
4. uvicorn's listen backlog is ``max_connections``, so one accept burst adds at most that
   many descriptors before rule 1 closes them. ``raise_fd_limit`` raises the soft
   ``RLIMIT_NOFILE`` to the hard limit and refuses to serve unless two bursts' worth of
   connections plus ``FD_RESERVE`` fit under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.config import Config as UvicornConfig
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from spillover.errors import CapacityError, ConfigError, to_http

__all__ = [
    "FD_RESERVE",
    "BoundedH11Protocol",
    "ConnectionGuard",
    "ConnectionStatistics",
    "bounded_protocol",
    "raise_fd_limit",
]

log = logging.getLogger("spillover.http.server")

FD_RESERVE = 128  # descriptors kept for worker pipes, the journal, the sim ledger, logs, the listener
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionStatistics:
    """Frozen snapshot of the listener's connection bounds."""

    open: int
    max_connections: int
    header_timeout_s: float
    refused: int
    head_timeouts: int


class ConnectionGuard:
    """The bounds and counters shared by every connection of one server (rules 1-3)."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.head_timeouts = 0
        self._logged = (0, 0)  # (refused, head_timeouts) at the last log line
        self._last_log_s = float("-inf")
        error = to_http(
            CapacityError(
                f"too many open connections (server.max_connections={max_connections}); retry shortly",
                code="too_many_connections",
            )
        )
        body = json.dumps(error.body, separators=(",", ":")).encode()
        head = [f"HTTP/1.1 {error.status} Service Unavailable", "content-type: application/json"]
        head += [f"{k.lower()}: {v}" for k, v in error.headers.items()]
        head += ["connection: close", f"content-length: {len(body)}"]
        self.refusal = ("\r\n".join(head) + "\r\n\r\n").encode() + body

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
        )

    def note(self, now_s: float) -> None:
        """Log what changed since the last line, at most once per ``LOG_EVERY_S`` (rule 3)."""
        if now_s - self._last_log_s < LOG_EVERY_S:
            return
        refused, timeouts = self.refused - self._logged[0], self.head_timeouts - self._logged[1]
        if refused == 0 and timeouts == 0:
            return
        self._last_log_s = now_s
        self._logged = (self.refused, self.head_timeouts)
        log.warning(
            "connections: %d refused (max_connections=%d, open %d), %d closed without a request head "
            "within header_timeout_s=%g (counts since the last such line)",
            refused,
            self.max_connections,
            self.open,
            timeouts,
            self.header_timeout_s,
        )


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with rules 1 and 2; build it with ``bounded_protocol``."""

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
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._track_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_head()

    def _track_head(self) -> None:
        """Run the head clock exactly while the connection waits for a request head (rule 2)."""
        if self.transport.is_closing():
            self._disarm_head_deadline()
        elif self.conn.their_state is h11.IDLE:
            if self._head_deadline is None:  # partial bytes never restart it
                self._arm_head_deadline()
        else:
            self._disarm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.guard.head_timeouts += 1
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        if self.transport.get_write_buffer_size() > 0:
            self.transport.abort()  # it did not even read the previous response: do not wait for it
        else:
            self.transport.close()
        self.guard.note(time.monotonic())


def bounded_protocol(max_connections: int, header_timeout_s: float) -> type[BoundedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing these bounds; its
    ``guard`` holds the counters of every connection it serves."""
    shared = ConnectionGuard(max_connections, header_timeout_s)

    class Configured(BoundedH11Protocol):
        guard = shared

    return Configured


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit and return it; ``ConfigError``
    when ``max_connections`` does not stay well under it (rule 4)."""
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
