"""The request lifecycle table, row by row."""

from __future__ import annotations

import itertools

import pytest

from spillover.core.lifecycle import RESUMABLE, TERMINAL, TRANSITIONS, IllegalTransition, State, advance


@pytest.mark.parametrize(("src", "dst"), sorted(TRANSITIONS, key=lambda t: (t[0].value, t[1].value)))
def test_allowed_rows_advance(src: State, dst: State) -> None:
    """Every row of the table is a legal move that lands on its target."""
    assert advance(src, dst) is dst


@pytest.mark.parametrize(
    ("src", "dst"),
    [p for p in itertools.product(State, State) if p not in TRANSITIONS],
)
def test_every_other_move_raises(src: State, dst: State) -> None:
    """Any move not in the table raises IllegalTransition."""
    with pytest.raises(IllegalTransition):
        advance(src, dst)


def test_terminal_states_have_no_exit_but_resume() -> None:
    """The only rows out of a terminal state resume a resumable one back to QUEUED."""
    leaving = {t for t in TRANSITIONS if t[0] in TERMINAL}
    assert leaving == {(s, State.QUEUED) for s in RESUMABLE}
