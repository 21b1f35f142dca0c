"""One error tree for spillover, and the one mapping of it to HTTP.

::

    SpilloverError                      (500 internal_error)
    ├── ConfigError                     bad configuration; never reaches HTTP
    ├── ClientError                     the request is wrong; nothing was journaled
    │   ├── InvalidRequest              400 invalid_request_error (param set)
    │   ├── ContextLengthExceeded       400 code=context_length_exceeded
    │   ├── Unauthorized                401 authentication_error
    │   ├── Forbidden                   403 permission_error (forbidden_host, forbidden_origin)
    │   ├── UnsupportedMediaType        415 code=unsupported_media_type (body not JSON-typed)
    │   ├── NotFound                    404 (model_not_found, request_not_found, ...)
    │   ├── PayloadTooLarge             413 code=payload_too_large
    │   ├── RequestCancelled            409 code=request_cancelled (a DELETE)
    │   ├── ClientDisconnected          499 code=client_disconnected: the client went away before
    │   │                               its answer ended (resumable: its key runs it again)
    │   └── BodyTimeout                 408 code=body_timeout: the body came too slowly
    ├── CapacityError                   503 + Retry-After: the gateway is full right now
    │   ├── QueueFull                   code=queue_full
    │   ├── JournalUnavailable          type=server_error code=journal_unavailable: a journal write failed
    │   ├── NoWorkerReady               code=no_worker_ready (model_load_failed: no worker can start)
    │   ├── ServerStopping              type=server_error code=server_stopping: the gateway stopped
    │   │                               while the request ran or waited (resumable)
    │   └── WorkerFailed                a worker died or failed mid-request (resumable)
    │       ├── AllocationFailed        the device refused memory before generation
    │       └── FailoverInterrupted     code=failover_interrupted: tokens were delivered and
    │           │                       no provably identical continuation exists
    │           └── RestartInterrupted  the same, the gateway having restarted (its own sentence)
    ├── DeadlineTooShort                503 code=deadline_exceeded, no Retry-After, not retried:
    │                                   the request alone overruns its deadline
    ├── IdempotencyError                the Idempotency-Key was used differently
    │   ├── IdempotencyInFlight         409 + Retry-After: the first request is still running
    │   └── IdempotencyMismatch         422: same key, different body
    └── RequestTimedOut                 504 code=request_timeout: ran past request_timeout_s

An error a person may read in a chat UI (cancelled, busy, too long, the model failed, ...)
has a plain ``message`` saying what happened and what to do (``for_people``); the technical
account is kept in ``detail``.

Every error answer carries ``x-should-retry`` (``should_retry``): ``true`` only for
CapacityError, IdempotencyInFlight, BodyTimeout and ClientDisconnected, those a later retry can
fix; SDKs obey it.

Expected outcomes inside the core are values (``Decision``); these exceptions cross
layers. A foreign exception is wrapped once, at its boundary, with ``from exc``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AllocationFailed",
    "AnswerNotKept",
    "BodyTimeout",
    "CapacityError",
    "ClientError",
    "ConfigError",
    "ContextLengthExceeded",
    "DeadlineTooShort",
    "FailoverInterrupted",
    "Forbidden",
    "HttpError",
    "IdempotencyError",
    "IdempotencyInFlight",
    "IdempotencyMismatch",
    "InvalidRequest",
    "JournalUnavailable",
    "NoWorkerReady",
    "NotFound",
    "PayloadTooLarge",
    "QueueFull",
    "RequestCancelled",
    "RequestTimedOut",
    "RestartInterrupted",
    "SpilloverError",
    "Unauthorized",
    "UnsupportedMediaType",
    "WorkerFailed",
    "for_people",
    "should_retry",
    "to_http",
]


class SpilloverError(Exception):
    """Base of every error spillover raises on purpose."""

    status = 500
    type = "internal_error"
    code: str | None = "internal_error"
    variant: str | None = None  # another sentence for people under the same code (``for_people``)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(SpilloverError):
    """The configuration file or flags are invalid."""

    code = "config_error"

    @classmethod
    def unreadable(cls, what: str, path: str, exc: BaseException) -> ConfigError:
        """A model file or folder the gateway cannot read, naming what it is for: whatever the
        reader raised (a damaged, cut-short or foreign file fails in many ways) is the operator's
        file, not a bug, and the start says so in one line."""
        return cls(f"{what}: {path} cannot be served ({type(exc).__name__}: {exc})")


class ClientError(SpilloverError):
    """The request itself is wrong."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidRequest(ClientError):
    """A parameter is missing, malformed or out of range; ``param`` names it."""


class ContextLengthExceeded(ClientError):
    """The prompt plus ``max_tokens`` does not fit any lane's context."""

    code = "context_length_exceeded"


class Unauthorized(ClientError):
    """Missing or wrong API key."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ClientError):
    """The request's Host or Origin is not allowed (DNS rebinding or cross-site guard)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class UnsupportedMediaType(ClientError):
    """A request body without ``Content-Type: application/json``."""

    status = 415
    code = "unsupported_media_type"


