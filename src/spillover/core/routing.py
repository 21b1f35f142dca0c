"""Routing policy as values: which lane may take a request, and what a failed attempt becomes.

Rules:

1. A lane takes a request only when prompt + ``max_tokens`` fits its context cap, and the
   prompt leaves room for at least one new token (``fits_lane``); a request that may be
   shrunk needs room for ``min(max_tokens, MIN_SHRUNK_TOKENS)`` and runs with the room the
   lane has (``lane_max_tokens``). The same rule holds
   whichever way a request reaches the lane: admission, the client's ``prefer: cpu``, the
   CPU canary, a failover, a replay after restart.
2. A failed attempt ends (``Fail``) when the request was cancelled, when the fault is the
   client's (a context overflow or a grammar the engine refuses: those never count against
   the device), when it ran on the CPU lane (there is nowhere further to go), or when the
   attempts are spent.
3. Otherwise a device fault (the GPU worker's, or a split worker's: ``DEVICE_ROUTES``) is
   replayed on the CPU lane (``Replay``) when nothing has been
   delivered, or continued there (``Continue``) when the delivered tokens provably come out
   the same: a greedy, unconstrained, incremental stream, continuation enabled, and a CPU
   worker whose compatibility *and* numerics fingerprints match.
4. Replay needs a CPU path: a replica (compatibility fingerprint matches) or a configured
   fallback model (only at a request boundary: never a continuation).
5. The CPU path must fit the request (rule 1); otherwise the failure is final.
6. After a gateway restart an unfinished request is replayed when nothing of it reached
   its client: it is not a stream, or it is a stream that had delivered no token, whatever
   its state (a stream that failed over mid-answer is QUEUED again with tokens delivered)
   (``replayable_after_restart``).

The reasons admission and routing give are values: ``Reason`` and ``FailoverReason``
(``core.reasons``, re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spillover.core.lifecycle import State
from spillover.core.reasons import FailoverReason, Reason, RouteReason

__all__ = [
    "CLIENT_FAULTS",
    "DEVICE_ROUTES",
    "MIN_SHRUNK_TOKENS",
    "SEVERE_FAULTS",
    "Continue",
    "Fail",
    "FailKind",
    "FailoverFacts",
    "FailoverReason",
    "Plan",
    "Reason",
    "Replay",
    "RouteReason",
    "fault_outcome",
    "fits_lane",
    "lane_max_tokens",
    "plan_failover",
    "replayable_after_restart",
]

DEVICE_ROUTES = frozenset({"gpu", "split"})  # routes whose worker holds device memory
SEVERE_FAULTS = frozenset({"alloc_failed", "oom", "crash", "driver_reset"})
# the request's own faults: not the lane's
CLIENT_FAULTS = frozenset({"context_overflow", "bad_grammar", "empty_prompt", "bad_audio"})


def fault_outcome(kind: str) -> str:
    """What a failed attempt of ``kind`` tells the breaker (``core.breaker.ATTEMPT_OUTCOMES``):
    ``client`` for the request's own fault, ``severe`` for a device's, else ``failed``."""
    return "client" if kind in CLIENT_FAULTS else "severe" if kind in SEVERE_FAULTS else "failed"


MIN_SHRUNK_TOKENS = 16  # a request shrunk to fit (GPU memory, a lane's context) keeps at least this many


def fits_lane(
    prompt_tokens: int,
    max_tokens: int,
    ctx_cap_tokens: int,
    *,
    shrinkable: bool = False,
    min_tokens: int = MIN_SHRUNK_TOKENS,
) -> bool:
    """Whether a lane with ``ctx_cap_tokens`` can run the prompt and all of ``max_tokens``;
    for a request that may be shrunk, ``min(max_tokens, min_tokens)`` of them suffice."""
    need = min(max_tokens, min_tokens) if shrinkable else max_tokens
    return prompt_tokens < ctx_cap_tokens and prompt_tokens + need <= ctx_cap_tokens


def lane_max_tokens(prompt_tokens: int, max_tokens: int, ctx_cap_tokens: int, *, shrinkable: bool) -> int:
    """``max_tokens`` on a lane: a request that may be shrunk gets the room the lane has."""
    if not shrinkable:
        return max_tokens
    return max(1, min(max_tokens, ctx_cap_tokens - prompt_tokens))


class FailKind(str, Enum):
    """Why a failed attempt is final (the runtime maps each to one error)."""

    CANCELLED = "cancelled"
    CLIENT = "client"  # the request cannot run anywhere as it is: 400
    NO_REPLICA = "no_replica"
    CPU_FAILED = "cpu_failed"
    ATTEMPTS_SPENT = "attempts_spent"
    NOT_CONTINUABLE = "not_continuable"
    CPU_TOO_SMALL = "cpu_too_small"


@dataclass(frozen=True)
class FailoverFacts:
    """Everything the failover decision depends on, as plain values."""

    route: str  # the lane of the failed attempt: gpu | cpu
    fault: str  # the worker's error kind, or crash / driver_reset / stall
    cancelled: bool
    attempt: int  # this run's attempts so far (a resume starts a run: ``runtime.executor`` rule 1)
    max_attempts: int
    delivered_tokens: int
    incremental: bool  # tokens reach the client as they are made
    continue_mid_stream: bool  # configuration
    greedy: bool
    constrained: bool  # a grammar constrains the output
    replica_compat: bool  # a CPU worker's compatibility fingerprint matches
    replica_numerics: bool  # ... and its numerics fingerprint too
    cpu_fallback: bool  # the CPU lane serves a configured fallback model
    cpu_fits: bool  # the CPU lane's context cap fits the request (rule 1)


@dataclass(frozen=True)
class Replay:
    """Run again from the start on the CPU lane (nothing was delivered)."""

    fault: str


@dataclass(frozen=True)
class Continue:
    """Continue on the CPU replica from the delivered tokens (provably identical)."""

    fault: str


@dataclass(frozen=True)
class Fail:
    """The request ends here with this kind of error."""

    kind: FailKind
    fault: str


Plan = Replay | Continue | Fail


def plan_failover(f: FailoverFacts) -> Plan:
    """What a failed attempt becomes (rules 2-5)."""
    if f.cancelled:
        return Fail(FailKind.CANCELLED, f.fault)
    if f.fault in CLIENT_FAULTS:
        return Fail(FailKind.CLIENT, f.fault)
    if f.route not in DEVICE_ROUTES:
        return Fail(FailKind.CPU_FAILED, f.fault)
    if f.attempt >= f.max_attempts:
        return Fail(FailKind.ATTEMPTS_SPENT, f.fault)
    if f.delivered_tokens:
        continuable = (
            f.continue_mid_stream
            and f.incremental
            and f.greedy
            and not f.constrained
            and f.replica_compat
            and f.replica_numerics
        )
        if not continuable:
            return Fail(FailKind.NOT_CONTINUABLE, f.fault)
    elif not (f.replica_compat or f.cpu_fallback):
        return Fail(FailKind.NO_REPLICA, f.fault)
    if not f.cpu_fits:
        return Fail(FailKind.CPU_TOO_SMALL, f.fault)
    return Continue(f.fault) if f.delivered_tokens else Replay(f.fault)


def replayable_after_restart(state: State, stream: bool, tokens_delivered: int) -> bool:
    """Whether an unfinished request found after a restart may run again (rule 6)."""
    if stream and tokens_delivered > 0:
        return False
    return state in (State.ACCEPTED, State.QUEUED, State.ADMITTED, State.RUNNING)
