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
from spillover.errors import JournalUnavailable
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


async def _held(j: Journal, writes: list[Awaitable[Any]]) -> list[Any]:
    """Run ``writes`` while the journal thread is busy (a read holds the connection, so none
    is written on the event loop: rule 8), so they all wait for it together (one group commit
    when they are lifecycle writes); their results or errors, in order."""
    import threading

    while j._draining:  # the last drain hands back its results before it ends
        await asyncio.sleep(0.001)
    gate = threading.Event()
    blocker = asyncio.ensure_future(j._run(gate.wait))
    while not j._db_lock.locked():
        await asyncio.sleep(0.001)
    try:
        tasks = [asyncio.ensure_future(w) for w in writes]
        await asyncio.sleep(0.05)  # every write is waiting now
        assert len(j._pending) == len(writes)
    finally:
        gate.set()
    await blocker
    return await asyncio.gather(*tasks, return_exceptions=True)


def spy_groups(j: Journal) -> list[int]:
    """The sizes of the groups ``j`` commits from now on, in order."""
    groups: list[int] = []
    real = j._group

    def spy(ops: Any) -> Any:
        groups.append(len(ops))
        return real(ops)

    j._group = spy  # type: ignore[method-assign]
    return groups


def test_writes_that_wait_together_commit_as_one_group(tmp_path: Path) -> None:
    """Lifecycle writes queued at once run in one transaction: each caller gets its own
    result, the rows and histories are exactly those of one-by-one writes."""

    async def body(j: Journal) -> None:
        groups = spy_groups(j)
        assert await _held(j, [accept(j, f"r{i}") for i in range(8)]) == [None] * 8
        moves = [j.move(f"r{i}", State.QUEUED, route="gpu", attempts=1) for i in range(8)]
        assert await _held(j, moves) == [None] * 8
        assert groups == [8, 8]
        for i in range(8):
            assert [h["to"] for h in await j.history(f"r{i}")] == ["accepted", "queued"]
        stats = j.statistics()
        assert (stats.rows, stats.writes, stats.write_errors) == (8, 16, 0)

    with_journal(tmp_path, body)


def test_a_failing_write_in_a_group_fails_alone(tmp_path: Path) -> None:
    """A used key, an unknown id and an illegal move inside a group raise for their own
    callers only; the writes beside them commit."""

    async def body(j: Journal) -> None:
        await accept(j, "done")
        await j.move("done", State.CANCELLED)
        got = await _held(
            j,
            [
                accept(j, "a", key="k"),
                accept(j, "b", key="k"),  # the same key: KeyConflict
                j.move("nobody", State.QUEUED),  # KeyError
                j.move("done", State.RUNNING),  # IllegalTransition
                accept(j, "c"),
            ],
        )
        assert got[0] is None and got[4] is None
        assert isinstance(got[1], KeyConflict) and got[1].existing.id == "a"
        assert isinstance(got[2], KeyError) and isinstance(got[3], IllegalTransition)
        assert await j.get("b") is None and (await j.get("c")) is not None
        assert [h["to"] for h in await j.history("done")] == ["accepted", "cancelled"]
        assert await j.count() == 3

    with_journal(tmp_path, body)


def test_accept_can_queue_in_the_same_write(tmp_path: Path) -> None:
    """``accept(queued=...)`` records ACCEPTED and QUEUED in one write: both rows of history."""

    async def body(j: Journal) -> None:
        await j.accept(
            rid="r", idem_key="k", body_hash="h", kind="text", stream=True, body="{}", model="m",
            queued={"route": "gpu", "attempts": 1},
        )  # fmt: skip
        rec = await j.get("r")
        assert rec is not None and (rec.state, rec.route, rec.attempts) == (State.QUEUED, "gpu", 1)
        assert [(h["from"], h["to"]) for h in await j.history("r")] == [
            ("received", "accepted"),
            ("accepted", "queued"),
        ]
        assert j.statistics().writes == 1
        await j.move("r", State.ADMITTED, route="gpu", attempts=1)
        with pytest.raises(IllegalTransition):
            await j.move("r", State.ACCEPTED)

    with_journal(tmp_path, body)


def test_a_write_that_fails_after_writing_reruns_its_group_one_by_one(tmp_path: Path) -> None:
    """A write that fails inside a group once it has written (here an UPDATE of a column that
    does not exist) rolls the whole group back; its writes run one by one: only it fails, and
    the states the group wrote are read again from the database afterwards."""

    async def body(j: Journal) -> None:
        await accept(j, "a")
        got = await _held(
            j, [j.move("a", State.QUEUED, attempts=1), j.update("a", no_such_column=1), j.move("a", State.ADMITTED)]
        )
        assert got[0] is None and isinstance(got[1], JournalUnavailable) and got[2] is None
        assert [h["to"] for h in await j.history("a")] == ["accepted", "queued", "admitted"]
        await j.move("a", State.RUNNING)
        with pytest.raises(IllegalTransition):
            await j.move("a", State.ADMITTED)
        assert j.statistics().write_errors == 1

    with_journal(tmp_path, body)


