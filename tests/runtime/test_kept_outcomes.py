"""Outcomes the journal could not take when a request ended (``Gateway.store_outcome``), written
later by ``Gateway._flush_outcomes``: one still refused after ``OUTCOME_TRIES`` tries is written
without its stored answer. A completed one's answer was never sent (an answer goes out only once
it is durable), so it ends resumable: its key runs it again, instead of replaying an answer
that is not there."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from spillover.core.lifecycle import State
from spillover.errors import JournalUnavailable
from spillover.runtime.gateway import OUTCOME_TRIES, Gateway


class _RefusesAnswers:
    """A journal with no room for a stored answer (a row too large while the disk is fine)."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, State, dict[str, Any]]] = []

    async def move(self, rid: str, state: State, **fields: Any) -> None:
        if fields.get("response") is not None:
            raise JournalUnavailable("no room for it")
        self.moves.append((rid, state, fields))


def test_a_kept_answer_refused_for_good_ends_resumable_and_an_error_keeps_its_state() -> None:
    journal = _RefusesAnswers()
    gw = SimpleNamespace(
        journal=journal,
        pending_outcomes={
            "done": (State.COMPLETED, {"response": b"{}", "status_code": 200, "route": "gpu"}),
            "gone": (State.CANCELLED, {"response": b"{}", "status_code": 409, "route": "gpu"}),
        },
        _outcome_tries={},
    )
    for _ in range(OUTCOME_TRIES):
        asyncio.run(Gateway._flush_outcomes(gw))  # type: ignore[arg-type]
    assert journal.moves == [] and len(gw.pending_outcomes) == 2  # tried again, not dropped yet
    asyncio.run(Gateway._flush_outcomes(gw))  # type: ignore[arg-type]
    assert gw.pending_outcomes == {}
    done, gone = journal.moves
    assert done[:2] == ("done", State.RESUMABLE_ERROR) and done[2]["response"] is None  # its key runs it again
    assert done[2]["status_code"] == 503 and done[2]["route"] == "gpu" and "dropped" in done[2]["reason"]
    assert gone[:2] == ("gone", State.CANCELLED) and gone[2]["response"] is None  # its error was sent
