"""The journal's byte bound and write errors: SQLite's ``max_page_count`` is the full disk.
A failed write raises JournalUnavailable and leaves no transaction open; pruning by bytes
keeps the files within the bound and never touches unfinished requests; the files are 0600."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from spillover.config import load_config
from spillover.core.lifecycle import IllegalTransition, State
from spillover.errors import ConfigError, JournalUnavailable, to_http
from spillover.runtime.journal import SCHEMA, Journal
from tests.runtime.test_journal import run_journal

MIB = 1024 * 1024


def with_journal(path: Path, max_bytes: int, body: Callable[[Journal], Awaitable[Any]], **kw: Any) -> Any:
    """Open a journal at ``path`` bounded to ``max_bytes``, run ``body`` against it, close it."""
    return run_journal(path, body, max_bytes=max_bytes, **kw)


async def accept(j: Journal, rid: str, size: int = 2) -> None:
    await j.accept(rid=rid, idem_key=None, body_hash="h", kind="text", stream=False, body="x" * size, model="m")


async def finish(j: Journal, rid: str, response: bytes | None = None) -> None:
    for state in (State.QUEUED, State.ADMITTED, State.RUNNING):
        await j.move(rid, state, route="gpu", attempts=1)
    await j.move(rid, State.COMPLETED, response=response)


def assert_no_open_transaction(path: Path) -> None:
    """A second connection takes the write lock at once: the journal holds no transaction open."""
    with closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")


def run_sql(path: Path, sql: str) -> None:
    """Change the journal's database from outside (used to inject failures with triggers)."""
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute(sql)


