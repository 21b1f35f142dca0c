"""The request journal: SQLite in WAL mode, one row per request, one per transition.

A request is ACCEPTED only once its row is committed with ``synchronous=FULL`` (fsync),
before the first response byte. Later transitions commit with ``synchronous=NORMAL``:
in WAL mode they survive a killed gateway (the SIGKILL case), only an OS crash could
lose the last of them. Every lifecycle move is a row in ``transitions``. On start-up the
journal is the truth (see ``Journal.unfinished``). SQLite work runs on one dedicated thread
(``runtime.journal_thread``), except the writes rule 8 lets the event loop make itself; writes
keep their order, and the event loop never waits for an fsync.

This module owns the connection, its transactions and the lifecycle writes. What is stored
(schema, ``JournalRecord``) is in ``runtime.journal_records``; the size bounds, retention and
the injected full disk (rules 2, 3 and 6) are in ``runtime.journal_bounds``.

Rules:

1. Every write is one transaction; on any error it is rolled back, so the next write
   starts clean. A failed write raises ``JournalUnavailable`` (503); ``KeyConflict``,
   ``KeyError`` and ``IllegalTransition`` pass through unchanged. Group commit: lifecycle
   writes (accept, move, update) that wait for the journal thread together run as one
   transaction (at most ``GROUP_MAX``), and every caller returns after the one COMMIT; the
   group commits with ``synchronous=FULL`` when it holds an accept. A write that refuses
   (a key conflict, an illegal move) does so before it writes, so it leaves the group's
   other writes standing. A group that would need a prune, in which a write fails after
   writing, or whose BEGIN or COMMIT fails, is rolled back whole and its writes run again
   one by one, as above. A write whose caller was cancelled before it started is not
   written.
2. Retention is bounded by age (``retention_s``), by count (``max_requests`` finished
   ones) and by bytes: once the used bytes pass ``HIGH_WATER_RATIO`` of ``max_bytes``,
   the oldest finished requests go until ``LOW_WATER_RATIO``. Unfinished ones never do.
3. ``max_bytes`` is enforced by SQLite itself: ``max_page_count`` caps the database file
   at the bound minus a WAL allowance, so a write past it fails with SQLITE_FULL. The WAL
   is checkpointed every ``SizeBounds.wal_pages`` and cut back to the allowance; one
   transaction larger than that (a big row, or a move, which rewrites its row) outgrows it
   until the next checkpoint. ``prune`` gives free pages back (``auto_vacuum=INCREMENTAL``)
   and empties the WAL, so after it the files together are within ``max_bytes``.
4. ``accept`` and ``move`` make room first when what they write would pass the high-water
   mark. The check runs on an upper bound of the bytes in use (each write adds more than it
   can take); only a bound that would pass the mark is measured, and pruning follows when
   the measurement passes it too. ``accept`` refuses while the journal stays above it (full
   of unfinished requests), and refuses a body larger than the headroom above it: a move
   rewrites its row, and the headroom must hold one rewrite, so requests already accepted
   can always finish.
5. The files hold every prompt and answer: they are created, and kept, mode 0600.
6. Fault injection (the drill, tests): while a file named ``<journal>.disk-full`` exists
   (``set_disk_full``, ``spillover sim disk-full``), every write fails as on a full disk
   (ENOSPC), through the same path as a real one. So does every write once a file it opened
   (the database, its WAL) was removed or replaced (ENOENT, ``check_same_files``): SQLite
   would write on into the removed file, durable nowhere anyone would find it.
7. A request's intermediate moves (ADMITTED, RUNNING: ``note_move``) are not waited for:
   they queue behind the writes before them and commit with the next write that is waited
   for (usually the same request's next one), or after about ``DEFER_S`` (at most twice
   that, and ``GROUP_MAX`` of them a pass) when none comes. Each keeps the time it was
   noted. Noted after ``close``, a move is dropped (the gateway is stopping).
   Replay after a restart does not tell them from QUEUED, so the durability that matters
   is unchanged: ACCEPTED is fsynced before the first byte, a terminal state and
   ``tokens_delivered`` are committed before the client is answered, and every transition
   is still a row. One that cannot be written (a full disk) is written, in order, before
   the same request's next move or update; until then that write fails as it would have.
8. A move or an update that finds the journal thread idle (no write queued or running, no
   read running) is written on the caller's event loop, with the noted moves before it, in
   order: it commits with ``synchronous=NORMAL``, which in WAL mode appends to the WAL and
   does not fsync, so the loop does not wait for the disk, and the two thread hand-offs a
   write costs are saved. It stays on the thread when it could need a prune (rule 4) or a
   checkpoint: the thread checkpoints (PASSIVE) after a pass once an upper bound of the
   bytes written to the WAL since the last checkpoint reaches half the WAL allowance
   (``CHECKPOINT_SHARE`` of ``SizeBounds.wal_pages``), and a write on the loop must stay
   under it; SQLite's own automatic checkpoint at ``wal_pages`` is the backstop (it could
   run on the loop only if the bound were exceeded, or a reader held back the last
   checkpoint). An accept (fsync) and a prune always run on the thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from spillover.core.lifecycle import TERMINAL, State, advance
from spillover.errors import JournalUnavailable
from spillover.runtime import journal_bounds
from spillover.runtime.journal_bounds import SizeBounds, disk_full_marker, set_disk_full
from spillover.runtime.journal_records import (
    COLS,
    SCHEMA,
    SERVICE_EVENTS_KEPT,
    TERMINAL_MARKS,
    TERMINAL_VALUES,
    JournalRecord,
    JournalStatistics,
    KeyConflict,
    dumps,
    record,
    stored_json,
)
from spillover.runtime.journal_thread import JournalThread

__all__ = [
    "NOTED",
    "SCHEMA",
    "Journal",
    "JournalRecord",
    "JournalStatistics",
    "KeyConflict",
    "disk_full_marker",
    "dumps",
    "set_disk_full",
    "stored_json",
]

log = logging.getLogger("spillover.journal")

T = TypeVar("T")

RETRY_AFTER_S = 2.0  # what a client is told after a failed journal write


def _closed() -> JournalUnavailable:
    """What a read or write gets from a journal that is not open (the gateway is stopping):
    the 503 any journal failure is, not a bug's error (``RuntimeError``, ``AssertionError``)."""
    return JournalUnavailable("the request journal is closed (the gateway is stopping)", retry_after_s=RETRY_AFTER_S)