class NotFound(ClientError):
    """Unknown model, request id or route."""

    status = 404
    code = "not_found"


class RequestCancelled(ClientError):
    """The request was cancelled (DELETE /v1/requests/{id})."""

    status = 409
    code = "request_cancelled"


class ClientDisconnected(ClientError):
    """The client went away (its connection closed, or took no bytes for ``send_timeout_s``)
    before its answer ended. Not a cancellation: a network drop is what an Idempotency-Key
    is for, so a retry with the key resumes the request (journaled RESUMABLE_ERROR). The
    status is nginx's 499 "client closed request": nobody was there to read it; it is what
    ``GET /v1/requests/{id}`` shows."""

    status = 499
    code = "client_disconnected"


class IdempotencyError(ClientError):
    """The Idempotency-Key cannot be used this way."""

    code = "idempotency_error"


class IdempotencyInFlight(IdempotencyError):
    """A request with this key is still in flight."""

    status = 409
    code = "idempotency_key_in_flight"
    retry_after_s = 1.0


class IdempotencyMismatch(IdempotencyError):
    """The key was first used with a different body."""

    status = 422
    code = "idempotency_key_reused"


class AnswerNotKept(IdempotencyError):
    """The key's request finished and its answer was sent, but the answer was too large for the
    journal to keep (``Gateway.store_outcome``): a replay cannot give it, and running it again
    under the same key could give another. A new key runs it again."""

    status = 410
    code = "answer_not_kept"


class PayloadTooLarge(ClientError):
    """The body exceeds the configured limit; it was not buffered."""

    status = 413
    code = "payload_too_large"


class BodyTimeout(ClientError):
    """The request body did not arrive within ``[server].body_timeout_s``."""

    status = 408
    code = "body_timeout"


class CapacityError(SpilloverError):
    """The gateway cannot take the request now; the client should retry later."""

    status = 503
    type = "server_overloaded"
    code = "capacity"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float = 1.0,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s


class DeadlineTooShort(SpilloverError):
    """The request alone takes longer than its deadline allows on the faster of its service's
    lanes, with nothing ahead of it: a retry would be refused the same way. Answered as a
    deadline refusal (503 ``deadline_exceeded``), without Retry-After and with
    ``x-should-retry: false`` (round 70: the openai SDK retried a 1 ms deadline for 50 s)."""

    status = 503
    type = "server_overloaded"
    code = "deadline_exceeded"
    variant = "alone"


class QueueFull(CapacityError):
    """A lane's bounded queue is full; answered at once."""

    code = "queue_full"


class JournalUnavailable(CapacityError):
    """The request journal cannot be written (disk full, byte bound reached, I/O error)."""

    type = "server_error"
    code = "journal_unavailable"


class NoWorkerReady(CapacityError):
    """No worker that can serve this model is ready."""

    code = "no_worker_ready"


