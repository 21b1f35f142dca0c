"""The SQLite journal on disk: durable acceptance, table-checked moves, key binding, and
bounded retention (age and count)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from spillover.core.lifecycle import IllegalTransition, State
from spillover.runtime.journal import Journal, KeyConflict


def run_journal(path: Path, body: Callable[[Journal], Awaitable[Any]], **kw: Any) -> Any:
    """Open a journal at ``path`` (``kw``: Journal's settings), run ``body`` against it, close it."""

    async def go() -> Any:
        j = Journal(path, **({"retention_s": 3600.0, "max_requests": 100} | kw))
        await j.open()
        try:
            return await body(j)
        finally:
            await j.close()

    return asyncio.run(go())


def with_journal(tmp_path: Path, body: Callable[[Journal], Awaitable[Any]], **kw: Any) -> Any:
    """A journal in ``tmp_path`` (``max``: its max_requests)."""
    extra = {"max_requests": kw["max"]} if "max" in kw else {}
    return run_journal(tmp_path / "j.sqlite3", body, **extra, **{k: v for k, v in kw.items() if k != "max"})


async def accept(j: Journal, rid: str, key: str | None = None) -> None:
    await j.accept(rid=rid, idem_key=key, body_hash="h", kind="text", stream=False, body="{}", model="m")


async def complete(j: Journal, rid: str) -> None:
    await accept(j, rid)
    for state in (State.QUEUED, State.ADMITTED, State.RUNNING, State.COMPLETED):
        await j.move(rid, state, route="gpu", attempts=1)


def test_moves_follow_the_table_and_an_illegal_one_writes_nothing(tmp_path: Path) -> None:
    """Legal moves are rows of history; an illegal one raises and leaves state and history as they were."""

    async def body(j: Journal) -> None:
        await complete(j, "r1")
        rec = await j.get("r1")
        assert rec is not None and rec.state is State.COMPLETED and rec.finished_s is not None
        before = await j.history("r1")
        assert [h["to"] for h in before] == ["accepted", "queued", "admitted", "running", "completed"]
        with pytest.raises(IllegalTransition):
            await j.move("r1", State.RUNNING)
        assert (await j.get("r1")).state is State.COMPLETED  # type: ignore[union-attr]
        assert await j.history("r1") == before

    with_journal(tmp_path, body)


def test_a_key_binds_one_request(tmp_path: Path) -> None:
    """A second accept with a used Idempotency-Key raises KeyConflict naming the first; nothing is added."""

    async def body(j: Journal) -> None:
        await accept(j, "r1", key="k")
        with pytest.raises(KeyConflict) as info:
            await accept(j, "r2", key="k")
        assert info.value.existing.id == "r1"
        assert await j.get("r2") is None and await j.count() == 1
        assert (await j.by_key("k")).id == "r1"  # type: ignore[union-attr]

    with_journal(tmp_path, body)


def test_retention_by_age_keeps_unfinished_requests(tmp_path: Path) -> None:
    """Finished requests past the retention age go (with their history); unfinished ones never do."""

    async def body(j: Journal) -> None:
        await complete(j, "done")
        await accept(j, "open")
        assert await j.prune(time.time()) == 0  # young: kept
        assert await j.prune(time.time() + 61) == 1
        assert await j.get("done") is None and await j.history("done") == []
        assert [r.id for r in await j.unfinished()] == ["open"]

    with_journal(tmp_path, body, retention_s=60.0)


def test_retention_by_count_drops_the_oldest_finished(tmp_path: Path) -> None:
    """Beyond max_requests finished requests, the oldest finished go first; unfinished ones stay."""

    async def body(j: Journal) -> None:
        for i in range(5):
            await complete(j, f"r{i}")
        await accept(j, "open")
        assert await j.prune() == 2
        kept = [rid for rid in ("r0", "r1", "r2", "r3", "r4", "open") if await j.get(rid) is not None]
        assert kept == ["r2", "r3", "r4", "open"]

    with_journal(tmp_path, body, max=3)