def test_the_remembered_states_never_lie_when_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the journal thread remembers ``STATES_KEPT`` states, a request it remembers still
    has its state kept current, and one it cannot remember is read from the database; a
    prune is measured at once (``statistics``)."""
    from spillover.runtime import journal as journal_module

    monkeypatch.setattr(journal_module, "STATES_KEPT", 1)

    async def body(j: Journal) -> None:
        await accept(j, "a")
        await accept(j, "b")
        await j.move("a", State.QUEUED)
        await j.move("b", State.QUEUED)
        await j.move("a", State.ADMITTED)
        await j.move("b", State.ADMITTED)
        with pytest.raises(IllegalTransition):
            await j.move("a", State.ACCEPTED)
        for rid in ("a", "b"):
            await j.move(rid, State.RUNNING)
            await j.move(rid, State.COMPLETED, response=b"x" * 20_000)
        await j.prune(time.time() + 10**9)
        assert await j.count() == 0
        assert j.statistics().bytes_used == j._used_bytes()

    with_journal(tmp_path, body)


def test_a_group_that_must_prune_runs_one_by_one(tmp_path: Path) -> None:
    """When a write of a group would pass the high-water mark (a prune commits on its own),
    the group is rolled back and its writes run one by one: same rows, same counters."""

    async def body(j: Journal) -> None:
        await accept(j, "r0")
        real = j._used_bytes
        measured: list[int] = []

        def at_the_mark_once() -> int:  # the group's first measurement finds the journal at the mark
            measured.append(real() if measured else j._bounds.high_water)
            return measured[-1]

        j._bytes_bound = j._bounds.high_water  # the bound at the mark: the first write measures
        j._used_bytes = at_the_mark_once  # type: ignore[method-assign]
        got = await _held(j, [accept(j, "r1"), j.move("r0", State.QUEUED), accept(j, "r2")])
        assert got == [None, None, None]
        assert await j.count() == 3 and (await j.get("r0")).state is State.QUEUED  # type: ignore[union-attr]
        stats = j.statistics()
        assert (stats.rows, stats.writes, stats.write_errors) == (3, 4, 0)
        assert stats.bytes_used < j._bounds.high_water  # measured again after the writes
        assert measured[0] == j._bounds.high_water and len(measured) >= 2

    with_journal(tmp_path, body)


def test_a_full_disk_fails_every_write_of_a_group(tmp_path: Path) -> None:
    """The injected full disk (rule 6) fails each write of a group as it fails a lone one."""
    from spillover.runtime.journal import set_disk_full

    async def body(j: Journal) -> None:
        await accept(j, "r0")
        set_disk_full(j.path, True)
        got = await _held(j, [accept(j, "r1"), j.move("r0", State.QUEUED)])
        assert all(isinstance(g, JournalUnavailable) for g in got)
        assert j.statistics().write_errors == 2
        set_disk_full(j.path, False)
        assert await _held(j, [accept(j, "r1"), j.move("r0", State.QUEUED)]) == [None, None]
        assert await j.count() == 2

    with_journal(tmp_path, body)


def test_a_group_keeps_the_high_water_mark_as_one_by_one_writes_do(tmp_path: Path) -> None:
    """Rule 4 inside a group: each write measures the pages the writes before it took, so
    a group of small accepts into a journal just under its high-water mark is refused where
    one-by-one accepts are, and an accepted request can still finish with a large answer."""

    async def body(j: Journal) -> None:
        fill = "y" * 2000
        n = 0
        while j._bytes_used + 3 * len(fill) < j._bounds.high_water:  # unfinished requests
            await j.accept(rid=f"f{n}", idem_key=None, body_hash="h", kind="t", stream=False, body=fill, model="m")
            n += 1
        got = await _held(j, [accept(j, f"s{k}") for k in range(300)])
        refused = [g for g in got if g is not None]
        assert refused and all(isinstance(g, JournalUnavailable) for g in refused)
        assert j._bytes_used <= j._bounds.high_water + 4096  # at most about one write past it
        await j.move("f0", State.QUEUED, response="z" * 50_000)  # within the headroom kept for it

    with_journal(tmp_path, body, max_bytes=1024 * 1024, max=100_000)


@pytest.mark.parametrize("how", ["removed", "replaced", "wal removed", "linked wal removed"])
def test_a_journal_file_removed_or_replaced_while_open_fails_every_write(tmp_path: Path, how: str) -> None:
    """Round 49b: with the journal's files unlinked, SQLite wrote on into the removed files:
    requests were answered 200 with no durable record, and after a restart their keys ran
    again. Every write now fails as the journal's other write errors do (a 503
    ``journal_unavailable`` before acceptance, an answer kept until it is durable)."""
    path = tmp_path / "j.sqlite3"
    wal = Path(f"{path}-wal")
    opened = path
    if how.startswith("linked"):  # the journal's path a symbolic link: SQLite's WAL is beside the real file
        opened = tmp_path / "link.sqlite3"
        opened.symlink_to(path)

    async def body(j: Journal) -> None:
        await complete(j, "r1")
        if how == "removed":
            path.unlink()
            wal.unlink()
        elif how == "replaced":
            copy = path.read_bytes()
            path.unlink()
            path.write_bytes(copy)
        else:
            wal.unlink()
        with pytest.raises(JournalUnavailable):
            await accept(j, "r2")
        assert j.failing
        with pytest.raises(JournalUnavailable):
            await accept(j, "r3")  # not once: every write

    run_journal(opened, body)
