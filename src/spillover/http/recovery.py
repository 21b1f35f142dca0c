"""The HTTP side of start-up recovery: run one orphan again from its stored body, in its
own wire format (a JSON body or an SSE transcript), so ``GET /v1/requests/{id}`` and a retry
with its Idempotency-Key get exactly what its client would have. Which orphans run again is
decided in ``runtime.recovery``; this is the ``replay`` it is given.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from spillover.core.lifecycle import State
from spillover.errors import SpilloverError
from spillover.http import generation as g
from spillover.http.schemas import parse_chat, parse_completion
from spillover.runtime.recovery import end_orphan

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway
    from spillover.runtime.journal import JournalRecord

__all__ = ["replay_orphan"]


async def replay_orphan(gw: Gateway, rec: JournalRecord) -> None:
    """Run an orphan again under its Idempotency-Key's lock: if its client resumed it
    meanwhile (it is live, or no longer in the state recovery left it in), nothing runs."""
    assert gw.journal is not None
    async with gw.keys.hold(rec.idem_key):
        current = await gw.journal.get(rec.id)
        if rec.id in gw.live or current is None or current.state is not State.QUEUED:
            return
        try:
            doc = json.loads(rec.body)
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
        except Exception as exc:  # its stored body no longer runs (or a bug): it ends, resumable
            err = exc if isinstance(exc, SpilloverError) else SpilloverError(f"internal error: {type(exc).__name__}")
            current = await gw.journal.get(rec.id)
            if current is not None and not current.terminal:
                await end_orphan(gw, current, err)
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
