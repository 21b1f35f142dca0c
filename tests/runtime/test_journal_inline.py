"""Journal rule 8: a move or an update that finds the journal thread idle is written on the
caller's event loop (no fsync: ``synchronous=NORMAL`` in WAL mode), after the noted moves
before it, in order. An accept, a write queued behind another, one while a read holds the
connection, one that could need a prune, and one past the WAL bound stay on the journal
thread, which checkpoints once that bound is reached."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from spillover.core.lifecycle import State
from spillover.errors import JournalUnavailable
from spillover.runtime import journal as journal_module
from spillover.runtime.journal import Journal, set_disk_full
from tests.runtime.test_journal import run_journal, spy_groups, with_journal
from tests.runtime.test_journal_noted import queued, steps


def spy_threads(j: Journal, *names: str) -> list[tuple[str, str]]:
    """(method, thread name) for each call of ``j``'s methods ``names`` from now on."""
    calls: list[tuple[str, str]] = []
    for name in names:
        real = getattr(j, name)

        @functools.wraps(real)  # its name decides where a write may run
        def spy(*args: Any, _name: str = name, _real: Any = real) -> Any:
            calls.append((_name, threading.current_thread().name))
            return _real(*args)

        setattr(j, name, spy)
    return calls


LOOP = threading.main_thread().name  # asyncio.run runs the loop on the test's (main) thread


def on_thread(calls: list[tuple[str, str]], name: str) -> list[bool]:
    """For each call of ``name``: whether it ran on the journal thread (else on the loop)."""
    return [thread != LOOP for method, thread in calls if method == name]


