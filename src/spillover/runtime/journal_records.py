"""What the request journal stores: the SQLite schema, the request row and its decoding,
the statistics snapshot, the key-conflict error and the canonical JSON of stored bodies.

No I/O here: ``runtime.journal`` reads and writes these rows, ``runtime.journal_bounds``
keeps their number and size bounded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spillover.core.lifecycle import TERMINAL, State

__all__ = [
    "COLS",
    "SCHEMA",
    "SERVICE_EVENTS_KEPT",
    "TERMINAL_MARKS",
    "TERMINAL_VALUES",
    "JournalRecord",
    "JournalStatistics",
    "KeyConflict",
    "dumps",
    "record",
    "stored_json",
]

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
CREATE TABLE IF NOT EXISTS service_events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  t_s REAL NOT NULL,
  service TEXT NOT NULL,
  event TEXT NOT NULL,
  reason TEXT
);
"""
SERVICE_EVENTS_KEPT = 1000  # the newest service events kept (demotions, promotions)

COLS = (  # a ``requests`` row as ``JournalRecord`` holds it, in its field order
    "id, idem_key, body_hash, kind, stream, body, model, state, route, attempts, reason, "
    "tokens_delivered, created_s, updated_s, finished_s, status_code, response, content_type, headers, error"
)

TERMINAL_VALUES = tuple(s.value for s in TERMINAL)  # terminal states as stored
TERMINAL_MARKS = ",".join("?" * len(TERMINAL_VALUES))  # their SQL placeholders


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


@dataclass(frozen=True)
class JournalStatistics:
    """A snapshot of the journal's size and write counters."""

    bytes_used: int  # pages in use (not free) x page size, WAL excluded
    max_bytes: int
    rows: int  # requests stored, finished or not
    writes: int  # accepts, moves and updates committed
    write_errors: int  # writes that failed or were refused (journal full)


def record(row: tuple[Any, ...]) -> JournalRecord:
    """Decode a row selected with ``COLS``."""
    vals = list(row)
    vals[4] = bool(vals[4])
    vals[7] = State(vals[7])
    return JournalRecord(*vals)


def dumps(obj: Any) -> str:
    """Canonical JSON (keys sorted), for body hashes: a body sent again with its keys in
    another order is the same request."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stored_json(obj: Any) -> str:
    """A stored body as JSON, compact, its keys in the client's order: a replay runs exactly
    what was sent (a JSON schema's or a tool's property order is the order a model is asked to
    write them in; sorted, a replay after a restart answered differently: round 16)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
