"""Start-up recovery: the journal is the truth after a gateway restart.

Unfinished requests that can be replayed (nothing delivered to the client yet) are run
again in the background, with the same id and the next attempt number; their outcome is
stored, for ``GET /v1/requests/{id}`` and for a retry with the same Idempotency-Key. The
others (a stream that had delivered tokens) end as resumable errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from spillover.core.lifecycle import State
from spillover.errors import FailoverInterrupted, SpilloverError, to_http
from spillover.http import generation as g
from spillover.http.schemas import parse_chat, parse_completion

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway
    from spillover.runtime.journal import JournalRecord

__all__ = ["recover"]

log = logging.getLogger("spillover.recovery")
_background: set[asyncio.Task[Any]] = set()


def _replayable(rec: JournalRecord) -> bool:
    if rec.state in (State.ACCEPTED, State.QUEUED, State.ADMITTED):
        return True
    return rec.state is State.RUNNING and (not rec.stream or rec.tokens_delivered == 0)


async def _end(gw: Gateway, rec: JournalRecord, exc: SpilloverError) -> None:
    assert gw.journal is not None
    e = to_http(exc, rec.id)
    await gw.journal.move(
        rec.id,
        State.RESUMABLE_ERROR,
        status_code=e.status,
        response=json.dumps(e.body).encode(),
        content_type="application/json",
        error=json.dumps(e.body),
        headers=json.dumps({"X-Spillover-Request-Id": rec.id, **e.headers}),
    )


async def _replay(gw: Gateway, rec: JournalRecord) -> None:
    """Run an orphan again under its Idempotency-Key's lock: if its client resumed it
    meanwhile (it is live, or no longer in the state recovery left it in), nothing runs."""
    assert gw.journal is not None
    doc = json.loads(rec.body)
    async with gw.keys.hold(rec.idem_key):
        current = await gw.journal.get(rec.id)
        if rec.id in gw.live or current is None or current.state is not State.QUEUED:
            return
        try:
            parse = parse_chat if doc["endpoint"] == "chat" else parse_completion
            req = parse(doc["body"], gw.cfg.model.name)
            prep = await g.prepare(gw, req, rec.id)
            handler, events = await g.begin(
                gw,
                prep,
                body_json=rec.body,
                body_hash=rec.body_hash,
                idem_key=rec.idem_key,
                resume_attempts=rec.attempts,
            )
        except SpilloverError as exc:
            current = await gw.journal.get(rec.id)
            if current is not None and not current.terminal:
                await _end(gw, current, exc)
            return
    if req.stream:
        try:
            await handler.first_route(events)
        except SpilloverError as exc:
            await handler.fail(exc)
            return
        async for _ in handler.stream(events):
            pass
    else:
        await handler.run_to_body(events)


async def recover(gw: Gateway, orphans: list[JournalRecord]) -> dict[str, int]:
    """Re-queue the replayable requests among ``orphans`` (unfinished when this gateway
    started, read before it served anything); end the others as resumable errors."""
    assert gw.journal is not None
    counts = {"replayed": 0, "ended": 0}
    for rec in orphans:
        if rec.id in gw.live:  # resumed by its client (same Idempotency-Key) meanwhile
            continue
        if _replayable(rec):
            # Back to QUEUED through the table (RUNNING/ADMITTED/ACCEPTED -> QUEUED are legal).
            await gw.journal.move(rec.id, State.QUEUED, reason="recovered after gateway restart", attempts=rec.attempts)
            rec = await gw.journal.get(rec.id) or rec
            # begin() moves QUEUED -> QUEUED again for the new attempt; resume from QUEUED.
            task = asyncio.create_task(_replay(gw, rec), name=f"recover-{rec.id}")
            _background.add(task)
            task.add_done_callback(_background.discard)
            counts["replayed"] += 1
        else:
            await _end(
                gw,
                rec,
                FailoverInterrupted(
                    f"the gateway restarted while request {rec.id} was streaming; {rec.tokens_delivered}+ tokens "
                    "had been delivered, so it cannot be replayed without changing what the client saw",
                    retry_after_s=1.0,
                ),
            )
            counts["ended"] += 1
    if counts["replayed"] or counts["ended"]:
        log.info("recovered journal: %s", counts)
    return counts
