"""The request journal: SQLite in WAL mode, one row per request, one per transition.

A request is ACCEPTED only once its row is committed with ``synchronous=FULL`` (fsync),
before the first response byte. Later transitions commit with ``synchronous=NORMAL``:
in WAL mode they survive a killed gateway (the SIGKILL case), only an OS crash could
lose the last of them. Every lifecycle move is a row in ``transitions``. On start-up the
journal is the truth (see ``Journal.unfinished``). All SQLite work runs on one dedicated
thread, so writes keep their order and the event loop never blocks on disk.

Rules:

1. Every write is one transaction; on any error it is rolled back, so the next write
   starts clean. A failed write raises ``JournalUnavailable`` (503); ``KeyConflict``,
   ``KeyError`` and ``IllegalTransition`` pass through unchanged.
2. Retention is bounded by age (``retention_s``), by count (``max_requests`` finished
   ones) and by bytes: once the used bytes pass ``HIGH_WATER_RATIO`` of ``max_bytes``,
   the oldest finished requests go until ``LOW_WATER_RATIO``. Unfinished ones never do.
3. ``max_bytes`` is enforced by SQLite itself: ``max_page_count`` caps the database file
   at the bound minus a WAL allowance, so a write past it fails with SQLITE_FULL. The WAL
   is checkpointed every ``_wal_pages`` and cut back to the allowance; one transaction
   larger than that (a big row, or a move, which rewrites its row) outgrows it until the
   next checkpoint. ``prune`` gives free pages back (``auto_vacuum=INCREMENTAL``) and
   empties the WAL, so after it the files together are within ``max_bytes``.
4. ``accept`` and ``move`` make room first when what they write would pass the high-water
   mark. ``accept`` refuses while the journal stays above it (full of unfinished requests),
   and refuses a body larger than the headroom above it: a move rewrites its row, and the
   headroom must hold one rewrite, so requests already accepted can always finish.
5. The files hold every prompt and answer: they are created, and kept, mode 0600.
6. Fault injection (the drill, tests): while a file named ``<journal>.disk-full`` exists
   (``set_disk_full``, ``spillover sim disk-full``), every write fails as on a full disk
   (ENOSPC), through the same path as a real one.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from spillover.core.lifecycle import TERMINAL, State, advance
from spillover.errors import JournalUnavailable

__all__ = ["Journal", "JournalRecord", "JournalStatistics", "KeyConflict", "disk_full_marker", "set_disk_full"]

log = logging.getLogger("spillover.journal")

T = TypeVar("T")

HIGH_WATER_RATIO = 0.8  # past this share of max_bytes, pruning sheds the oldest finished
LOW_WATER_RATIO = 0.6  # ...until this share
MIN_MAX_BYTES = 256 * 1024  # the schema alone takes ~12 pages
RETRY_AFTER_S = 2.0  # what a client is told after a failed journal write
FILE_MODE = 0o600
_SHED_BATCH = 256  # finished rows looked at per byte-shedding round
_ROW_BYTES = (  # a finished row's payload, estimated (+ page overhead)
    "length(CAST(body AS BLOB)) + coalesce(length(CAST(response AS BLOB)), 0)"
    " + coalesce(length(CAST(headers AS BLOB)), 0) + coalesce(length(CAST(error AS BLOB)), 0) + 256"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
  id TEXT PRIMARY KEY,
  idem_key TEXT UNIQUE,
  body_hash TEXT NOT NULL,
  kind TEXT NOT NULL,
  stream INTEGER NOT NULL,
  body TEXT NOT NULL,
  model TEXT NOT NULL,
  fingerprint TEXT,
  state TEXT NOT NULL,
  route TEXT,
  attempts INTEGER NOT NULL DEFAULT 0,
  reason TEXT,
  tokens_delivered INTEGER NOT NULL DEFAULT 0,
  created_s REAL NOT NULL,
  updated_s REAL NOT NULL,
  finished_s REAL,
  status_code INTEGER,
  response BLOB,
  content_type TEXT,
  headers TEXT,
  error TEXT
);
CREATE INDEX IF NOT EXISTS requests_state ON requests(state);
CREATE INDEX IF NOT EXISTS requests_finished ON requests(finished_s);
CREATE TABLE IF NOT EXISTS transitions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  rid TEXT NOT NULL,
  t_s REAL NOT NULL,
  from_state TEXT,
  to_state TEXT NOT NULL,
  route TEXT,
  attempt INTEGER,
  reason TEXT
);
CREATE INDEX IF NOT EXISTS transitions_rid ON transitions(rid);
"""