def files_bytes(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def test_a_write_past_the_bound_fails_cleanly_and_succeeds_after_pruning(tmp_path: Path) -> None:
    """A write past max_bytes (an answer too big for what unfinished requests leave) raises
    JournalUnavailable from SQLITE_FULL, writes nothing and leaves no transaction open; once
    other requests finish, the same write prunes them and fits."""
    path = tmp_path / "j.sqlite3"
    answer = b"a" * 500_000

    async def body(j: Journal) -> None:
        for i in range(5):
            await accept(j, f"u{i}", 100_000)
        await accept(j, "r")
        for state in (State.QUEUED, State.ADMITTED, State.RUNNING):
            await j.move("r", state)
        with pytest.raises(JournalUnavailable) as info:
            await j.move("r", State.COMPLETED, response=answer)
        cause = info.value.__cause__
        assert isinstance(cause, sqlite3.OperationalError) and cause.sqlite_errorcode == sqlite3.SQLITE_FULL
        assert (info.value.status, info.value.code, info.value.retry_after_s) == (503, "journal_unavailable", 2.0)
        assert_no_open_transaction(path)
        rec = await j.get("r")
        assert rec is not None and (rec.state, rec.response) == (State.RUNNING, None)
        assert [h["to"] for h in await j.history("r")][-1] == "running"
        stats = j.statistics()
        assert (stats.rows, stats.writes, stats.write_errors, stats.max_bytes) == (6, 9, 1, MIB)

        for i in range(4):
            await finish(j, f"u{i}")
        await j.move("r", State.COMPLETED, response=answer)  # makes room: u0..u3 go, u4 stays
        rec = await j.get("r")
        assert rec is not None and rec.state is State.COMPLETED and rec.response == answer
        assert [r.id for r in await j.unfinished()] == ["u4"]
        assert [i for i in range(4) if await j.get(f"u{i}") is not None] == []
        stats = j.statistics()
        assert (stats.rows, stats.writes, stats.write_errors) == (2, 26, 1)
        assert 600_000 < stats.bytes_used <= int(0.8 * MIB)
        assert "\n" not in repr(j) and "write_errors=1" in repr(j)

    with_journal(path, MIB, body)


def test_a_failed_prune_rolls_back_and_the_journal_stays_usable(tmp_path: Path) -> None:
    """A prune that fails after deleting a request's history (but not its row) rolls back whole:
    the history is still there, no transaction is left open and later writes and prunes work."""
    path = tmp_path / "j.sqlite3"

    async def body(j: Journal) -> None:
        await accept(j, "done")
        await finish(j, "done")
        await accept(j, "open")
        run_sql(path, "CREATE TRIGGER no_delete BEFORE DELETE ON requests BEGIN SELECT RAISE(ABORT, 'disk gone'); END")
        with pytest.raises(JournalUnavailable, match="disk gone"):
            await j.prune(time.time() + 61)
        assert_no_open_transaction(path)
        assert [h["to"] for h in await j.history("done")] == ["accepted", "queued", "admitted", "running", "completed"]
        assert j.statistics().write_errors == 1
        await accept(j, "next")  # a write after the failure starts clean
        run_sql(path, "DROP TRIGGER no_delete")
        assert await j.prune(time.time() + 61) == 1
        assert await j.get("done") is None
        assert [r.id for r in await j.unfinished()] == ["open", "next"]
        assert (j.statistics().rows, j.statistics().write_errors) == (2, 1)

    with_journal(path, MIB, body, retention_s=60.0)


def test_failed_moves_and_updates_raise_journal_unavailable_and_lifecycle_errors_pass(tmp_path: Path) -> None:
    """A move or update that SQLite refuses raises JournalUnavailable and changes nothing; an
    unknown id (KeyError) and an illegal move (IllegalTransition) are not wrapped."""
    path = tmp_path / "j.sqlite3"

    async def body(j: Journal) -> None:
        await accept(j, "r1")
        run_sql(path, "CREATE TRIGGER no_update BEFORE UPDATE ON requests BEGIN SELECT RAISE(ABORT, 'io error'); END")
        with pytest.raises(JournalUnavailable) as info:
            await j.move("r1", State.QUEUED, route="gpu")
        assert isinstance(info.value.__cause__, sqlite3.IntegrityError)
        with pytest.raises(JournalUnavailable):
            await j.update("r1", tokens_delivered=1)
        assert_no_open_transaction(path)
        rec = await j.get("r1")
        assert rec is not None and (rec.state, rec.tokens_delivered) == (State.ACCEPTED, 0)
        assert [h["to"] for h in await j.history("r1")] == ["accepted"]
        run_sql(path, "DROP TRIGGER no_update")
        with pytest.raises(KeyError):
            await j.move("nope", State.QUEUED)
        with pytest.raises(IllegalTransition):
            await j.move("r1", State.COMPLETED)
        await j.move("r1", State.QUEUED, route="gpu")
        assert (await j.get("r1")).state is State.QUEUED  # type: ignore[union-attr]
        assert (j.statistics().writes, j.statistics().write_errors) == (2, 2)

    with_journal(path, MIB, body)


def test_bytes_stay_bounded_under_many_large_requests(tmp_path: Path) -> None:
    """50 requests with 200 KB bodies and 50 KB answers through a 2 MiB journal all succeed:
    the database file never passes the bound, the oldest finished go, and after a prune the
    database plus its WAL are within it."""
    path = tmp_path / "j.sqlite3"
    bound = 2 * MIB

    async def body(j: Journal) -> None:
        largest = 0
        for i in range(50):
            await accept(j, f"r{i}", 200_000)
            await finish(j, f"r{i}", response=b"a" * 50_000)
            largest = max(largest, path.stat().st_size)
        assert largest <= bound
        await j.prune()
        assert files_bytes(path) <= bound
        stats = j.statistics()
        assert path.with_name(path.name + "-wal").stat().st_size == 0
        assert path.stat().st_size == stats.bytes_used  # free pages went back to the file system
        assert (stats.writes, stats.write_errors) == (250, 0)
        assert 3 <= stats.rows <= 7 and stats.bytes_used <= int(0.8 * bound)
        kept = [i for i in range(50) if await j.get(f"r{i}") is not None]
        assert kept == list(range(50 - stats.rows, 50))  # the newest, contiguous

    with_journal(path, bound, body)


def test_unfinished_requests_are_never_pruned_even_over_the_bound(tmp_path: Path) -> None:
    """When unfinished requests fill the journal, finished ones go, further accepts are refused,
    the unfinished all stay (past the high-water mark and any retention age) and can still move."""
    path = tmp_path / "j.sqlite3"

    async def body(j: Journal) -> None:
        for rid in ("f0", "f1"):
            await accept(j, rid)
            await finish(j, rid)
        accepted: list[str] = []
        with pytest.raises(JournalUnavailable, match="full of unfinished requests"):
            for i in range(20):
                await accept(j, f"u{i}", 100_000)
                accepted.append(f"u{i}")
        assert len(accepted) >= 6
        assert_no_open_transaction(path)
        assert await j.get("f0") is None and await j.get("f1") is None
        assert int(0.8 * MIB) - 100_000 < j.statistics().bytes_used <= int(0.8 * MIB)
        assert await j.prune(time.time() + 10**9) == 0
        assert [r.id for r in await j.unfinished()] == accepted
        assert j.statistics().rows == len(accepted)
        for rid in accepted:  # the headroom above the mark lets every accepted request move on
            await finish(j, rid, response=b"a" * 10_000)
        assert await j.unfinished() == [] and j.statistics().write_errors == 1

    with_journal(path, MIB, body)


def test_a_move_that_makes_room_keeps_the_request_it_moves(tmp_path: Path) -> None:
    """Resuming the oldest finished request with a large write prunes other finished ones, not it."""
    path = tmp_path / "j.sqlite3"

    async def body(j: Journal) -> None:
        await accept(j, "res", 100_000)
        await j.move("res", State.RESUMABLE_ERROR, reason="worker died")
        for i in range(6):
            await accept(j, f"f{i}", 100_000)
            await finish(j, f"f{i}")
        await j.move("res", State.QUEUED, reason="r" * 150_000)
        rec = await j.get("res")
        assert rec is not None and rec.state is State.QUEUED and len(rec.reason or "") == 150_000
        assert [h["to"] for h in await j.history("res")] == ["accepted", "resumable_error", "queued"]
        assert await j.get("f0") is None and await j.get("f5") is not None

    with_journal(path, MIB, body)


def test_a_body_larger_than_the_headroom_is_refused_without_pruning(tmp_path: Path) -> None:
    """A body larger than the headroom above the high-water mark is refused at once; the history stays."""
    path = tmp_path / "j.sqlite3"

    async def body(j: Journal) -> None:
        await accept(j, "done", 100_000)
        await finish(j, "done")
        with pytest.raises(JournalUnavailable, match="does not fit"):
            await accept(j, "huge", 200_000)
        assert await j.get("done") is not None and await j.count() == 1

    with_journal(path, MIB, body)


def test_journal_files_are_private(tmp_path: Path) -> None:
    """A new journal's database and WAL are created 0600; an old 0644 file without auto-vacuum
    is made 0600 and converted to incremental auto-vacuum on open."""
    new = tmp_path / "new.sqlite3"

    async def fresh(j: Journal) -> None:
        await accept(j, "r1")
        assert stat.S_IMODE(new.stat().st_mode) == 0o600
        assert stat.S_IMODE(new.with_name(new.name + "-wal").stat().st_mode) == 0o600

    with_journal(new, MIB, fresh)
    old = tmp_path / "old.sqlite3"
    with closing(sqlite3.connect(old)) as db:
        db.executescript(SCHEMA)
    os.chmod(old, 0o644)

    async def check(j: Journal) -> None:
        await accept(j, "r1")
        assert stat.S_IMODE(old.stat().st_mode) == 0o600
        assert stat.S_IMODE(old.with_name(old.name + "-wal").stat().st_mode) == 0o600
        with closing(sqlite3.connect(old)) as db:
            assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
        assert await j.count() == 1

    with_journal(old, MIB, check)


def test_journal_unavailable_maps_to_503_with_retry_after() -> None:
    """JournalUnavailable leaves as a 503 server_error with code journal_unavailable and Retry-After."""
    err = to_http(JournalUnavailable("journal full", retry_after_s=2.0), request_id="r1")
    assert (err.status, err.headers["Retry-After"]) == (503, "2")
    assert err.body["error"]["type"] == "server_error" and err.body["error"]["code"] == "journal_unavailable"


def test_journal_max_mib_is_configured_and_validated() -> None:
    """[journal].max_mib defaults to 256 and must be positive; Journal refuses a bound below 256 KiB."""
    assert load_config().journal.max_mib == 256
    with pytest.raises(ConfigError, match="max_mib"):
        load_config(overrides={"journal": {"max_mib": 0}})
    with pytest.raises(ValueError):
        Journal(Path("unused.sqlite3"), retention_s=1.0, max_requests=1, max_bytes=1024)