FILE_MODE = 0o600


class _RunAlone(Exception):
    """A write in a group would have to prune first (rule 4), or failed after it wrote: the
    group is rolled back and runs one by one."""


@dataclass(frozen=True)
class _Op:
    """A write waiting for the journal thread, and where its caller waits."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any] | None  # None: nobody waits (rule 7)
    loop: asyncio.AbstractEventLoop

    def groupable(self) -> bool:
        return self.fn.__name__ in GROUPABLE


GROUPABLE = frozenset({"_accept", "_move", "_update", "_noted_move"})  # lifecycle writes: never a prune or a script
DEFER_S = 0.25  # an intermediate move nobody waits for is committed about this late (rule 7)
NOTED = frozenset({State.ADMITTED, State.RUNNING})  # the intermediate moves callers note (rule 7)
GROUP_MAX = 64  # writes one drain pass takes: bounds a group's transaction, WAL growth and wait
GROWTH_PAGES = 16  # pages a write may take beyond twice what it declares (rule 4's upper bound)
INLINE = frozenset({"_move", "_update"})  # writes rule 8 lets the event loop make (no fsync)
CHECKPOINT_SHARE = 0.5  # of the WAL allowance: the thread checkpoints past it; loop writes stay under it (rule 8)
STATES_KEPT = 100_000  # unfinished requests whose state the journal thread remembers
REMEASURE_RATIO = 0.01  # the bytes in use are measured again once the bound grew this share of max_bytes


def _deliver(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    """A read's or a write's result, on its caller's loop (its caller may have gone, cancelled:
    then nobody hears, and a write stands)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _nothing() -> None:
    """A write with nothing to write: ``Journal.flush`` waits for the writes before it."""


