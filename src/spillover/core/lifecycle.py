"""The request lifecycle: one enum, one transition table, one ``advance()``.

Rules:

1. A request is ACCEPTED only once it is durably recorded; bad input never gets there.
2. Every move is a row of ``TRANSITIONS``; anything else raises ``IllegalTransition``
   and changes nothing.
3. COMPLETED, FAILED, CANCELLED, REJECTED and RESUMABLE_ERROR are terminal.
4. A fault while RUNNING either re-queues (replayable) or ends as RESUMABLE_ERROR.
   A request may also fail before it runs (its time limit passes while it waits).
5. RESUMABLE_ERROR and REJECTED end a request, but a retry with the same Idempotency-Key
   resumes it (back to QUEUED, same id, next attempt): ``RESUMABLE``. A DELETE of one ends
   it CANCELLED for good: its key then answers the cancellation, and it never runs again.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["RESUMABLE", "TERMINAL", "TRANSITIONS", "IllegalTransition", "State", "advance"]


class State(str, Enum):
    """Where a request is in its life."""

    RECEIVED = "received"
    ACCEPTED = "accepted"
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    RESUMABLE_ERROR = "resumable_error"


class IllegalTransition(Exception):
    """A move that the table does not allow; a bug in the caller."""


S = State
TRANSITIONS: frozenset[tuple[State, State]] = frozenset(
    {
        (S.RECEIVED, S.ACCEPTED),
        (S.RECEIVED, S.REJECTED),
        (S.ACCEPTED, S.QUEUED),
        (S.ACCEPTED, S.REJECTED),
        (S.ACCEPTED, S.CANCELLED),
        (S.QUEUED, S.ADMITTED),
        (S.QUEUED, S.QUEUED),  # moved to another lane (routing)
        (S.QUEUED, S.CANCELLED),
        (S.QUEUED, S.REJECTED),
        (S.ADMITTED, S.RUNNING),
        (S.ADMITTED, S.QUEUED),  # allocation failed before generation: replay
        (S.ADMITTED, S.FAILED),
        (S.ADMITTED, S.CANCELLED),
        (S.RUNNING, S.COMPLETED),
        (S.RUNNING, S.FAILED),
        (S.RUNNING, S.CANCELLED),
        (S.RUNNING, S.QUEUED),  # fault, replayable
        (S.RUNNING, S.RESUMABLE_ERROR),  # fault, not replayable
        (S.ACCEPTED, S.RESUMABLE_ERROR),  # gateway restart found it unrecoverable
        (S.ACCEPTED, S.FAILED),  # ended before it was queued (an internal error)
        (S.QUEUED, S.FAILED),  # ended while waiting (its request_timeout_s passed)
        (S.QUEUED, S.RESUMABLE_ERROR),  # a failover found no lane to go to
        (S.ADMITTED, S.RESUMABLE_ERROR),
        (S.RESUMABLE_ERROR, S.QUEUED),  # resumed with the same Idempotency-Key
        (S.REJECTED, S.QUEUED),  # retried with the same Idempotency-Key
        (S.RESUMABLE_ERROR, S.CANCELLED),  # a DELETE: never resumed
        (S.REJECTED, S.CANCELLED),
    }
)

TERMINAL: frozenset[State] = frozenset({S.COMPLETED, S.FAILED, S.CANCELLED, S.REJECTED, S.RESUMABLE_ERROR})
RESUMABLE: frozenset[State] = frozenset({S.RESUMABLE_ERROR, S.REJECTED})


def advance(current: State, target: State) -> State:
    """Return ``target`` if the table allows ``current -> target``; raise otherwise."""
    if (current, target) not in TRANSITIONS:
        raise IllegalTransition(f"{current.value} -> {target.value} is not allowed")
    return target