def test_a_move_with_the_thread_idle_is_written_on_the_loop_after_its_noted_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accept is fsynced on the journal thread; the terminal move, and the noted moves
    waiting before it, are one group written on the loop, in order."""
    monkeypatch.setattr(journal_module, "DEFER_S", 60.0)

    async def body(j: Journal) -> None:
        calls = spy_threads(j, "_accept", "_move", "_update")
        groups = spy_groups(j)
        await queued(j, "r")
        j.note_move("r", State.ADMITTED, route="gpu", attempts=1)
        j.note_move("r", State.RUNNING)
        await j.update("r", tokens_delivered=1)
        await j.move("r", State.COMPLETED, status_code=200, response=b"ok")
        assert on_thread(calls, "_accept") == [True]
        assert on_thread(calls, "_update") == [False]
        assert on_thread(calls, "_move") == [False, False, False]  # ADMITTED, RUNNING (in the group), COMPLETED
        assert groups == [3]  # the two noted moves and the update; the move alone
        rec = await j.get("r")
        assert rec is not None and (rec.state, rec.tokens_delivered, rec.response) == (State.COMPLETED, 1, b"ok")
        assert steps(await j.history("r")) == ["accepted", "queued", "admitted", "running", "completed"]

    with_journal(tmp_path, body)


def test_a_move_queued_behind_a_write_waits_its_turn_on_the_thread(tmp_path: Path) -> None:
    """A move made while the request's accept still waits for the thread is not written
    before it (it would not find the request): it goes to the thread, behind it. The journal
    thread is kept busy until the move is made, so the accept is still queued then: a thread
    that finished it first would leave the journal idle, and the move would rightly be written
    on the loop (a CI run with two test processes at once caught the test assuming a slower
    thread)."""

    async def body(j: Journal) -> None:
        calls = spy_threads(j, "_move")
        for i in range(20):
            gate = threading.Event()
            held: list[bool] = []
            # the thread's next job, ahead of the accept's pass
            j._thread.submit(lambda held=held, gate=gate: held.append(gate.wait(10)))
            accept = asyncio.ensure_future(queued(j, f"r{i}"))
            for _ in range(1000):  # until the accept waits for the thread
                if j._draining:
                    break
                await asyncio.sleep(0.001)
            assert j._draining
            move = asyncio.ensure_future(j.move(f"r{i}", State.ADMITTED, route="gpu"))
            await asyncio.sleep(0.01)
            assert not move.done() and not accept.done()  # both wait for the thread, in order
            gate.set()
            await asyncio.gather(accept, move)
            assert held == [True]
            assert (await j.get(f"r{i}")).state is State.ADMITTED  # type: ignore[union-attr]
        assert on_thread(calls, "_move") == [True] * 20

    with_journal(tmp_path, body)


def test_a_move_while_a_read_holds_the_connection_waits_for_the_thread(tmp_path: Path) -> None:
    async def body(j: Journal) -> None:
        await queued(j, "r")
        calls = spy_threads(j, "_move")
        gate = threading.Event()
        read = asyncio.ensure_future(j._run(gate.wait))
        while not j._db_lock.locked():
            await asyncio.sleep(0.001)
        move = asyncio.ensure_future(j.move("r", State.ADMITTED, route="gpu"))
        await asyncio.sleep(0.05)
        assert not move.done() and calls == []  # not written on the loop, nor yet on the thread
        gate.set()
        await read
        await move
        assert on_thread(calls, "_move") == [True]
        assert (await j.get("r")).state is State.ADMITTED  # type: ignore[union-attr]

    with_journal(tmp_path, body)


def test_a_move_that_could_need_a_prune_goes_to_the_thread(tmp_path: Path) -> None:
    """A write whose upper bound would pass the high-water mark may prune (an fsync and a
    checkpoint): it is left to the thread, which measures and finds room here."""

    async def body(j: Journal) -> None:
        await queued(j, "r")
        calls = spy_threads(j, "_move")
        j._bytes_bound = j._bounds.high_water - j._growth(100)  # room for 100 bytes by the bound
        await j.move("r", State.ADMITTED, route="gpu", reason="x" * 97)  # 100 bytes of text: fits
        j._bytes_bound = j._bounds.high_water - j._growth(100)  # (the write measured the bytes again)
        await j.move("r", State.RUNNING, reason="x" * 101)
        # The second did not fit: it went to the thread, which measured the real bytes in use
        # (far below the mark: no prune); the third is back on the loop.
        await j.move("r", State.COMPLETED, status_code=200)
        assert on_thread(calls, "_move") == [False, True, False]
        assert steps(await j.history("r"))[-3:] == ["admitted", "running", "completed"]

    with_journal(tmp_path, body)


def test_past_the_wal_bound_writes_go_to_the_thread_which_checkpoints(tmp_path: Path) -> None:
    """With SQLite's own checkpoint off, the thread's checkpoints alone keep the WAL within
    the allowance over many requests, while most moves are still written on the loop."""

    async def body(j: Journal) -> None:
        assert j._bounds.wal_pages == 1000  # the default bound's
        j._db_().execute("PRAGMA wal_autocheckpoint=0")
        calls = spy_threads(j, "_move", "_checkpoint_if_due")
        for i in range(300):
            await queued(j, f"r{i}")
            j.note_move(f"r{i}", State.ADMITTED, route="gpu")
            await j.move(f"r{i}", State.RUNNING)
            await j.move(f"r{i}", State.COMPLETED, status_code=200, response=b"x" * 8000)
            assert j._wal_bound <= j._checkpoint_at + 2 * j._growth(8000)  # a pass may end just past it
        busy, wal_frames, _ = j._db_().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0 and wal_frames <= j._bounds.wal_pages
        on_loop = on_thread(calls, "_move").count(False)  # three a request: ADMITTED (noted), RUNNING, COMPLETED
        assert 600 <= on_loop < 900  # some went to the thread (past the bound), most not
        assert set(on_thread(calls, "_checkpoint_if_due")) == {True}

    with_journal(tmp_path, body, max=1000)


def test_a_move_on_the_loop_that_the_disk_refuses_fails_and_writes_nothing(tmp_path: Path) -> None:
    async def body(j: Journal) -> None:
        await queued(j, "r")
        calls = spy_threads(j, "_counted")  # the refused write never reaches _move
        set_disk_full(j.path, True)
        with pytest.raises(JournalUnavailable):
            await j.move("r", State.ADMITTED, route="gpu")
        set_disk_full(j.path, False)
        assert (await j.get("r")).state is State.QUEUED  # type: ignore[union-attr]
        await j.move("r", State.ADMITTED, route="gpu")
        assert on_thread(calls, "_counted") == [False, False]
        assert j.statistics().write_errors == 1

    with_journal(tmp_path, body)


def _closed_journal(tmp_path: Path) -> Journal:
    """A journal that held one queued request ``r``, closed."""

    async def body(j: Journal) -> Journal:
        await queued(j, "r")
        return j

    j: Journal = run_journal(tmp_path / "j.sqlite3", body)
    return j


def test_writes_after_close_fail_on_the_thread_path(tmp_path: Path) -> None:
    """A closed journal writes nothing on the loop: the move fails as any write then does."""
    j = _closed_journal(tmp_path)

    async def late() -> None:
        with pytest.raises(JournalUnavailable):
            await j.move("r", State.ADMITTED, route="gpu")

    asyncio.run(late())


def test_a_closed_journal_answers_every_call_with_its_503(tmp_path: Path) -> None:
    """Round 79's leftover: after ``close`` a write failed with ``RuntimeError`` (the thread
    refused the job) and one that reached a thread whose connection was closed with
    ``AssertionError``: a 500 where a stopping gateway means a 503 with Retry-After. Every
    read and write of a closed journal is ``JournalUnavailable`` now, whichever path it takes."""
    j = _closed_journal(tmp_path)

    async def late() -> None:
        calls = [
            lambda: j.move("r", State.ADMITTED, route="gpu"),
            lambda: j.update("r", tokens_delivered=1),
            lambda: j.get("r"),
            j.count,
            lambda: j.by_key("k"),
        ]
        for call in calls:
            with pytest.raises(JournalUnavailable) as err:
                await call()
            assert err.value.retry_after_s == journal_module.RETRY_AFTER_S
            assert "closed" in err.value.message

    asyncio.run(late())


def test_a_write_that_reaches_the_thread_after_the_connection_closed_is_a_503(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The window inside ``close``: the connection is closed on the thread, the thread still
    runs. A group of writes queued then (two moves at once) gets the closed journal's error,
    and the thread logs no failure of its own."""

    async def body(j: Journal) -> None:
        await queued(j, "a")
        await queued(j, "b")
        await j._run(j._db_().close)  # what ``close`` does on the thread, before the thread ends
        j._db = None
        got = await asyncio.gather(
            j.move("a", State.ADMITTED, route="gpu"), j.move("b", State.ADMITTED, route="gpu"), return_exceptions=True
        )
        assert [type(e) for e in got] == [JournalUnavailable, JournalUnavailable]

    with caplog.at_level(logging.ERROR, logger="spillover.journal"):
        with_journal(tmp_path, body)
    assert not [r for r in caplog.records if "failed on the journal thread" in r.getMessage()]
