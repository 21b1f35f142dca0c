"""What an Execution hands out and how a request ends: its events (``RouteInfo``, ``TokenOut``,
``Finished``), the gateway-wide retry budget, the error each kind of final failure becomes,
and the journal state each error ends a request in."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from spillover.core.lifecycle import State
from spillover.core.routing import FailKind
from spillover.errors import (
    AllocationFailed,
    CapacityError,
    ClientDisconnected,
    ContextLengthExceeded,
    FailoverInterrupted,
    InvalidRequest,
    JournalUnavailable,
    RequestCancelled,
    ServerStopping,
    SpilloverError,
    WorkerFailed,
)
from spillover.runtime.events import Token

__all__ = [
    "Event",
    "Finished",
    "RetryBudget",
    "RouteInfo",
    "TokenOut",
    "classify_error",
    "final_error",
    "not_durable",
    "stopped",
]


@dataclass(frozen=True)
class RouteInfo:
    """Where the request runs now; ``restart`` means earlier tokens are void (not delivered)."""

    route: str
    reason: str  # the wire text of the dispatch's reason (a Reason's value, or failover:<fault>)
    attempt: int
    worker_id: str
    max_tokens: int
    kv_tokens: int
    shrunk: bool
    queued_s: float
    queue_position: int
    estimated_delay_ms: int
    restart: bool
    failover: str | None = None  # the failure that caused this attempt


TokenOut = Token  # a generated token and the text it releases: the worker's event, passed on as is


@dataclass(frozen=True)
class Finished:
    """The generation ended normally."""

    finish_reason: str
    completion_tokens: int


Event = RouteInfo | TokenOut | Finished


class RetryBudget:
    """At most ``per_min`` failover retries in any 60 s window, gateway-wide."""

    def __init__(self, per_min: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_min = per_min
        self.clock = clock
        self._used: deque[float] = deque()
        self.denied = 0

    def take(self) -> bool:
        now = self.clock()
        while self._used and now - self._used[0] > 60.0:
            self._used.popleft()
        if len(self._used) >= self.per_min:
            self.denied += 1
            return False
        self._used.append(now)
        return True


def final_error(
    kind: FailKind,
    *,
    rid: str,
    where: str,
    fault: str,
    message: str,
    attempts: int,
    delivered: int,
    needs_tokens: int,
    cpu_cap_tokens: int,
) -> SpilloverError:
    """The one error each kind of final failure (``core.routing.FailKind``) becomes."""
    if kind is FailKind.CANCELLED:
        return RequestCancelled(f"request {rid} was cancelled")
    if kind is FailKind.CLIENT:
        if fault == "context_overflow":
            return ContextLengthExceeded(f"request {rid}: {message}", param="max_tokens")
        if fault == "empty_prompt":
            return InvalidRequest(f"request {rid}: {message}", param="prompt")
        return InvalidRequest(f"request {rid}: the engine refused the output constraint: {message}")
    if kind is FailKind.CPU_FAILED:
        return WorkerFailed(f"request {rid} failed: {where}; no replica to fail over to", retry_after_s=1.0)
    if kind is FailKind.ATTEMPTS_SPENT:
        return WorkerFailed(f"request {rid} failed after {attempts} attempts: {where}", retry_after_s=1.0)
    if kind is FailKind.NOT_CONTINUABLE:
        return FailoverInterrupted(
            f"request {rid}: {where} after {delivered} tokens were delivered, and the "
            "continuation on the CPU replica cannot be proven identical (needs plain greedy decoding: "
            "no grammar, penalty or bias; and identical fingerprints)",
            retry_after_s=1.0,
        )
    if kind is FailKind.CPU_TOO_SMALL:
        return WorkerFailed(
            f"request {rid}: {where}; it needs {needs_tokens}"
            f" tokens and the CPU lane serves at most {cpu_cap_tokens}, so it cannot be "
            "replayed there",
            retry_after_s=1.0,
        )
    return WorkerFailed(
        f"request {rid}: {where}; no CPU worker has the same compatibility fingerprint "
        "(model, tokenizer, template, quantization), so it is not a replica, and no fallback "
        "model is configured",
        retry_after_s=1.0,
    )


def stopped(rid: str, *, server_stopping: bool) -> SpilloverError:
    """The error of a request stopped before its end by no DELETE: the client went away
    (``ClientDisconnected``), or the gateway is stopping (``ServerStopping``). Both are
    resumable: a retry with its Idempotency-Key picks it up (a dropped connection is what the
    key is for); only a DELETE cancels."""
    if server_stopping:
        return ServerStopping(f"request {rid} was stopped: the gateway is stopping")
    return ClientDisconnected(f"request {rid}: the client went away before its answer ended")


def not_durable(rid: str) -> JournalUnavailable:
    """What a finished request's client is told instead of its answer while the journal cannot
    take the answer (``Gateway.store_outcome``): the answer is kept, and journaled once the
    journal takes it; the Idempotency-Key (or ``GET /v1/requests/{id}``) gets it then."""
    return JournalUnavailable(
        f"request {rid} finished, but its answer could not be made durable (the journal cannot write: "
        "a full disk?); it is kept and journaled once the journal can: send the request again with its "
        f"Idempotency-Key, or GET /v1/requests/{rid}, after Retry-After",
        retry_after_s=2.0,
    )


def classify_error(exc: SpilloverError) -> State:
    """The journal state a request ends in after ``exc`` (once it was accepted)."""
    if isinstance(exc, RequestCancelled):
        return State.CANCELLED
    if isinstance(exc, JournalUnavailable | ServerStopping | ClientDisconnected):
        return State.RESUMABLE_ERROR
    if isinstance(exc, WorkerFailed | AllocationFailed):
        return State.RESUMABLE_ERROR
    if isinstance(exc, CapacityError):
        return State.REJECTED
    return State.FAILED
