"""Routing policy as values: the lane-fit rule at its boundary, and the failover plan row by
row, with every expectation written out by hand (not derived from the code under test)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.lifecycle import State
from spillover.core.routing import (
    Continue,
    Fail,
    FailKind,
    FailoverFacts,
    Replay,
    fault_outcome,
    fits_lane,
    lane_max_tokens,
    plan_failover,
    replayable_after_restart,
)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "cap", "fits"),
    [
        (1000, 24, 1024, True),  # exactly the cap
        (1000, 25, 1024, False),  # one over
        (1023, 1, 1024, True),  # the last position
        (1024, 1, 1024, False),  # the prompt alone fills the context
        (1024, 0, 1024, False),  # ... and leaves no room even for nothing
        (0, 1024, 1024, True),
        (1131, 256, 1024, False),  # the empty-200 case
    ],
)
def test_fits_lane_boundaries(prompt: int, max_tokens: int, cap: int, fits: bool) -> None:
    """prompt + max_tokens may equal the cap, never exceed it, and the prompt must leave a token."""
    assert fits_lane(prompt, max_tokens, cap) is fits


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "cap", "min_tokens", "fits"),
    [
        (1000, 500, 1024, 16, True),  # room for 24 of 500: enough once shrunk
        (1008, 500, 1024, 16, True),  # room for exactly 16
        (1009, 500, 1024, 16, False),  # room for 15
        (1020, 4, 1024, 16, True),  # asks for fewer than 16: all 4 fit
        (1021, 4, 1024, 16, False),
        (1010, 500, 1024, 8, True),  # a smaller floor
        (1024, 500, 1024, 1, False),  # the prompt alone fills the context
    ],
)
def test_a_shrinkable_request_needs_room_for_min_of_max_tokens_and_the_floor(
    prompt: int, max_tokens: int, cap: int, min_tokens: int, fits: bool
) -> None:
    """shrinkable=True needs room for min(max_tokens, min_tokens) new tokens; without it, all."""
    assert fits_lane(prompt, max_tokens, cap, shrinkable=True, min_tokens=min_tokens) is fits
    assert fits_lane(prompt, max_tokens, cap, min_tokens=min_tokens) is (prompt + max_tokens <= cap)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "cap", "shrinkable", "expected"),
    [
        (1000, 500, 1024, True, 24),  # the room the lane has
        (1000, 20, 1024, True, 20),  # it fits: unchanged
        (1000, 24, 1024, True, 24),  # exactly the room
        (1024, 500, 1024, True, 1),  # never below one
        (1000, 500, 1024, False, 500),  # not allowed to shrink: as asked
    ],
)
def test_lane_max_tokens(prompt: int, max_tokens: int, cap: int, shrinkable: bool, expected: int) -> None:
    """A shrinkable request runs with min(max_tokens, the lane's room), at least 1; others as asked."""
    assert lane_max_tokens(prompt, max_tokens, cap, shrinkable=shrinkable) == expected


BASE = FailoverFacts(
    route="gpu",
    fault="alloc_failed",
    cancelled=False,
    attempt=1,
    max_attempts=3,
    delivered_tokens=0,
    incremental=False,
    continue_mid_stream=True,
    greedy=False,
    constrained=False,
    replica_compat=True,
    replica_numerics=True,
    cpu_fallback=False,
    cpu_fits=True,
)
STREAMING = replace(BASE, delivered_tokens=7, incremental=True, greedy=True)

ROWS: list[tuple[str, FailoverFacts, object]] = [
    ("nothing delivered, replica: replay", BASE, Replay("alloc_failed")),
    ("a crash replays too", replace(BASE, fault="crash"), Replay("crash")),
    ("a stall replays", replace(BASE, fault="stall"), Replay("stall")),
    ("an engine error replays", replace(BASE, fault="engine"), Replay("engine")),
    ("cancelled wins over everything", replace(BASE, cancelled=True), Fail(FailKind.CANCELLED, "alloc_failed")),
    ("cancelled on the CPU", replace(BASE, route="cpu", cancelled=True), Fail(FailKind.CANCELLED, "alloc_failed")),
    (
        "a context overflow is the client's",
        replace(BASE, fault="context_overflow"),
        Fail(FailKind.CLIENT, "context_overflow"),
    ),
    ("a bad grammar is the client's", replace(BASE, fault="bad_grammar"), Fail(FailKind.CLIENT, "bad_grammar")),
    (
        "a client fault on the CPU",
        replace(BASE, route="cpu", fault="bad_grammar"),
        Fail(FailKind.CLIENT, "bad_grammar"),
    ),
    ("a CPU failure has nowhere to go", replace(BASE, route="cpu"), Fail(FailKind.CPU_FAILED, "alloc_failed")),
    ("attempts spent", replace(BASE, attempt=3), Fail(FailKind.ATTEMPTS_SPENT, "alloc_failed")),
    ("one attempt left", replace(BASE, attempt=2), Replay("alloc_failed")),
    ("no replica, no fallback", replace(BASE, replica_compat=False), Fail(FailKind.NO_REPLICA, "alloc_failed")),
    (
        "no replica but a fallback: replay there",
        replace(BASE, replica_compat=False, replica_numerics=False, cpu_fallback=True),
        Replay("alloc_failed"),
    ),
    ("the CPU lane is too small", replace(BASE, cpu_fits=False), Fail(FailKind.CPU_TOO_SMALL, "alloc_failed")),
    ("greedy stream, identical replica: continue", STREAMING, Continue("alloc_failed")),
    ("sampled stream", replace(STREAMING, greedy=False), Fail(FailKind.NOT_CONTINUABLE, "alloc_failed")),
    ("constrained stream", replace(STREAMING, constrained=True), Fail(FailKind.NOT_CONTINUABLE, "alloc_failed")),
    (
        "continuation switched off",
        replace(STREAMING, continue_mid_stream=False),
        Fail(FailKind.NOT_CONTINUABLE, "alloc_failed"),
    ),
    ("other numerics", replace(STREAMING, replica_numerics=False), Fail(FailKind.NOT_CONTINUABLE, "alloc_failed")),
    (
        "other model: no continuation even with a fallback",
        replace(STREAMING, replica_compat=False, replica_numerics=False, cpu_fallback=True),
        Fail(FailKind.NOT_CONTINUABLE, "alloc_failed"),
    ),
    (
        "delivered but not incremental (a buffered tool call)",
        replace(STREAMING, incremental=False),
        Fail(FailKind.NOT_CONTINUABLE, "alloc_failed"),
    ),
    (
        "continuable but the CPU lane is too small",
        replace(STREAMING, cpu_fits=False),
        Fail(FailKind.CPU_TOO_SMALL, "alloc_failed"),
    ),
    ("a continuation needs attempts too", replace(STREAMING, attempt=3), Fail(FailKind.ATTEMPTS_SPENT, "alloc_failed")),
]


@pytest.mark.parametrize(("why", "facts", "plan"), ROWS, ids=[r[0] for r in ROWS])
def test_failover_plan(why: str, facts: FailoverFacts, plan: object) -> None:
    """Each row: the facts of a failed attempt and the plan written out by hand."""
    assert plan_failover(facts) == plan, why


S = State
RESTART_ROWS = [
    (S.ACCEPTED, False, 0, True),
    (S.QUEUED, True, 0, True),
    (S.ADMITTED, True, 0, True),
    (S.RUNNING, False, 0, True),
    (S.RUNNING, False, 40, True),  # non-stream: nothing reached the client
    (S.RUNNING, True, 0, True),  # a stream before its first token
    (S.RUNNING, True, 1, False),  # a stream that delivered a token
    (S.QUEUED, True, 3, False),  # a stream queued again for a continuation after a failover
    (S.ADMITTED, True, 3, False),  # ... and admitted: its noted RUNNING not yet committed
    (S.QUEUED, False, 3, True),
]


@pytest.mark.parametrize(("state", "stream", "delivered", "replay"), RESTART_ROWS)
def test_replayable_after_restart(state: State, stream: bool, delivered: int, replay: bool) -> None:
    """After a restart, replay exactly what no client has seen any of."""
    assert replayable_after_restart(state, stream, delivered) is replay


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [
        ("bad_audio", "client"),  # the request's own: says nothing of the lane (round 28)
        ("bad_grammar", "client"),
        ("context_overflow", "client"),
        ("oom", "severe"),
        ("alloc_failed", "severe"),
        ("crash", "severe"),
        ("driver_reset", "severe"),
        ("engine", "failed"),
        ("stall", "failed"),
    ],
)
def test_a_failed_attempts_kind_tells_the_breaker_whose_fault_it_was(kind: str, outcome: str) -> None:
    assert fault_outcome(kind) == outcome