class KeyConflict(Exception):
    """The Idempotency-Key is already bound to another request (``existing``)."""

    def __init__(self, existing: JournalRecord) -> None:
        super().__init__(existing.id)
        self.existing = existing


@dataclass(frozen=True)
class JournalRecord:
    """One request's row."""

    id: str
    idem_key: str | None
    body_hash: str
    kind: str
    stream: bool
    body: str
    model: str
    state: State
    route: str | None
    attempts: int
    reason: str | None
    tokens_delivered: int
    created_s: float
    updated_s: float
    finished_s: float | None
    status_code: int | None
    response: bytes | None
    content_type: str | None
    headers: str | None
    error: str | None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


_COLS = (
    "id, idem_key, body_hash, kind, stream, body, model, state, route, attempts, reason, "
    "tokens_delivered, created_s, updated_s, finished_s, status_code, response, content_type, headers, error"
)

_TERMINAL = tuple(s.value for s in TERMINAL)  # terminal states as stored
_TERMINAL_MARKS = ",".join("?" * len(_TERMINAL))


@dataclass(frozen=True)
class JournalStatistics:
    """A snapshot of the journal's size and write counters."""

    bytes_used: int  # pages in use (not free) x page size, WAL excluded
    max_bytes: int
    rows: int  # requests stored, finished or not
    writes: int  # accepts, moves and updates committed
    write_errors: int  # writes that failed or were refused (journal full)


def _record(row: tuple[Any, ...]) -> JournalRecord:
    vals = list(row)
    vals[4] = bool(vals[4])
    vals[7] = State(vals[7])
    return JournalRecord(*vals)