class ServerStopping(CapacityError):
    """The gateway stopped (Ctrl-C, SIGTERM, a fatal loop) before the request ended: it is
    not the client's cancellation, and a retry with its Idempotency-Key resumes it."""

    type = "server_error"
    code = "server_stopping"

    def __init__(self, message: str, *, retry_after_s: float = 5.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class WorkerFailed(CapacityError):
    """The worker serving the request died or failed; the request did not complete."""

    type = "worker_failed"
    code = "worker_failed"


class AllocationFailed(WorkerFailed):
    """The device refused the request's memory before generation started."""

    code = "allocation_failed"


class FailoverInterrupted(WorkerFailed):
    """Tokens were delivered and the continuation could not be proven identical."""

    code = "failover_interrupted"


class RestartInterrupted(FailoverInterrupted):
    """The gateway restarted while the request was streaming and part of it had been
    delivered: it cannot be replayed without changing what its client saw (same code; what a
    person reads names the restart, not a GPU failure)."""

    variant = "restart"


class RequestTimedOut(SpilloverError):
    """The request ran longer than the gateway's ``request_timeout_s``; it was stopped."""

    status = 504
    type = "server_error"
    code = "request_timeout"


@dataclass(frozen=True)
class HttpError:
    """What ``to_http`` produces: status, OpenAI-shaped body and extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


# What a person reads (chat UIs show ``message`` verbatim): what happened and what to do, in a
# sentence. The technical account stays in ``detail``; ``code`` and ``param`` stay machine-readable.
_FOR_PEOPLE: dict[str, str] = {
    "request_cancelled": "This request was cancelled before it finished. Send it again, with a new Idempotency-Key "
    "if it had one, if you still want an answer.",
    "client_disconnected": "The connection closed before this answer was complete. Send it again (with the same "
    "Idempotency-Key it runs once).",
    "queue_full": "The server is busy right now. Please try again in {s}.",
    "queue_timeout": "The server was too busy to start this request in time. Please try again in {s}.",
    "cpu_queue_full": "The GPU is full and the slower CPU path is busy too. Please try again in {s}.",
    "cpu_unavailable": "The GPU is full and the CPU path is not available. Please try again in {s}.",
    "too_long_for_cpu": (
        "The GPU is full and this conversation is too long for the slower CPU path. "
        "Try again in {s}, or start a shorter conversation."
    ),
    "deadline_exceeded": "This answer cannot be ready before its deadline right now. Try later or allow more time.",
    "deadline_exceeded/alone": "This answer takes longer than its deadline allows, even with nothing ahead of it. "
    "Allow more time.",
    "no_worker_ready": "The model is still loading. Please try again in {s}.",
    "model_load_failed": (
        "The server cannot load the model for this request right now (its status page says why). "
        "Please try again in {s}."
    ),
    "worker_failed": "The model stopped while answering. Please try again in {s}.",
    "server_stopping": "The server is restarting and stopped this request. Please try again in {s}.",
    "failover_interrupted": (
        "The GPU failed partway through this answer, and the rest could not be produced identically "
        "elsewhere. Please try again."
    ),
    "failover_interrupted/restart": (
        "The server restarted partway through this answer, and the rest could not be produced identically. "
        "Please try again."
    ),
    "journal_unavailable": "The server cannot save requests right now (its disk may be full). Please try again later.",
    "request_timeout": "This answer took too long and was stopped. Try a shorter request or a smaller answer length.",
    "context_length_exceeded": "This conversation is too long for the model. Shorten it or start a new one.",
    "context_length_exceeded:input": "This text is too long for the embeddings model. Split it into shorter pieces.",
    "idempotency_key_in_flight": "This request is still being answered. Wait for it to finish.",
    "answer_not_kept": (
        "This request's answer was sent once but was too large to keep. Send it with a new Idempotency-Key "
        "to run it again."
    ),
    "too_many_connections": "The server has too many open connections right now. Please try again in {s}.",
    "body_timeout": "The request arrived too slowly and was dropped. Please send it again.",
}


def for_people(exc: SpilloverError) -> str | None:
    """The sentence a person reads for this error, or None (a developer's error: the
    technical message is the right one)."""
    text = (
        _FOR_PEOPLE.get(f"{exc.code}:{exc.param}")
        or _FOR_PEOPLE.get(f"{exc.code}/{exc.variant}")
        or _FOR_PEOPLE.get(exc.code or "")
    )
    if text is None:
        return None
    retry = getattr(exc, "retry_after_s", None)
    n = max(1, math.ceil(float(retry))) if retry is not None else 1
    return text.format(s="a second" if n == 1 else f"{n} seconds")


def should_retry(exc: SpilloverError) -> bool:
    """Whether the same request, sent again later, can succeed: the gateway was full or a
    worker failed (503, with Retry-After), the key's first request is still running, or its
    body came too slowly (408: never accepted, nothing of it ran; its answer says to send it
    again). Never for a cancelled request (a retry would run what its user stopped), a
    client's mistake, a request's time-out or a bug. SDKs read it from ``x-should-retry``
    before their own status-code rules (openai-python and openai-node retry 408, 409 and 5xx
    otherwise)."""
    return isinstance(exc, CapacityError | IdempotencyInFlight | BodyTimeout | ClientDisconnected)


def _utf8(text: str | None) -> str | None:
    """``text`` as UTF-8 can carry it: a lone surrogate a client sent (JSON's ``"\\ud800"``, in
    a field's name that an error quotes) is written as its escape, ``\\ud800``, instead of
    failing the answer's encoding (a bare 500 in place of the client's 400)."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def to_http(exc: BaseException, request_id: str | None = None) -> HttpError:
    """Map any exception to an OpenAI-shaped HTTP error. The only such mapping. An error of
    an accepted request names it (``request_id`` in the error object)."""
    if not isinstance(exc, SpilloverError):
        exc = SpilloverError(f"internal error: {type(exc).__name__}")
    headers: dict[str, str] = {"x-should-retry": "true" if should_retry(exc) else "false"}
    retry = getattr(exc, "retry_after_s", None)
    if isinstance(exc, CapacityError | DeadlineTooShort) and exc.code:
        headers["X-Spillover-Reason"] = exc.code  # why there was no room, like every other answer
    if isinstance(exc, CapacityError | IdempotencyInFlight) and retry is not None:
        retry_s = max(0.0, float(retry))
        headers["Retry-After"] = str(max(1, math.ceil(retry_s)))
        headers["retry-after-ms"] = str(int(retry_s * 1000))
        if isinstance(exc, CapacityError):  # the wait it was refused for (round 65: the answer's own said 0)
            headers["X-Spillover-Estimated-Delay-Ms"] = headers["retry-after-ms"]
    person = for_people(exc)
    body: dict[str, Any] = {
        "error": {
            "message": _utf8(person or exc.message),
            "type": exc.type,
            "param": _utf8(exc.param),
            "code": exc.code,
        }
    }
    if person is not None:
        body["error"]["detail"] = _utf8(exc.message)
    if request_id is not None:
        body["error"]["request_id"] = request_id
    return HttpError(status=exc.status, body=body, headers=headers)
