"""The ``sim`` accelerator: a device memory ledger shared by every process "on" the device.

The ledger is a JSON file guarded by an exclusive ``flock`` on a sibling lock file, so
workers, tenants, the gateway and fault-injection commands in separate processes all see
one truth. It fails an allocation exactly where a card of that capacity would.

Faults it supports (from any process):

- ``fail_next(n)``: the next n allocations fail;
- ``fail_running(n)``: the next n KV page growths of running requests fail (an OOM in
  the middle of generation);
- ``set_capacity(bytes)``: shrink or grow the card; live allocations stay;
- ``reset()``: a driver reset: every allocation is lost and ``epoch`` moves on, so the
  workers on the device notice and die;
- ``set_hang(True)``: kernels stop making progress until cleared.

Allocations of processes that no longer exist are reaped on every operation, as a real
driver frees a dead process's memory. An allocation records its process's start time, so a
pid the system gave to a new process does not keep a dead one's memory.

Every write also bumps a change counter: 8 bytes in a sibling ``.seq`` file that each
process maps into memory (``change_count``). A reader that polls (the gateway, 10 times a
second) reads it without a system call and reads the ledger again only when it moved: it
moves under the lock, after the new state is in place, so no write is missed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SimDevice", "SimSnapshot"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class SimSnapshot:
    """One consistent reading of the sim device."""

    name: str
    capacity_bytes: int
    used_bytes: int
    epoch: int
    hang: bool
    fail_next: int
    alloc_failures: int
    fail_running: int
    allocations: tuple[tuple[str, int, int, str], ...]  # (tag, pid, bytes, owner)

    def used_by_pid(self, pid: int) -> int:
        """Bytes held by one process."""
        return sum(b for _, p, b, _ in self.allocations if p == pid)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": max(0, self.capacity_bytes - self.used_bytes),
            "epoch": self.epoch,
            "hang": self.hang,
            "fail_next": self.fail_next,
            "alloc_failures": self.alloc_failures,
            "fail_running": self.fail_running,
            "allocations": [{"tag": t, "pid": p, "bytes": b, "owner": o} for t, p, b, o in self.allocations],
        }


def _presence(pid: int) -> tuple[bool, int | None]:
    """Whether process ``pid`` lives, and its start time (clock ticks after boot; None when
    unknown). A zombie still answers kill(0); it is gone (its memory is released). So is a
    thread-group leader that ended while its other threads run, which shows ``Z`` too: its
    thread count cannot tell it from a group still tearing its threads down after a kill (the
    CI's stopped worker killed with its gateway kept its memory that way), and no spillover
    process ends its main thread first. The state and the fields after it follow the command's
    last parenthesis (a command may hold one)."""
    if pid <= 0:
        return False, None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, None
    except PermissionError:  # another user's process: it lives; its /proc/<pid>/stat is readable all the same
        pass
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)  # no file object: read 10 times a second
        try:
            stat = os.read(fd, 1024)
        finally:
            os.close(fd)
    except OSError:
        return True, None
    fields = stat.rpartition(b")")[2].split()  # fields 3.. of proc(5): state is [0], starttime [19]
    try:
        start: int | None = int(fields[19])
    except (IndexError, ValueError):
        start = None
    return fields[:1] != [b"Z"], start


def _gone(alloc: dict[str, Any], presence: tuple[bool, int | None]) -> bool:
    """Whether ``alloc``'s process has exited: it is not alive, or its pid now names another
    process (a start time other than the one recorded when it allocated: the pid was reused)."""
    alive, start = presence
    recorded = alloc.get("start")
    return not alive or (recorded is not None and start is not None and int(recorded) != start)


class SimDevice:
    """Handle on one sim device ledger file; cheap to create, safe across processes."""

    # A reader polling ``change_count`` still reads the ledger in full at least this often:
    # that reaps processes that died, and covers a counter file removed and made again.
    FULL_READ_S = 1.0

    def __init__(self, state_dir: str | Path, name: str = "sim0") -> None:
        self.name = name
        self.dir = Path(state_dir)
        self.path = self.dir / f"{name}.ledger.json"
        self.lock_path = self.dir / f"{name}.ledger.lock"
        self.seq_path = self.dir / f"{name}.ledger.seq"
        self._seq: mmap.mmap | None = None

    def __repr__(self) -> str:
        return f"<SimDevice {self.name} at {self.path}>"

    # -- file plumbing -------------------------------------------------------------
    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        """The ledger's lock file, held exclusively (the folder is made only when missing:
        the gateway reads the ledger 10 times a second)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC  # a descriptor, no file object
        try:
            fd = os.open(self.lock_path, flags, 0o666)
        except FileNotFoundError:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, flags, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The state to change under the lock; written back when it changed."""
        with self._flocked():
            state = self._read()
            before = json.dumps(state, sort_keys=True)
            self._reap(state)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                self._write(state)

    def _read(self) -> dict[str, Any]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)  # a descriptor, no file object
        except FileNotFoundError:
            return {
                "capacity": 0,
                "epoch": 0,
                "hang": False,
                "fail_next": 0,
                "alloc_failures": 0,
                "allocs": {},
            }
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
        data: dict[str, Any] = json.loads(b"".join(chunks))
        return data

    def _write(self, state: dict[str, Any]) -> None:
        seq = self._seq_map()  # mapped first: a write that cannot count itself does not happen
        data = json.dumps(state).encode()
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._write_in_place(data)
        struct.pack_into("<Q", seq, 0, struct.unpack_from("<Q", seq, 0)[0] + 1)  # under the lock, once in place

    def _write_in_place(self, data: bytes) -> None:
        """A full disk (round 49b: the ledger's next copy could not be made, the GPU worker's
        free raised, its request never ended and the worker was killed as hung): the new
        state over the ledger's own blocks, padded with spaces to the old length (JSON reads
        them as nothing), so no cut is needed and a process killed after the write leaves a
        whole ledger. A state that needs more than the file's blocks already hold stays the
        full disk's error (a write past them could stop halfway). Every reader takes the
        lock, so none sees it half written; a filesystem that copies on write may refuse this
        too."""
        fd = os.open(self.path, os.O_WRONLY)
        try:
            st = os.fstat(fd)
            if len(data) > st.st_blocks * 512:
                raise OSError(errno.ENOSPC, f"No space left on device for the sim ledger {self.path}")
            padded = data + b" " * max(0, st.st_size - len(data))
            if os.pwrite(fd, padded, 0) != len(padded):
                raise OSError(errno.ENOSPC, f"the sim ledger {self.path} was written in part")
        finally:
            os.close(fd)

    def _seq_map(self) -> mmap.mmap:
        """The change counter's file, mapped (made on first use, kept for the process)."""
        if self._seq is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.seq_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < 8:
                    os.ftruncate(fd, 8)  # zeros; a racing process's truncate to 8 changes nothing
                self._seq = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
        return self._seq

    def change_count(self) -> int:
        """How many times the ledger was written, from the mapped counter: no lock, no
        system call. Equal counts mean an equal ledger, except for allocations of processes
        that died since (reaped by the next operation or full reading)."""
        return int(struct.unpack_from("<Q", self._seq_map(), 0)[0])

    @staticmethod
    def _reap(state: dict[str, Any]) -> bool:
        """Drop the allocations of processes that are gone; True when it dropped any."""
        allocs = state["allocs"]
        presence = {pid: _presence(pid) for pid in {int(a["pid"]) for a in allocs.values()}}  # each process once
        dead = [k for k, a in allocs.items() if _gone(a, presence[int(a["pid"])])]
        for key in dead:
            del allocs[key]
        return bool(dead)

    # -- operations ----------------------------------------------------------------
    def create(self, capacity_bytes: int, *, keep_allocations: bool = False) -> None:
        """(Re)initialise the device with a capacity; clears faults."""
        with self._locked() as s:
            s["capacity"] = int(capacity_bytes)
            s["hang"] = False
            s["fail_next"] = 0
            s["fail_running"] = 0
            if not keep_allocations:
                s["allocs"] = {}
                s["epoch"] = int(s["epoch"]) + 1

    def allocate(self, tag: str, nbytes: int, owner: str, pid: int | None = None) -> bool:
        """Charge ``nbytes`` under ``tag``; False (and a counted failure) if it does not fit."""
        pid = os.getpid() if pid is None else pid
        key = f"{pid}:{tag}"
        with self._locked() as s:
            if key in s["allocs"]:
                raise KeyError(f"allocation {key} exists")
            used = sum(int(a["bytes"]) for a in s["allocs"].values())
            if s["fail_next"] > 0:
                s["fail_next"] -= 1
                s["alloc_failures"] += 1
                return False
            if used + nbytes > int(s["capacity"]):
                s["alloc_failures"] += 1
                return False
            s["allocs"][key] = {"pid": pid, "bytes": int(nbytes), "owner": owner, "start": _presence(pid)[1]}
            return True

    def free(self, tag: str, pid: int | None = None) -> bool:
        """Release one allocation; False when it was already gone (reset, reaped)."""
        pid = os.getpid() if pid is None else pid
        with self._locked() as s:
            return s["allocs"].pop(f"{pid}:{tag}", None) is not None

    def free_pid(self, pid: int) -> int:
        """Release everything a process holds; returns the bytes freed."""
        with self._locked() as s:
            keys = [k for k, a in s["allocs"].items() if int(a["pid"]) == pid]
            freed = sum(int(s["allocs"][k]["bytes"]) for k in keys)
            for k in keys:
                del s["allocs"][k]
            return freed

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the capacity; allocations already made stay."""
        with self._locked() as s:
            s["capacity"] = int(capacity_bytes)

    def fail_next(self, n: int) -> None:
        """Make the next ``n`` allocations fail."""
        with self._locked() as s:
            s["fail_next"] = int(n)

    def fail_running(self, n: int) -> None:
        """Make the next ``n`` KV page growths of running requests fail (OOM mid-generation)."""
        with self._locked() as s:
            s["fail_running"] = int(n)

    def take_running_fault(self) -> bool:
        """Consume one armed running-OOM fault; True when this caller hit it."""
        with self._locked() as s:
            if int(s.get("fail_running", 0)) <= 0:
                return False
            s["fail_running"] = int(s["fail_running"]) - 1
            s["alloc_failures"] += 1
            return True

    def set_hang(self, hang: bool) -> None:
        """Stop (or resume) kernel progress on the device."""
        with self._locked() as s:
            s["hang"] = bool(hang)

    def reset(self) -> None:
        """Driver reset: every allocation is lost; workers see the new epoch and die."""
        with self._locked() as s:
            s["allocs"] = {}
            s["epoch"] = int(s["epoch"]) + 1
            s["hang"] = False

    @contextlib.contextmanager
    def _reading(self) -> Iterator[dict[str, Any]]:
        """``_locked`` for a reading: the state is written back only when reaping a dead
        process changed it (no before/after comparison: the gateway reads 10 times a second)."""
        with self._flocked():
            state = self._read()
            if self._reap(state):
                self._write(state)
            yield state

    def snapshot(self) -> SimSnapshot:
        """A consistent reading of the whole device."""
        with self._reading() as s:
            allocs = tuple(
                sorted(
                    (k.split(":", 1)[1], int(a["pid"]), int(a["bytes"]), str(a["owner"]))
                    for k, a in s["allocs"].items()
                )
            )
            return SimSnapshot(
                name=self.name,
                capacity_bytes=int(s["capacity"]),
                used_bytes=sum(b for _, _, b, _ in allocs),
                epoch=int(s["epoch"]),
                hang=bool(s["hang"]),
                fail_next=int(s["fail_next"]),
                alloc_failures=int(s["alloc_failures"]),
                fail_running=int(s.get("fail_running", 0)),
                allocations=allocs,
            )