class Journal:
    """Durable request log. Create, then ``await open()``; all methods are coroutines."""

    def __init__(
        self,
        path: Path,
        *,
        retention_s: float,
        max_requests: int,
        max_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"journal max_bytes must be >= {MIN_MAX_BYTES}, got {max_bytes}")
        self.path = path
        self._disk_full_marker = disk_full_marker(path)
        self.retention_s = retention_s
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._db: sqlite3.Connection | None = None
        self._page_size = 4096
        self._bytes_used = 0
        self._rows = 0
        self.writes = 0
        self.write_errors = 0

    def __repr__(self) -> str:
        mib = 1024 * 1024
        return (
            f"<Journal {self.path} used={self._bytes_used / mib:.1f}/{self.max_bytes / mib:.1f}MiB"
            f" rows={self._rows} writes={self.writes} write_errors={self.write_errors}>"
        )

    def statistics(self) -> JournalStatistics:
        """A frozen snapshot (as of the last write; no disk access)."""
        return JournalStatistics(
            bytes_used=self._bytes_used,
            max_bytes=self.max_bytes,
            rows=self._rows,
            writes=self.writes,
            write_errors=self.write_errors,
        )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a write on the journal thread; a SQLite or OS error becomes JournalUnavailable."""
        try:
            return await self._run(self._counted, fn, *args)
        except (sqlite3.Error, OSError) as exc:
            raise JournalUnavailable(
                f"the request journal cannot be written: {exc}", retry_after_s=RETRY_AFTER_S
            ) from exc

    # -- thread side -----------------------------------------------------------------
    @property
    def _high_water(self) -> int:
        return int(self.max_bytes * HIGH_WATER_RATIO)

    @property
    def _wal_pages(self) -> int:
        """WAL pages between checkpoints: 1/32 of the bound, 8 to 1000 (SQLite's default)."""
        return min(1000, max(8, self.max_bytes // self._page_size // 32))

    def _counted(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            if self._disk_full_marker.exists():  # rule 6
                raise OSError(errno.ENOSPC, f"No space left on device (injected: {self._disk_full_marker})")
            return fn(*args)
        except (sqlite3.Error, OSError):
            self.write_errors += 1
            raise
        finally:
            with suppress(sqlite3.Error):  # else the next write refreshes it
                self._bytes_used = self._used_bytes()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE))  # before SQLite creates it
        self._restrict_files()
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            fresh = db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
            if fresh:  # only possible before the first table exists
                db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # a file from before: convert once
                db.execute("PRAGMA auto_vacuum=INCREMENTAL")
                db.execute("VACUUM")
            self._page_size = int(db.execute("PRAGMA page_size").fetchone()[0])
            db.execute(f"PRAGMA wal_autocheckpoint={self._wal_pages}")
            db.execute(f"PRAGMA journal_size_limit={2 * self._wal_pages * self._page_size}")
            self._db = db
            self._cap_pages()
            db.executescript(SCHEMA)
            self._rows = self._count()
            self._bytes_used = self._used_bytes()
        except BaseException:
            self._db = None
            db.close()
            raise
        self._restrict_files()

    def _restrict_files(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            f = self.path.with_name(self.path.name + suffix)
            if f.exists():
                os.chmod(f, FILE_MODE)

    @property
    def _file_pages(self) -> int:
        """The database file's cap: the bound minus the WAL allowance."""
        return self.max_bytes // self._page_size - 2 * self._wal_pages

    @property
    def _headroom(self) -> int:
        """Bytes between the high-water mark and the file's cap: room for one row's rewrite."""
        return self._file_pages * self._page_size - self._high_water

    def _cap_pages(self) -> None:
        """Cap the database file (SQLite never caps it below its current size)."""
        self._db_().execute(f"PRAGMA max_page_count={self._file_pages}").fetchall()

    def _db_(self) -> sqlite3.Connection:
        assert self._db is not None, "journal not open"
        return self._db

    def _used_bytes(self) -> int:
        db = self._db_()
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages) * self._page_size

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT; any exception (or a failed COMMIT) rolls back."""
        db = self._db_()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL, IOERR)
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error as exc:  # keep the original error
                    log.warning("journal rollback failed: %s", exc)
            raise

    def _make_room(self, keep: str | None, need: int = 0) -> None:
        """Prune first when ``need`` more bytes would pass the high-water mark; a failed prune
        is logged, not fatal."""
        if self._used_bytes() + need <= self._high_water:
            return
        try:
            self._prune(time.time(), keep, need)
        except (sqlite3.Error, OSError) as exc:
            self.write_errors += 1
            log.warning("journal: pruning to make room failed: %s", exc)

    def _accept(self, rec: dict[str, Any]) -> None:
        if (need := len(rec["body"].encode())) > self._headroom:  # its moves could not rewrite it
            self.write_errors += 1
            raise JournalUnavailable(f"the request ({need} bytes) does not fit the journal ({self.max_bytes} bytes)")
        self._make_room(keep=None, need=need)
        if (used := self._used_bytes()) + need > self._high_water:
            self.write_errors += 1
            raise JournalUnavailable(
                f"the request journal is full of unfinished requests ({used} of {self.max_bytes} bytes)",
                retry_after_s=RETRY_AFTER_S,
            )
        db = self._db_()
        now = time.time()
        db.execute("PRAGMA synchronous=FULL")  # ACCEPTED is durable before the first byte
        try:
            with self._transaction():
                if rec["idem_key"] is not None and (existing := self._by_key(rec["idem_key"])) is not None:
                    raise KeyConflict(existing)
                db.execute(
                    "INSERT INTO requests (id, idem_key, body_hash, kind, stream, body, model, state, attempts,"
                    " created_s, updated_s) VALUES (?,?,?,?,?,?,?,?,0,?,?)",
                    (
                        rec["id"],
                        rec["idem_key"],
                        rec["body_hash"],
                        rec["kind"],
                        int(rec["stream"]),
                        rec["body"],
                        rec["model"],
                        State.ACCEPTED.value,
                        now,
                        now,
                    ),
                )
                db.execute(
                    "INSERT INTO transitions (rid, t_s, from_state, to_state, attempt) VALUES (?,?,?,?,0)",
                    (rec["id"], now, State.RECEIVED.value, State.ACCEPTED.value),
                )
        finally:
            db.execute("PRAGMA synchronous=NORMAL")
        self.writes += 1
        self._rows += 1

    def _move(self, rid: str, target: State, fields: dict[str, Any]) -> None:
        self._make_room(keep=rid, need=sum(len(v) for v in fields.values() if isinstance(v, str | bytes)))
        now = time.time()
        with self._transaction() as db:
            row = db.execute("SELECT state FROM requests WHERE id=?", (rid,)).fetchone()
            if row is None:
                raise KeyError(rid)
            current = State(row[0])
            advance(current, target)  # raises IllegalTransition, nothing written
            sets = {"state": target.value, "updated_s": now, **fields}
            sets["finished_s"] = now if target in TERMINAL else None
            cols = ", ".join(f"{k}=?" for k in sets)
            db.execute(f"UPDATE requests SET {cols} WHERE id=?", (*sets.values(), rid))
            db.execute(
                "INSERT INTO transitions (rid, t_s, from_state, to_state, route, attempt, reason)"
                " VALUES (?,?,?,?,?,?,?)",
                (
                    rid,
                    now,
                    current.value,
                    target.value,
                    fields.get("route"),
                    fields.get("attempts"),
                    fields.get("reason"),
                ),
            )
        self.writes += 1

    def _update(self, rid: str, fields: dict[str, Any]) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._transaction() as db:
            db.execute(f"UPDATE requests SET {cols} WHERE id=?", (*fields.values(), rid))
        self.writes += 1

    def _one(self, column: str, value: str) -> JournalRecord | None:
        row = self._db_().execute(f"SELECT {_COLS} FROM requests WHERE {column}=?", (value,)).fetchone()
        return _record(row) if row else None

    def _by_key(self, key: str) -> JournalRecord | None:
        return self._one("idem_key", key)

    def _get(self, rid: str) -> JournalRecord | None:
        return self._one("id", rid)

    def _history(self, rid: str) -> list[dict[str, Any]]:
        rows = (
            self._db_()
            .execute(
                "SELECT t_s, from_state, to_state, route, attempt, reason FROM transitions WHERE rid=? ORDER BY seq",
                (rid,),
            )
            .fetchall()
        )
        keys = ("t_s", "from", "to", "route", "attempt", "reason")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def _unfinished(self) -> list[JournalRecord]:
        rows = (
            self._db_()
            .execute(
                f"SELECT {_COLS} FROM requests WHERE state NOT IN ({_TERMINAL_MARKS}) ORDER BY created_s", _TERMINAL
            )
            .fetchall()
        )
        return [_record(r) for r in rows]

    def _prune(self, now: float, keep: str | None = None, need: int = 0) -> int:
        """Delete expired finished requests, then shed the oldest finished ones while above
        the high-water mark, all in one transaction; then give free pages back, empty the WAL."""
        with self._transaction() as db:
            doomed = self._expired(now, keep)
            self._delete(doomed)
            gone = len(doomed)
            if self._used_bytes() + need > self._high_water:
                gone += self._shed_bytes(keep, need)
        self._rows -= gone
        # Free pages (deleted rows, rewritten ones) go back to the file system and the WAL is
        # emptied. executescript steps each pragma to its end (execute frees one page only).
        db.executescript("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")
        self._cap_pages()  # a file opened above the bound may be capped lower now
        return gone

    def _expired(self, now: float, keep: str | None) -> list[str]:
        """Finished requests past the retention age, then the oldest beyond ``max_requests``."""
        db = self._db_()
        finished = f"state IN ({_TERMINAL_MARKS}) AND id IS NOT ?"
        old = [
            r[0]
            for r in db.execute(
                f"SELECT id FROM requests WHERE {finished} AND finished_s < ?",
                (*_TERMINAL, keep, now - self.retention_s),
            ).fetchall()
        ]
        total = db.execute(f"SELECT COUNT(*) FROM requests WHERE {finished}", (*_TERMINAL, keep)).fetchone()[0]
        over = max(0, total - len(old) - self.max_requests)
        if over:
            doomed = set(old)
            oldest = db.execute(
                f"SELECT id FROM requests WHERE {finished} ORDER BY finished_s LIMIT ?",
                (*_TERMINAL, keep, over + len(old)),
            ).fetchall()
            old += [r[0] for r in oldest if r[0] not in doomed][:over]
        return old

    def _shed_bytes(self, keep: str | None, need: int) -> int:
        """Delete the oldest finished requests until the used bytes plus ``need`` reach the
        low-water mark (or none is left). Returns how many went."""
        db = self._db_()
        gone = 0
        while (excess := self._used_bytes() + need - int(self.max_bytes * LOW_WATER_RATIO)) > 0:
            rows = db.execute(
                f"SELECT id, {_ROW_BYTES} FROM requests WHERE state IN ({_TERMINAL_MARKS}) AND id IS NOT ?"
                " ORDER BY finished_s LIMIT ?",
                (*_TERMINAL, keep, _SHED_BATCH),
            ).fetchall()
            if not rows:
                break  # only unfinished requests are left: they stay
            batch: list[str] = []
            freed = 0
            for rid, size in rows:
                batch.append(rid)
                freed += int(size)
                if freed >= excess:
                    break
            self._delete(batch)
            gone += len(batch)
        return gone

    def _delete(self, rids: list[str]) -> None:
        db = self._db_()
        for i in range(0, len(rids), 500):
            chunk = rids[i : i + 500]
            q = ",".join("?" * len(chunk))
            db.execute(f"DELETE FROM transitions WHERE rid IN ({q})", chunk)
            db.execute(f"DELETE FROM requests WHERE id IN ({q})", chunk)

    def _count(self) -> int:
        return int(self._db_().execute("SELECT COUNT(*) FROM requests").fetchone()[0])

    # -- async API -------------------------------------------------------------------
    async def open(self) -> None:
        await self._run(self._open)

    async def accept(
        self,
        *,
        rid: str,
        idem_key: str | None,
        body_hash: str,
        kind: str,
        stream: bool,
        body: str,
        model: str,
    ) -> None:
        """Durably record a new request as ACCEPTED; raises KeyConflict for a used key and
        JournalUnavailable when it cannot be written (nothing is then recorded)."""
        rec = {
            "id": rid,
            "idem_key": idem_key,
            "body_hash": body_hash,
            "kind": kind,
            "stream": stream,
            "body": body,
            "model": model,
        }
        await self._write(self._accept, rec)

    async def move(self, rid: str, target: State, **fields: Any) -> None:
        """Advance a request (checked against the lifecycle table) and update columns. Raises
        KeyError (unknown id), IllegalTransition or JournalUnavailable; each writes nothing."""
        await self._write(self._move, rid, target, fields)

    async def update(self, rid: str, **fields: Any) -> None:
        """Update columns without a transition (e.g. the first token delivered); raises
        JournalUnavailable when it cannot be written."""
        await self._write(self._update, rid, fields)

    async def by_key(self, key: str) -> JournalRecord | None:
        return await self._run(self._by_key, key)

    async def get(self, rid: str) -> JournalRecord | None:
        return await self._run(self._get, rid)

    async def history(self, rid: str) -> list[dict[str, Any]]:
        return await self._run(self._history, rid)

    async def unfinished(self) -> list[JournalRecord]:
        return await self._run(self._unfinished)

    async def prune(self, now_s: float | None = None) -> int:
        """Delete finished requests past the retention age, beyond ``max_requests``, or (oldest
        first) while above the high-water mark; unfinished ones are never deleted. Returns how
        many went; raises JournalUnavailable when it cannot be written (a failed delete rolls back)."""
        return await self._write(self._prune, time.time() if now_s is None else now_s)

    async def count(self) -> int:
        return await self._run(self._count)

    async def close(self) -> None:
        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(_close)
        self._pool.shutdown(wait=True)


def disk_full_marker(journal_path: Path) -> Path:
    """The file whose presence makes every write of that journal fail as on a full disk."""
    return journal_path.with_name(journal_path.name + ".disk-full")


def set_disk_full(journal_path: Path, on: bool) -> None:
    """Inject (or end) a full disk for the journal at ``journal_path`` (rule 6)."""
    marker = disk_full_marker(journal_path)
    if on:
        marker.touch()
    else:
        marker.unlink(missing_ok=True)


def dumps(obj: Any) -> str:
    """Canonical JSON used for body hashes and stored bodies."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
