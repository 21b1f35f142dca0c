"""Journal rule 7: intermediate moves (ADMITTED, RUNNING) that nobody waits for commit with
the next write that is waited for, or within DEFER_S; one that cannot be written goes
first, in order, in the same request's next write; closing writes what is still queued."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from spillover.core.lifecycle import State
from spillover.core.routing import replayable_after_restart
from spillover.errors import JournalUnavailable
from spillover.runtime import journal as journal_module
from spillover.runtime.journal import Journal, set_disk_full
from tests.runtime.test_journal import _held, run_journal, spy_groups, with_journal


async def queued(j: Journal, rid: str, *, stream: bool = False) -> None:
    await j.accept(
        rid=rid, idem_key=None, body_hash="h", kind="text", stream=stream, body="{}", model="m",
        queued={"route": "gpu", "attempts": 1},
    )  # fmt: skip


def steps(history: list[dict[str, Any]]) -> list[str]:
    return [h["to"] for h in history]


def test_noted_moves_commit_with_the_next_waited_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Noted ADMITTED and RUNNING are not written until a write is waited for; then all three
    commit in one transaction, in order, each with its own time."""
    monkeypatch.setattr(journal_module, "DEFER_S", 60.0)

    async def body(j: Journal) -> None:
        await queued(j, "r")
        groups = spy_groups(j)
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)
        j.note_move("r", State.RUNNING)
        await asyncio.sleep(0.05)
        assert (await j.get("r")).state is State.QUEUED  # type: ignore[union-attr]
        await j.move("r", State.COMPLETED, status_code=200, response=b"ok")
        assert groups == [3]
        rec = await j.get("r")
        assert rec is not None and (rec.state, rec.route) == (State.COMPLETED, "gpu")
        history = await j.history("r")
        assert steps(history) == ["accepted", "queued", "admitted", "running", "completed"]
        assert history[3]["t_s"] <= history[4]["t_s"] - 0.04  # each move keeps the time it was noted
        assert j.statistics().writes == 4

    with_journal(tmp_path, body)


def test_a_noted_move_alone_is_written_within_defer_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing else to write, the timer writes a noted move within DEFER_S, then stops."""
    monkeypatch.setattr(journal_module, "DEFER_S", 0.05)

    async def body(j: Journal) -> None:
        await queued(j, "r")
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if (await j.get("r")).state is State.ADMITTED:  # type: ignore[union-attr]
                break
        assert (await j.get("r")).state is State.ADMITTED  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
        assert j._tick_handle is None and not j._pending

    with_journal(tmp_path, body)


def test_a_noted_move_that_cannot_be_written_goes_first_in_the_next_write(tmp_path: Path) -> None:
    """On a full disk a noted move fails without a caller to tell: it is counted, kept, and
    the request's next write fails while the disk stays full; once it is free the next
    write writes both, in order. An update (tokens delivered) catches up the same way, so
    a stream is never found delivered yet not RUNNING (it would be replayed)."""

    async def body(j: Journal) -> None:
        await queued(j, "r")
        await queued(j, "s", stream=True)
        set_disk_full(j.path, True)
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)
        j.note_move("s", State.ADMITTED, route="gpu", attempts=1)
        j.note_move("s", State.RUNNING)
        await j.flush()
        assert j.statistics().write_errors == 3
        with pytest.raises(JournalUnavailable):
            await j.move("r", State.RUNNING)
        set_disk_full(j.path, False)
        await j.move("r", State.RUNNING)
        assert steps(await j.history("r")) == ["accepted", "queued", "admitted", "running"]
        await j.update("s", tokens_delivered=1)
        rec = await j.get("s")
        assert rec is not None and (rec.state, rec.tokens_delivered) == (State.RUNNING, 1)
        assert not replayable_after_restart(rec.state, rec.stream, rec.tokens_delivered)
        assert j._unwritten == {}

    with_journal(tmp_path, body)


def test_a_rolled_back_group_keeps_the_moves_it_caught_up(tmp_path: Path) -> None:
    """A group that wrote a request's kept moves and then rolls back (a write in it failed
    after writing) puts them back: the one-by-one rerun writes them."""

    async def body(j: Journal) -> None:
        await queued(j, "r")
        set_disk_full(j.path, True)
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)
        await j.flush()
        set_disk_full(j.path, False)
        got = await _held(j, [j.move("r", State.RUNNING), j.update("r", no_such_column=1)])
        assert got[0] is None and isinstance(got[1], JournalUnavailable)
        assert steps(await j.history("r")) == ["accepted", "queued", "admitted", "running"]

    with_journal(tmp_path, body)


def test_closing_writes_the_noted_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A noted move still queued when the journal closes is written before it closes."""
    monkeypatch.setattr(journal_module, "DEFER_S", 60.0)
    path = tmp_path / "j.sqlite3"

    async def first(j: Journal) -> None:
        await queued(j, "r")
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)

    async def second(j: Journal) -> list[dict[str, Any]]:
        return await j.history("r")

    run_journal(path, first)
    assert steps(run_journal(path, second)) == ["accepted", "queued", "admitted"]


def test_an_illegal_noted_move_is_logged_and_writes_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A noted move the lifecycle refuses (a bug: nobody waits to be told) is logged, alone
    or in a group, and the writes beside it stand."""

    async def body(j: Journal) -> None:
        await queued(j, "r")
        j.note_move("r", State.COMPLETED)  # QUEUED -> COMPLETED is not a move
        await j.flush()
        groups = spy_groups(j)
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)
        j.note_move("r", State.COMPLETED)  # nor is ADMITTED -> COMPLETED
        await j.move("r", State.RUNNING)
        assert groups == [3]
        assert steps(await j.history("r")) == ["accepted", "queued", "admitted", "running"]

    with caplog.at_level("ERROR", logger="spillover.journal"):
        with_journal(tmp_path, body)
    refused = [r.getMessage() for r in caplog.records if "noted move" in r.getMessage()]
    assert len(refused) == 2 and all("IllegalTransition" in m for m in refused)
