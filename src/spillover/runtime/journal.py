"""The request journal: SQLite in WAL mode, one row per request, one per transition.

A request is ACCEPTED only once its row is committed with ``synchronous=FULL`` (fsync),
before the first response byte. Later transitions commit with ``synchronous=NORMAL``:
in WAL mode they survive a killed gateway (the SIGKILL case), only an OS crash could
lose the last of them. Every lifecycle move is a row in ``transitions``. On start-up the
journal is the truth (see ``Journal.unfinished``). All SQLite work runs on one dedicated
thread, so writes keep their order and the event loop never blocks on disk.

Retention is bounded: terminal requests older than ``retention_s`` are deleted, and the
oldest terminal ones beyond ``max_requests``.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillover.core.lifecycle import TERMINAL, State, advance

__all__ = ["Journal", "JournalRecord", "KeyConflict"]

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


def _record(row: tuple[Any, ...]) -> JournalRecord:
    vals = list(row)
    vals[4] = bool(vals[4])
    vals[7] = State(vals[7])
    return JournalRecord(*vals)


class Journal:
    """Durable request log. Create, then ``await open()``; all methods are coroutines."""

    def __init__(self, path: Path, *, retention_s: float, max_requests: int) -> None:
        self.path = path
        self.retention_s = retention_s
        self.max_requests = max_requests
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._db: sqlite3.Connection | None = None
        self.writes = 0

    def __repr__(self) -> str:
        return f"<Journal {self.path} writes={self.writes}>"

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- thread side -----------------------------------------------------------------
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        self._db = db

    def _db_(self) -> sqlite3.Connection:
        assert self._db is not None, "journal not open"
        return self._db

    def _accept(self, rec: dict[str, Any]) -> None:
        db = self._db_()
        now = time.time()
        db.execute("PRAGMA synchronous=FULL")  # ACCEPTED is durable before the first byte
        db.execute("BEGIN IMMEDIATE")
        try:
            if rec["idem_key"] is not None and (existing := self._by_key(rec["idem_key"])) is not None:
                db.execute("ROLLBACK")
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
            db.execute("COMMIT")
        except sqlite3.Error:
            db.execute("ROLLBACK")
            raise
        finally:
            db.execute("PRAGMA synchronous=NORMAL")
        self.writes += 1

    def _move(self, rid: str, target: State, fields: dict[str, Any]) -> None:
        db = self._db_()
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT state FROM requests WHERE id=?", (rid,)).fetchone()
            if row is None:
                db.execute("ROLLBACK")
                raise KeyError(rid)
            current = State(row[0])
            advance(current, target)  # raises IllegalTransition, nothing written
            sets = {"state": target.value, "updated_s": now, **fields}
            if target in TERMINAL:
                sets["finished_s"] = now
            else:
                sets["finished_s"] = None
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
            db.execute("COMMIT")
        except Exception:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self.writes += 1

    def _update(self, rid: str, fields: dict[str, Any]) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        self._db_().execute(f"UPDATE requests SET {cols} WHERE id=?", (*fields.values(), rid))
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

    def _prune(self, now: float) -> int:
        db = self._db_()
        old = [
            r[0]
            for r in db.execute(
                f"SELECT id FROM requests WHERE state IN ({_TERMINAL_MARKS}) AND finished_s < ?",
                (*_TERMINAL, now - self.retention_s),
            ).fetchall()
        ]
        extra = db.execute(f"SELECT COUNT(*) FROM requests WHERE state IN ({_TERMINAL_MARKS})", _TERMINAL).fetchone()[0]
        over = max(0, extra - len(old) - self.max_requests)
        if over:
            doomed = set(old)
            oldest = db.execute(
                f"SELECT id FROM requests WHERE state IN ({_TERMINAL_MARKS}) ORDER BY finished_s LIMIT ?",
                (*_TERMINAL, over + len(old)),
            ).fetchall()
            old += [r[0] for r in oldest if r[0] not in doomed][:over]
        if old:
            db.execute("BEGIN IMMEDIATE")
            for i in range(0, len(old), 500):
                chunk = old[i : i + 500]
                q = ",".join("?" * len(chunk))
                db.execute(f"DELETE FROM transitions WHERE rid IN ({q})", chunk)
                db.execute(f"DELETE FROM requests WHERE id IN ({q})", chunk)
            db.execute("COMMIT")
        return len(old)

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
        """Durably record a new request as ACCEPTED; raises KeyConflict for a used key."""
        rec = {
            "id": rid,
            "idem_key": idem_key,
            "body_hash": body_hash,
            "kind": kind,
            "stream": stream,
            "body": body,
            "model": model,
        }
        await self._run(self._accept, rec)

    async def move(self, rid: str, target: State, **fields: Any) -> None:
        """Advance a request (checked against the lifecycle table) and update columns."""
        await self._run(self._move, rid, target, fields)

    async def update(self, rid: str, **fields: Any) -> None:
        """Update columns without a transition (e.g. the first token delivered)."""
        await self._run(self._update, rid, fields)

    async def by_key(self, key: str) -> JournalRecord | None:
        result: JournalRecord | None = await self._run(self._by_key, key)
        return result

    async def get(self, rid: str) -> JournalRecord | None:
        result: JournalRecord | None = await self._run(self._get, rid)
        return result

    async def history(self, rid: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._run(self._history, rid)
        return result

    async def unfinished(self) -> list[JournalRecord]:
        result: list[JournalRecord] = await self._run(self._unfinished)
        return result

    async def prune(self, now_s: float | None = None) -> int:
        """Delete terminal requests past the retention age or beyond ``max_requests``
        (oldest first); unfinished ones are never deleted. Returns how many went."""
        result: int = await self._run(self._prune, time.time() if now_s is None else now_s)
        return result

    async def count(self) -> int:
        result: int = await self._run(self._count)
        return result

    async def close(self) -> None:
        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(_close)
        self._pool.shutdown(wait=True)


def dumps(obj: Any) -> str:
    """Canonical JSON used for body hashes and stored bodies."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
