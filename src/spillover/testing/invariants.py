"""The quiescence invariants: what must be true of a gateway once no request is in flight.

Used by the adversarial tests, the fuzzer and the drill. At quiescence:

1. no lane has a queued or running request, and no worker a busy slot;
2. the device ledger holds no request reservation (only weights and tenants);
3. the gateway has no live request and no Idempotency-Key held;
4. every journal row is terminal (a resumable state counts: it ends the request);
5. the breaker is not stuck half-open with a probe in flight;
6. no terminal outcome waits in memory for the journal.

``violations(status, journal_states)`` lists what is broken; ``wait_quiescent`` polls a
live gateway until the list is empty or a bound passes, and returns the last list.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["journal_states", "violations", "wait_quiescent"]

TERMINAL_STATES = frozenset({"completed", "failed", "cancelled", "rejected", "resumable_error"})


def journal_states(path: str | Path) -> dict[str, str]:
    """Request id -> state, read from a journal file (read-only)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        return dict(db.execute("SELECT id, state FROM requests").fetchall())
    finally:
        db.close()


def violations(status: dict[str, Any], states: dict[str, str] | None = None) -> list[str]:
    """What a /v1/status document (and the journal's states) break of rules 1-6."""
    out: list[str] = []
    for lane in status.get("lanes", []):
        if lane["depth"] or lane["running"]:
            out.append(f"lane {lane['lane']}: {lane['depth']} queued, {lane['running']} running")
    for w in status.get("workers", []):
        if w["busy"]:
            out.append(f"worker {w['worker_id']}: {w['busy']} busy slots")
    ledger = (status.get("device") or {}).get("ledger")
    if ledger and ledger["request_reservations"]:
        out.append(f"ledger: {ledger['request_reservations']} request reservations held")
    if status.get("live_requests"):
        out.append(f"{status['live_requests']} live requests")
    if status.get("idempotency_keys_held"):
        out.append(f"{status['idempotency_keys_held']} idempotency keys held")
    for key in ("breaker", "split_breaker"):
        breaker = status.get(key) or {}
        if breaker.get("circuit") == "half_open" and breaker.get("probes_in_flight"):
            out.append(f"{key.replace('_', ' ')} half-open with {breaker['probes_in_flight']} probes in flight")
    if status.get("journal_pending_outcomes"):
        out.append(f"{status['journal_pending_outcomes']} outcomes not yet journaled")
    for rid, state in sorted((states or {}).items()):
        if state not in TERMINAL_STATES:
            out.append(f"journal: {rid} is {state}")
    return out


def wait_quiescent(
    status: Callable[[], dict[str, Any]],
    journal: str | Path | None = None,
    *,
    timeout_s: float = 30.0,
    ignore: Iterable[str] = (),
) -> list[str]:
    """Poll until no invariant is broken (or ``timeout_s``); the violations left (none: [])."""
    skip = set(ignore)
    deadline = time.monotonic() + timeout_s
    while True:
        states = journal_states(journal) if journal is not None and Path(journal).exists() else None
        found = [v for v in violations(status(), {k: s for k, s in (states or {}).items() if k not in skip})]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)
