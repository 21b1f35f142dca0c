"""Start-up recovery: the journal is the truth after a gateway restart.

Rules:

1. Only requests unfinished *before* this gateway served anything are orphans (read at start).
2. An orphan is replayed when nothing of it reached its client (``core.routing.
   replayable_after_restart``): it goes back to QUEUED and runs again in the background with
   the same id and the next attempt, under its Idempotency-Key's lock, so a client resuming
   it at the same moment does not make it run twice. Its outcome is journaled as always.
3. The others (a stream that had delivered tokens) end as resumable errors.
4. The replay itself runs through the request service (``RequestService.replay``): the
   stored body goes back through its own endpoint, and the answer is journaled in its wire
   format. Without a registered endpoint (no HTTP layer), every orphan ends as rule 3.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from spillover.core.lifecycle import State
from spillover.core.routing import replayable_after_restart
from spillover.errors import RequestCancelled, RestartInterrupted, SpilloverError, to_http

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway
    from spillover.runtime.journal import JournalRecord

__all__ = ["end_orphan", "orphan_lock", "recover"]

log = logging.getLogger("spillover.recovery")


def orphan_lock(rec: JournalRecord) -> str:
    """The lock an orphan's replay, recovery and DELETE take: its Idempotency-Key (a retry
    with it resumes the same request), else one of its own that no client key can be (a key
    is printable ASCII)."""
    return rec.idem_key or f"\0{rec.id}"


async def end_orphan(gw: Gateway, rec: JournalRecord, exc: SpilloverError) -> None:
    """End an orphan whose stored answer is ``exc``: as a resumable error (rule 3), or
    cancelled (a DELETE before its replay)."""
    assert gw.journal is not None
    e = to_http(exc, rec.id)
    await gw.journal.move(
        rec.id,
        State.CANCELLED if isinstance(exc, RequestCancelled) else State.RESUMABLE_ERROR,
        status_code=e.status,
        response=json.dumps(e.body).encode(),
        content_type="application/json",
        error=json.dumps(e.body),
        headers=json.dumps({"X-Spillover-Request-Id": rec.id, **e.headers}),
    )


async def recover(
    gw: Gateway, orphans: list[JournalRecord], spawn: Callable[[str, Awaitable[None]], None]
) -> dict[str, int]:
    """Re-queue the replayable orphans (``spawn`` runs each replay as a task the gateway
    owns) and end the others; returns the counts."""
    assert gw.journal is not None
    counts = {"replayed": 0, "ended": 0, "failed": 0}
    for rec in orphans:
        async with gw.keys.hold(orphan_lock(rec)):  # not while a DELETE ends it
            if rec.id in gw.requests.live or rec.id not in gw.requests.orphans:  # resumed, or cancelled
                continue
            try:
                counts[await _recover_one(gw, rec, spawn)] += 1
            except Exception:  # one orphan's failure (a journal error) does not stop the others
                log.exception("recovery of %s failed; it stays unfinished until the next start", rec.id)
                counts["failed"] += 1
    if any(counts.values()):
        log.info("recovered journal: %s", counts)
    return counts


async def _recover_one(gw: Gateway, rec: JournalRecord, spawn: Callable[[str, Awaitable[None]], None]) -> str:
    """Replay or end one orphan; returns which."""
    assert gw.journal is not None
    if gw.requests.replayable() and replayable_after_restart(rec.state, rec.stream, rec.tokens_delivered):
        # Back to QUEUED through the table (RUNNING/ADMITTED/ACCEPTED -> QUEUED are legal).
        await gw.journal.move(rec.id, State.QUEUED, reason="recovered after gateway restart", attempts=rec.attempts)
        rec = await gw.journal.get(rec.id) or rec
        spawn(f"recover-{rec.id}", gw.requests.replay(rec))
        return "replayed"
    gw.requests.orphans.discard(rec.id)
    await end_orphan(
        gw,
        rec,
        RestartInterrupted(
            f"the gateway restarted while request {rec.id} was streaming; {rec.tokens_delivered}+ tokens "
            "(or a segment) had been delivered, so it cannot be replayed without changing what the client saw",
            retry_after_s=1.0,
        ),
    )
    return "ended"
