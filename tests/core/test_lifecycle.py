"""The request lifecycle table, row by row, against moves written out by hand (not read from
the table under test, so a missing, extra or changed row fails)."""

from __future__ import annotations

import itertools

import pytest

from spillover.core.lifecycle import RESUMABLE, TERMINAL, TRANSITIONS, IllegalTransition, State, advance

S = State

# Every legal move, typed out from the module's rules (not from TRANSITIONS).
LEGAL: list[tuple[State, State]] = [
    (S.RECEIVED, S.ACCEPTED),
    (S.RECEIVED, S.REJECTED),  # bad input never gets recorded
    (S.ACCEPTED, S.QUEUED),
    (S.ACCEPTED, S.REJECTED),
    (S.ACCEPTED, S.CANCELLED),
    (S.ACCEPTED, S.RESUMABLE_ERROR),  # a gateway restart found it unrecoverable
    (S.QUEUED, S.ADMITTED),
    (S.QUEUED, S.QUEUED),  # moved to another lane
    (S.QUEUED, S.CANCELLED),
    (S.QUEUED, S.REJECTED),
    (S.QUEUED, S.RESUMABLE_ERROR),  # a failover found no lane
    (S.ADMITTED, S.RUNNING),
    (S.ADMITTED, S.QUEUED),  # allocation failed before generation: replay
    (S.ADMITTED, S.FAILED),
    (S.ADMITTED, S.CANCELLED),
    (S.ADMITTED, S.RESUMABLE_ERROR),
    (S.RUNNING, S.COMPLETED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLED),
    (S.RUNNING, S.QUEUED),  # a replayable fault
    (S.RUNNING, S.RESUMABLE_ERROR),  # a fault that cannot be replayed
    (S.RESUMABLE_ERROR, S.QUEUED),  # resumed with the same Idempotency-Key
    (S.ACCEPTED, S.FAILED),  # an internal error before it was queued
    (S.QUEUED, S.FAILED),  # its time limit passed while it waited
    (S.REJECTED, S.QUEUED),  # retried with the same Idempotency-Key
    (S.RESUMABLE_ERROR, S.CANCELLED),  # a DELETE: its key never resumes it (round 25)
    (S.REJECTED, S.CANCELLED),
]

ILLEGAL = [pair for pair in itertools.product(State, State) if pair not in LEGAL]


def _id(pair: tuple[State, State]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def test_the_hand_written_list_has_27_distinct_moves() -> None:
    """The expectation itself is sound: 27 moves, none listed twice."""
    assert len(LEGAL) == 27 and len(set(LEGAL)) == 27


@pytest.mark.parametrize("pair", LEGAL, ids=_id)
def test_legal_move_lands_on_its_target(pair: tuple[State, State]) -> None:
    """Each legal move (written out above) is allowed and returns its target state."""
    src, dst = pair
    assert advance(src, dst) is dst


@pytest.mark.parametrize("pair", ILLEGAL, ids=_id)
def test_every_other_move_raises_and_names_it(pair: tuple[State, State]) -> None:
    """Each of the 73 other (from, to) pairs raises IllegalTransition naming the move."""
    src, dst = pair
    with pytest.raises(IllegalTransition, match=f"^{src.value} -> {dst.value} is not allowed$"):
        advance(src, dst)


def test_table_is_exactly_the_written_moves() -> None:
    """TRANSITIONS holds the 27 written moves and nothing else (an extra row fails too)."""
    assert set(TRANSITIONS) == set(LEGAL)


def test_terminal_and_resumable_sets() -> None:
    """Five states end a request; of those, only RESUMABLE_ERROR and REJECTED can be resumed."""
    assert set(TERMINAL) == {S.COMPLETED, S.FAILED, S.CANCELLED, S.REJECTED, S.RESUMABLE_ERROR}
    assert set(RESUMABLE) == {S.RESUMABLE_ERROR, S.REJECTED}


@pytest.mark.parametrize("terminal", [S.COMPLETED, S.FAILED, S.CANCELLED])
def test_final_states_have_no_exit(terminal: State) -> None:
    """COMPLETED, FAILED and CANCELLED refuse every move, back to QUEUED included."""
    for dst in State:
        with pytest.raises(IllegalTransition):
            advance(terminal, dst)


def test_a_resumed_request_walks_the_whole_happy_path() -> None:
    """A request rejected once, retried with its key, runs to completion move by move."""
    path = [S.RECEIVED, S.ACCEPTED, S.QUEUED, S.REJECTED, S.QUEUED, S.ADMITTED, S.RUNNING, S.COMPLETED]
    state = path[0]
    for dst in path[1:]:
        state = advance(state, dst)
    assert state is S.COMPLETED