def _need(fields: dict[str, Any]) -> int:
    """The bytes a write's text and blob fields take, as stored."""
    return sum(len(v.encode()) if isinstance(v, str) else len(v) for v in fields.values() if isinstance(v, str | bytes))


def _resolve(done: list[tuple[_Op, Any, BaseException | None]]) -> None:
    for op, value, exc in done:
        if op.future is not None:  # a noted move has no caller
            _deliver(op.future, value, exc)


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
        self._bounds = SizeBounds(max_bytes)  # raises ValueError below MIN_MAX_BYTES
        self.path = path
        self._disk_full_marker = str(disk_full_marker(path))
        self.retention_s = retention_s
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._thread = JournalThread("journal")
        # Writes waiting for the journal thread (group commit, rule 1), and whether a drain runs.
        self._pending: list[_Op] = []
        self._pending_lock = threading.Lock()
        self._draining = False
        # Held by whoever uses the connection: a drain pass or a read on the journal thread,
        # or a write on the event loop (rule 8), which only tries it.
        self._db_lock = threading.Lock()
        self._wal_bound = 0  # bytes written to the WAL since the last checkpoint, an upper bound (rule 8)
        self._grouped = False  # the journal thread is inside a group's transaction
        self._sync_full = False  # PRAGMA synchronous is FULL (else NORMAL, the connection's default here)
        self._db: sqlite3.Connection | None = None
        self._bytes_used = 0  # measured (pages in use), as of the last ``_measure``
        self._bytes_bound = 0  # an upper bound of the bytes in use now (rule 4)
        self._states: dict[str, State] = {}  # unfinished requests' states as last written (``_known``)
        # Noted moves that could not be written, per request, in order: written before its next move (rule 7).
        self._unwritten: dict[str, list[tuple[State, dict[str, Any], float]]] = {}
        self._tick_handle: asyncio.TimerHandle | None = None  # rule 7's DEFER_S timer, while noted moves wait
        self._closed = False
        self._files: dict[str, tuple[int, int]] = {}  # the database and WAL it opened (``_counted``)
        self._rows = 0
        self.writes = 0
        self.write_errors = 0
        self.failing = False  # the last write failed (a full disk, an I/O error); a write that commits clears it

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
        """``fn(*args)`` on the journal thread, holding the connection; its result here."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def job() -> None:
            value: Any = None
            exc: BaseException | None = None
            try:
                value = self._locked(fn, *args)
            except BaseException as e:
                exc = e
            with suppress(RuntimeError):  # a closed loop: nobody waits there any more
                loop.call_soon_threadsafe(_deliver, fut, value, exc)

        try:
            self._thread.submit(job)
        except RuntimeError as exc:  # closed: the journal thread takes nothing more
            raise _closed() from exc
        return await fut

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._db_lock:
            return fn(*args)

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a write on the journal thread (with whatever other writes wait then: rule 1),
        or here when rule 8 allows; a SQLite or OS error becomes JournalUnavailable."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        op = _Op(fn, args, fut, loop)
        if not self._write_here(op):
            with self._pending_lock:
                self._pending.append(op)
                start, self._draining = not self._draining, True
            if start:
                self._start_drain()
        try:
            return await fut
        except (sqlite3.Error, OSError) as exc:
            raise JournalUnavailable(
                f"the request journal cannot be written: {exc}", retry_after_s=RETRY_AFTER_S
            ) from exc

    def _write_here(self, op: _Op) -> bool:
        """Rule 8: write ``op`` on this (the event loop's) thread, after the noted moves that
        wait, when the journal thread is idle and none of them could need a prune or a
        checkpoint. False: it was not written (the caller queues it for the thread)."""
        if op.fn.__name__ not in INLINE or self._draining or self._db is None:
            return False
        if not self._db_lock.acquire(blocking=False):  # a read is running on the thread
            return False
        try:
            with self._pending_lock:
                # A pass was queued meanwhile (another loop's write). Not draining means only
                # noted moves wait: a waited write always sets ``_draining`` (``_write``), and a
                # pass clears it only when none waits (``_drain``).
                if self._draining:
                    return False
                ops = [*self._pending, op]
                grow = sum(self._growth(_need(o.args[-2] if o.future is None else o.args[-1])) for o in ops)
                if self._bytes_bound + grow > self._bounds.high_water or self._wal_bound + grow > self._checkpoint_at:
                    return False
                self._pending = []
            results: list[tuple[Any, BaseException | None]] = []
            self._write_ops(ops, results)
        finally:
            self._db_lock.release()
        self._settle(ops, results)
        return True

    def _start_drain(self) -> None:
        """Queue a drain pass (the caller set ``_draining``)."""
        try:
            self._thread.submit(self._drain)
        except RuntimeError as exc:  # closed: every write waiting now fails as this one
            with self._pending_lock:
                ops, self._pending, self._draining = self._pending, [], False
            err = _closed()
            err.__cause__ = exc
            self._settle(ops, [(None, err)] * len(ops))

    def _tick(self) -> None:
        """Rule 7's timer (event loop): start a drain for the noted moves still waiting, and
        come back while any wait."""
        self._tick_handle = None
        with self._pending_lock:
            if not self._pending:
                return
            start, self._draining = not self._draining, True
        if start:
            self._start_drain()
        self._tick_handle = asyncio.get_running_loop().call_later(DEFER_S, self._tick)

    # -- thread side -----------------------------------------------------------------
    def _drain(self) -> None:
        """Run up to ``GROUP_MAX`` waiting writes in order: runs of two or more lifecycle
        writes as one group, anything else alone. Then, when more wait, queue another pass
        behind whatever the pool holds (a read waits for one pass at most)."""
        ops: list[_Op] = []
        results: list[tuple[Any, BaseException | None]] = []
        try:
            with self._pending_lock:
                ops, self._pending = self._pending[:GROUP_MAX], self._pending[GROUP_MAX:]
            # A caller cancelled before its write started: nothing is written (as a job
            # run_in_executor had not started yet).
            ops = [op for op in ops if op.future is None or not op.future.cancelled()]
            with self._db_lock:
                self._write_ops(ops, results)
            with self._pending_lock:  # idle (rule 8) before the callers hear: their next write may be theirs
                more = any(op.future is not None for op in self._pending)  # noted moves wait for a write or the timer
                self._draining = more
            self._settle(ops, results)
            ops, results = [], []
            self._checkpoint_if_due()
            if more:
                self._thread.submit(self._drain)
        except BaseException as exc:  # a bug, or the thread closed: no caller may wait for ever
            with self._pending_lock:
                rest, self._pending, self._draining = ops[len(results) :] + self._pending, [], False
            self._settle(ops[: len(results)], results)
            err = _closed() if isinstance(exc, RuntimeError) else exc  # the thread closed (a bug: itself)
            self._settle(rest, [(None, err)] * len(rest))
            if not isinstance(exc, RuntimeError):
                raise

    def _write_ops(self, ops: list[_Op], results: list[tuple[Any, BaseException | None]]) -> None:
        """Write ``ops`` in order (holding ``_db_lock``): runs of two or more lifecycle writes
        as one group, anything else alone; each one's result is appended to ``results``."""
        if self._db is None:  # closed (or never opened): each fails as a closed journal's write
            results += [(None, _closed()) for _ in ops]
            return
        i = 0
        while i < len(ops):
            j = i
            while j < len(ops) and ops[j].groupable():
                j += 1
            if j - i >= 2:
                results += self._group(ops[i:j])
                i = j
            else:
                results.append(self._alone(ops[i]))
                i += 1

    def _checkpoint_if_due(self) -> None:
        """Journal thread, after a pass: checkpoint (PASSIVE) once the WAL bound reaches
        ``CHECKPOINT_SHARE`` of the allowance (rule 8). What a reader holds back stays in the WAL
        for the next one, or SQLite's own."""
        if self._wal_bound < self._checkpoint_at:
            return
        with self._db_lock:
            if self._db is None:
                return
            self._wal_bound = 0
            try:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:  # a full disk: SQLite's own checkpoint tries again
                log.warning("journal: checkpoint failed: %s", exc)

    def _alone(self, op: _Op) -> tuple[Any, BaseException | None]:
        if op.fn is _nothing:  # ``flush``: the writes before it are done
            return None, None
        try:
            if op.future is None:  # a noted move: ``_noted_move`` keeps it when the disk fails
                return op.fn(*op.args), None
            self._synchronous(full=op.fn.__name__ == "_accept")
            return self._counted(op.fn, *op.args), None
        except Exception as exc:
            return None, exc

    def _group(self, ops: list[_Op]) -> list[tuple[Any, BaseException | None]]:
        """Several lifecycle writes in one transaction (rule 1). A write that refuses (a key
        conflict, an illegal move) does so before it writes anything, so there is nothing to
        undo: no savepoint per write. One that wrote and then failed, or any SQLite or OS
        error, rolls the whole group back and it runs one by one."""
        db = self._db_()
        counters = (self.writes, self._rows, self.write_errors)
        unwritten = {rid: list(moves) for rid, moves in self._unwritten.items()}
        results: list[tuple[Any, BaseException | None]] = []
        try:
            journal_bounds.check_disk_full(self._disk_full_marker)  # rule 6: the writes then fail one by one
            journal_bounds.check_same_files(self._files)
            self._synchronous(full=any(op.fn.__name__ == "_accept" for op in ops))  # durable before its first byte
            db.execute("BEGIN IMMEDIATE")
            self._grouped = True
            for op in ops:
                changes = db.total_changes
                try:
                    results.append((op.fn(*op.args), None))
                except (_RunAlone, sqlite3.Error, OSError):
                    raise
                except Exception as exc:
                    if db.total_changes != changes:  # it wrote before it failed: undo all, one by one
                        raise _RunAlone from exc
                    results.append((None, exc))
            self._grouped = False
            db.execute("COMMIT")
            self.failing = False
        except (_RunAlone, sqlite3.Error, OSError):
            self._grouped = False
            self._states.clear()  # the group's states are rolled back
            if db.in_transaction:
                with suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            self.writes, self._rows, self.write_errors = counters
            self._unwritten = unwritten  # the moves written in the group are rolled back
            return [self._alone(op) for op in ops]  # one by one, each as rule 1 says
        finally:
            self._grouped = False
            self._measure_if_due()
        return results

    def _synchronous(self, *, full: bool) -> None:
        """``synchronous=FULL`` (an accept commits) or NORMAL, set only when it changes."""
        if full != self._sync_full:
            self._db_().execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
            self._sync_full = full

    @staticmethod
    def _settle(ops: list[_Op], results: list[tuple[Any, BaseException | None]]) -> None:
        """Hand each caller its result: at once on the caller's loop (rule 8), else with one
        call into each caller's loop; a noted move has no caller: its error (a bug) is logged."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Op, Any, BaseException | None]]] = {}
        for op, (value, exc) in zip(ops, results, strict=True):
            if op.future is not None:
                by_loop.setdefault(op.loop, []).append((op, value, exc))
            elif exc is not None:
                log.error("journal: a noted move %s was refused: %r", op.args[:2], exc)
        here = asyncio._get_running_loop()
        for loop, done in by_loop.items():
            if loop is here:
                _resolve(done)
                continue
            with suppress(RuntimeError):  # a closed loop: nobody waits there any more
                loop.call_soon_threadsafe(_resolve, done)

    def _counted(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            journal_bounds.check_disk_full(self._disk_full_marker)  # rule 6
            journal_bounds.check_same_files(self._files)  # rule 6: the files it opened are still the journal
            out = fn(*args)
            self.failing = False
            return out
        except (sqlite3.Error, OSError):
            self.write_errors += 1
            self.failing = True
            raise
        finally:
            self._measure_if_due()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE))  # before SQLite creates it
        self._restrict_files()
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            self._bounds = journal_bounds.configure(db, self.max_bytes)
            self._db = db
            db.executescript(SCHEMA)
            self._rows = self._count()
            self._measure()
        except BaseException:
            self._db = None
            db.close()
            raise
        self._restrict_files()
        self._files = journal_bounds.file_identities(self.path)

    def _restrict_files(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            f = self.path.with_name(self.path.name + suffix)
            if f.exists():
                os.chmod(f, FILE_MODE)

    def _db_(self) -> sqlite3.Connection:
        if self._db is None:  # never opened, or closed (a write that came after ``close``)
            raise _closed()
        return self._db

    def _used_bytes(self) -> int:
        return journal_bounds.used_bytes(self._db_(), self._bounds.page_size)

    def _known(self, rid: str, state: State) -> None:
        """Remember the state just written for ``rid`` (its next move need not read it back);
        a finished request is forgotten. Cleared whenever a transaction rolls back."""
        if state in TERMINAL or (rid not in self._states and len(self._states) >= STATES_KEPT):
            self._states.pop(rid, None)
        else:
            self._states[rid] = state

    def _measure(self) -> int:
        """The bytes in use, measured (two PRAGMAs); the bound starts again from them."""
        self._bytes_used = self._bytes_bound = self._used_bytes()
        return self._bytes_used

    def _measure_if_due(self) -> None:
        """After a write: measure again once the bound has grown ``REMEASURE_RATIO`` of
        ``max_bytes`` past the last measurement (``statistics`` stays that close)."""
        if self._bytes_bound - self._bytes_used > REMEASURE_RATIO * self.max_bytes:
            with suppress(sqlite3.Error):  # else a later write does
                self._measure()

    @property
    def _checkpoint_at(self) -> float:
        """The WAL bound at which the thread checkpoints (rule 8)."""
        return CHECKPOINT_SHARE * self._bounds.wal_pages * self._bounds.page_size

    def _growth(self, need: int) -> int:
        """More bytes than a write declaring ``need`` can take or write (its row's overflow
        pages, page splits of the tables and indexes)."""
        return 2 * need + GROWTH_PAGES * self._bounds.page_size

    def _grow(self, need: int) -> None:
        """A write declaring ``need`` bytes is under way: raise the upper bounds of the bytes
        in use and of those written to the WAL since the last checkpoint."""
        growth = self._growth(need)
        self._bytes_bound += growth
        self._wal_bound += growth

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT; any exception (or a failed COMMIT) rolls back. Inside
        a group the group's transaction stands for it."""
        db = self._db_()
        if self._grouped:
            yield db
            return
        db.execute("BEGIN IMMEDIATE")
        changes = db.total_changes
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.total_changes != changes:  # what it wrote is rolled back: read states afresh
                self._states.clear()
            if db.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL, IOERR)
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error as exc:  # keep the original error
                    log.warning("journal rollback failed: %s", exc)
            raise

    def _make_room(self, keep: str | None, need: int = 0) -> int:
        """Prune first when ``need`` more bytes would pass the high-water mark; a failed prune
        is logged, not fatal. Returns the bytes in use then. The check is first made on the
        upper bound (``_grow``), which costs nothing; only a bound that would pass the mark is
        measured (in a group that counts the pages its earlier writes took)."""
        if self._bytes_bound + need <= self._bounds.high_water:
            used = self._bytes_bound
        elif (used := self._measure()) + need > self._bounds.high_water:
            if self._grouped:  # a prune commits and checkpoints: not inside a group
                raise _RunAlone
            try:
                self._prune(time.time(), keep, need)
            except (sqlite3.Error, OSError) as exc:
                self.write_errors += 1
                log.warning("journal: pruning to make room failed: %s", exc)
            used = self._measure()
        self._grow(need)
        return used

    def _accept(self, rec: dict[str, Any]) -> None:
        if not self.keeps(need := len(rec["body"].encode())):  # its moves could not rewrite it
            self.write_errors += 1
            raise JournalUnavailable(f"the request ({need} bytes) does not fit the journal ({self.max_bytes} bytes)")
        if (used := self._make_room(keep=None, need=need)) + need > self._bounds.high_water:
            self.write_errors += 1
            raise JournalUnavailable(
                f"the request journal is full of unfinished requests ({used} of {self.max_bytes} bytes)",
                retry_after_s=RETRY_AFTER_S,
            )
        db = self._db_()
        now = time.time()
        queued = rec["queued"]
        state = State.QUEUED if queued is not None else State.ACCEPTED
        route, attempts = (queued.get("route"), queued["attempts"]) if queued is not None else (None, 0)
        if queued is not None:
            advance(State.ACCEPTED, State.QUEUED)  # before anything is written (a group's writes refuse first)
        if not self._grouped:  # a group holding an accept commits with FULL itself
            self._synchronous(full=True)  # ACCEPTED is durable before the first byte
        with self._transaction():
            if rec["idem_key"] is not None and (existing := self._by_key(rec["idem_key"])) is not None:
                raise KeyConflict(existing)
            db.execute(
                "INSERT INTO requests (id, idem_key, body_hash, kind, stream, body, model, state, attempts,"
                " route, created_s, updated_s) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rec["id"],
                    rec["idem_key"],
                    rec["body_hash"],
                    rec["kind"],
                    int(rec["stream"]),
                    rec["body"],
                    rec["model"],
                    state.value,
                    attempts,
                    route,
                    now,
                    now,
                ),
            )
            moves = [(rec["id"], now, State.RECEIVED.value, State.ACCEPTED.value, None, 0)]
            if queued is not None:
                moves.append((rec["id"], now, State.ACCEPTED.value, state.value, route, attempts))
            db.executemany(
                "INSERT INTO transitions (rid, t_s, from_state, to_state, route, attempt) VALUES (?,?,?,?,?,?)", moves
            )
            self._known(rec["id"], state)
        self.writes += 1
        self._rows += 1

    def _noted_move(self, rid: str, target: State, fields: dict[str, Any], at: float) -> None:
        """A move nobody waits for (rule 7). In a group, any error is the group's (rule 1).
        Alone, one the disk refuses is kept for the request's next write; any other error (a
        bug: an illegal move) is logged by ``_settle``."""
        if self._grouped:
            self._move(rid, target, fields, at)
            return
        try:
            self._synchronous(full=False)
            self._counted(self._move, rid, target, fields, at)  # rule 6's full disk; errors counted
        except (sqlite3.Error, OSError) as exc:
            if len(self._unwritten) >= STATES_KEPT and rid not in self._unwritten:
                self._unwritten.pop(next(iter(self._unwritten)))
            self._unwritten.setdefault(rid, []).append((target, fields, at))
            log.warning("journal: %s's move to %s waits for its next write: %s", rid, target.value, exc)

    @contextmanager
    def _caught_up(self, rid: str) -> Iterator[sqlite3.Connection]:
        """A write's transaction for ``rid``, its noted moves that could not be written first,
        in order (rule 7). When the write fails they stay unwritten (in a group, its rollback
        puts them back)."""
        moves = self._unwritten.pop(rid, None)
        try:
            with self._transaction() as db:
                for target, fields, at in moves or ():
                    self._move_row(rid, target, fields, at)
                yield db
        except BaseException:
            if moves is not None:
                self._unwritten[rid] = moves
            raise

    def _move(self, rid: str, target: State, fields: dict[str, Any], at: float | None = None) -> None:
        self._make_room(keep=rid, need=_need(fields))
        with self._caught_up(rid):
            self._move_row(rid, target, fields, time.time() if at is None else at)
        self.writes += 1

    def _move_row(self, rid: str, target: State, fields: dict[str, Any], now: float) -> None:
        """One move's rows (inside a transaction), made at ``now``: checked against the
        lifecycle table first."""
        db = self._db_()
        if (current := self._states.get(rid)) is None:
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
            "INSERT INTO transitions (rid, t_s, from_state, to_state, route, attempt, reason) VALUES (?,?,?,?,?,?,?)",
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
        self._known(rid, target)

    def _update(self, rid: str, fields: dict[str, Any]) -> None:
        self._grow(_need(fields))
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._caught_up(rid) as db:
            db.execute(f"UPDATE requests SET {cols} WHERE id=?", (*fields.values(), rid))
        self.writes += 1

    def _service_event(self, t_s: float, service: str, event: str, reason: str) -> None:
        self._grow(0)
        with self._transaction() as db:
            db.execute(
                "INSERT INTO service_events (t_s, service, event, reason) VALUES (?, ?, ?, ?)",
                (t_s, service, event, reason),
            )
            db.execute(
                "DELETE FROM service_events WHERE seq <= (SELECT MAX(seq) FROM service_events) - ?",
                (SERVICE_EVENTS_KEPT,),
            )
        self.writes += 1

    def _service_events(self, limit: int) -> list[dict[str, Any]]:
        rows = (
            self._db_()
            .execute("SELECT t_s, service, event, reason FROM service_events ORDER BY seq DESC LIMIT ?", (limit,))
            .fetchall()
        )
        return [dict(zip(("t_s", "service", "event", "reason"), r, strict=True)) for r in reversed(rows)]

    def _one(self, column: str, value: str) -> JournalRecord | None:
        row = self._db_().execute(f"SELECT {COLS} FROM requests WHERE {column}=?", (value,)).fetchone()
        return record(row) if row else None

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
                f"SELECT {COLS} FROM requests WHERE state NOT IN ({TERMINAL_MARKS}) ORDER BY created_s",
                TERMINAL_VALUES,
            )
            .fetchall()
        )
        return [record(r) for r in rows]

    def _prune(self, now: float, keep: str | None = None, need: int = 0) -> int:
        """Delete expired finished requests, then shed the oldest finished ones while above
        the high-water mark, all in one transaction; then give free pages back, empty the WAL."""
        with self._transaction() as db:
            doomed = journal_bounds.expired(db, now, keep, retention_s=self.retention_s, max_requests=self.max_requests)
            journal_bounds.delete_requests(db, doomed)
            gone = len(doomed)
            if self._used_bytes() + need > self._bounds.high_water:
                gone += journal_bounds.shed_oldest(db, self._bounds, keep, need)
        self._rows -= gone
        journal_bounds.release_space(db, self._bounds)
        self._wal_bound = 0
        self._measure()
        return gone

    def _count(self) -> int:
        return int(self._db_().execute("SELECT COUNT(*) FROM requests").fetchone()[0])

    # -- async API -------------------------------------------------------------------
    def keeps(self, nbytes: int) -> bool:
        """Whether a body or an answer of ``nbytes`` can be stored: a move rewrites its row, and
        only the headroom above the high-water mark is sure to hold one (rule 4)."""
        return nbytes <= self._bounds.headroom

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
        queued: dict[str, Any] | None = None,
    ) -> None:
        """Durably record a new request as ACCEPTED; raises KeyConflict for a used key and
        JournalUnavailable when it cannot be written (nothing is then recorded). With
        ``queued`` (``attempts``, and ``route`` when known) it is moved on to QUEUED in the
        same transaction: both transitions, one write."""
        rec = {
            "queued": queued,
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

    def note_move(self, rid: str, target: State, **fields: Any) -> None:
        """Queue an intermediate move (ADMITTED, RUNNING) without waiting for it (rule 7):
        it commits with the next write that is waited for, or after about ``DEFER_S``, with
        the time of this call. Call it on the event loop."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        with self._pending_lock:
            self._pending.append(_Op(self._noted_move, (rid, target, fields, time.time()), None, loop))
        if self._tick_handle is None:
            self._tick_handle = loop.call_later(DEFER_S, self._tick)

    async def flush(self) -> None:
        """Wait until every write queued before this call (noted moves included) is done."""
        await self._write(_nothing)

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

    async def record_service_event(self, service: str, event: str, reason: str) -> None:
        """Journal a service's demotion or promotion (wall-clock ``t_s``; the newest
        ``SERVICE_EVENTS_KEPT`` are kept)."""
        await self._write(self._service_event, time.time(), service, event, reason)

    async def service_events(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest service events, oldest first."""
        return await self._run(self._service_events, limit)

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
        self._closed = True
        with suppress(JournalUnavailable):
            await self.flush()  # the noted moves (rule 7)
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None

        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(_close)
        self._thread.shutdown()
