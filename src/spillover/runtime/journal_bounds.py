"""The request journal's bounds on disk: rules 2, 3 and 6 of ``runtime.journal``.

Owns the size arithmetic (``SizeBounds``: high- and low-water marks, the WAL allowance, the
database file's page cap, the headroom for one row's rewrite), the pragmas that make SQLite
enforce it, retention (which finished requests go: by age, by count, then oldest first by
bytes), giving free pages back, and the injected full disk. Every function runs on the
journal's thread, inside or around the transaction ``Journal`` opens; none commits.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from spillover.runtime.journal_records import TERMINAL_MARKS, TERMINAL_VALUES

__all__ = [
    "HIGH_WATER_RATIO",
    "LOW_WATER_RATIO",
    "MIN_MAX_BYTES",
    "SizeBounds",
    "cap_pages",
    "check_disk_full",
    "check_same_files",
    "configure",
    "delete_requests",
    "disk_full_marker",
    "expired",
    "file_identities",
    "release_space",
    "set_disk_full",
    "shed_oldest",
    "used_bytes",
]

HIGH_WATER_RATIO = 0.8  # past this share of max_bytes, pruning sheds the oldest finished
LOW_WATER_RATIO = 0.6  # ...until this share
MIN_MAX_BYTES = 256 * 1024  # the schema alone takes ~12 pages
_SHED_BATCH = 256  # finished rows looked at per byte-shedding round
_DELETE_CHUNK = 500  # ids per DELETE statement (SQLite's host-parameter limit)
_ROW_BYTES = (  # a finished row's payload, estimated (+ page overhead)
    "length(CAST(body AS BLOB)) + coalesce(length(CAST(response AS BLOB)), 0)"
    " + coalesce(length(CAST(headers AS BLOB)), 0) + coalesce(length(CAST(error AS BLOB)), 0) + 256"
)
_FINISHED = f"state IN ({TERMINAL_MARKS}) AND id IS NOT ?"  # finished, bar the one being written


@dataclass(frozen=True)
class SizeBounds:
    """What ``max_bytes`` means for a database of ``page_size`` pages (rule 3)."""

    max_bytes: int
    page_size: int = 4096

    def __post_init__(self) -> None:
        if self.max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"journal max_bytes must be >= {MIN_MAX_BYTES}, got {self.max_bytes}")

    @property
    def high_water(self) -> int:
        return int(self.max_bytes * HIGH_WATER_RATIO)

    @property
    def low_water(self) -> int:
        return int(self.max_bytes * LOW_WATER_RATIO)

    @property
    def wal_pages(self) -> int:
        """WAL pages between checkpoints: 1/32 of the bound, 8 to 1000 (SQLite's default)."""
        return min(1000, max(8, self.max_bytes // self.page_size // 32))

    @property
    def file_pages(self) -> int:
        """The database file's cap: the bound minus the WAL allowance."""
        return self.max_bytes // self.page_size - 2 * self.wal_pages

    @property
    def headroom(self) -> int:
        """Bytes between the high-water mark and the file's cap: room for one row's rewrite."""
        return self.file_pages * self.page_size - self.high_water


def configure(db: sqlite3.Connection, max_bytes: int) -> SizeBounds:
    """Set the pragmas that bound a freshly opened journal: incremental auto-vacuum (a file
    from before is converted once), WAL with its checkpoint interval and size limit, and the
    file's page cap. Returns the bounds for the database's page size."""
    fresh = db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    if fresh:  # only possible before the first table exists
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # a file from before: convert once
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("VACUUM")
    bounds = SizeBounds(max_bytes, int(db.execute("PRAGMA page_size").fetchone()[0]))
    db.execute(f"PRAGMA wal_autocheckpoint={bounds.wal_pages}")
    db.execute(f"PRAGMA journal_size_limit={2 * bounds.wal_pages * bounds.page_size}")
    cap_pages(db, bounds)
    return bounds


def cap_pages(db: sqlite3.Connection, bounds: SizeBounds) -> None:
    """Cap the database file (SQLite never caps it below its current size)."""
    db.execute(f"PRAGMA max_page_count={bounds.file_pages}").fetchall()


def used_bytes(db: sqlite3.Connection, page_size: int) -> int:
    """Pages in use (not free) times the page size; the WAL is not counted."""
    pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
    return int(pages) * page_size


def expired(
    db: sqlite3.Connection, now: float, keep: str | None, *, retention_s: float, max_requests: int
) -> list[str]:
    """Finished requests past the retention age, then the oldest beyond ``max_requests``."""
    old = [
        r[0]
        for r in db.execute(
            f"SELECT id FROM requests WHERE {_FINISHED} AND finished_s < ?",
            (*TERMINAL_VALUES, keep, now - retention_s),
        ).fetchall()
    ]
    total = db.execute(f"SELECT COUNT(*) FROM requests WHERE {_FINISHED}", (*TERMINAL_VALUES, keep)).fetchone()[0]
    over = max(0, total - len(old) - max_requests)
    if over:
        doomed = set(old)
        oldest = db.execute(
            f"SELECT id FROM requests WHERE {_FINISHED} ORDER BY finished_s LIMIT ?",
            (*TERMINAL_VALUES, keep, over + len(old)),
        ).fetchall()
        old += [r[0] for r in oldest if r[0] not in doomed][:over]
    return old


def shed_oldest(db: sqlite3.Connection, bounds: SizeBounds, keep: str | None, need: int) -> int:
    """Delete the oldest finished requests until the used bytes plus ``need`` reach the
    low-water mark (or none is left). Returns how many went."""
    gone = 0
    while (excess := used_bytes(db, bounds.page_size) + need - bounds.low_water) > 0:
        rows = db.execute(
            f"SELECT id, {_ROW_BYTES} FROM requests WHERE {_FINISHED} ORDER BY finished_s LIMIT ?",
            (*TERMINAL_VALUES, keep, _SHED_BATCH),
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
        delete_requests(db, batch)
        gone += len(batch)
    return gone


def delete_requests(db: sqlite3.Connection, rids: list[str]) -> None:
    """Delete these requests' rows and their transitions."""
    for i in range(0, len(rids), _DELETE_CHUNK):
        chunk = rids[i : i + _DELETE_CHUNK]
        q = ",".join("?" * len(chunk))
        db.execute(f"DELETE FROM transitions WHERE rid IN ({q})", chunk)
        db.execute(f"DELETE FROM requests WHERE id IN ({q})", chunk)


def release_space(db: sqlite3.Connection, bounds: SizeBounds) -> None:
    """After a prune's commit: free pages (deleted rows, rewritten ones) go back to the file
    system, the WAL is emptied, and a file opened above the bound may be capped lower now."""
    # executescript steps each pragma to its end (execute frees one page only).
    db.executescript("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")
    cap_pages(db, bounds)


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


def file_identities(path: Path) -> dict[str, tuple[int, int]]:
    """The journal's files as opened (the database, its WAL): each one's device and inode.
    SQLite keeps the WAL beside the database's real file when its path is a symbolic link."""
    found = {}
    for name in (str(path), f"{os.path.realpath(path)}-wal"):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(name)
            found[name] = (st.st_dev, st.st_ino)
    return found


def check_same_files(identities: dict[str, tuple[int, int]]) -> None:
    """Fail as a lost file does (ENOENT) when a journal file was removed or replaced since it
    was opened: SQLite goes on writing into the removed file, and nothing written there is
    found after a restart (round 49b: requests answered 200 with no durable record, and their
    Idempotency-Keys ran again after the restart)."""
    for name, identity in identities.items():
        try:
            st = os.stat(name)
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != identity:
            raise OSError(
                errno.ENOENT,
                f"the journal file {name} was removed or replaced while the gateway ran; what would"
                " be written now could not be found again: restart the gateway",
            )


def check_disk_full(marker: Path | str) -> None:
    """Fail as a full disk does (ENOSPC) while the injection ``marker`` exists."""
    if os.path.exists(marker):  # not Path.exists: once per journal write
        raise OSError(errno.ENOSPC, f"No space left on device (injected: {marker})")
