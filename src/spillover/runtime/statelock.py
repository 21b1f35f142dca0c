"""One gateway per state folder: an exclusive lock on ``<state_dir>/gateway.lock``.

Two gateways on one folder would wreck each other: the second resets the sim device
(the first one's GPU worker dies with ``device_lost``) and replays the first one's running
requests from the shared journal. So the folder is locked before anything touches it.

Rules:

1. The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``gateway.lock``. Taking it never waits: a
   folder held by another process raises ``StateDirBusy`` at once, naming the folder and
   the holder's pid.
2. The file's text is the holder's pid, for that message only. The kernel's lock is the
   truth: the lock goes with its holder (``kill -9`` included), so a stale file never
   blocks a restart. The file itself is never deleted (deleting a lock file races).
3. Workers never inherit the descriptor (Python opens it non-inheritable), so a worker
   that outlives a killed gateway does not keep the folder locked.
4. Within one process the lock is counted: ``spillover serve`` takes it before anything
   starts and the gateway takes it again while it runs; the last ``release`` unlocks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from spillover.errors import ConfigError

__all__ = ["LOCK_NAME", "StateDirBusy", "StateLock", "acquire"]

LOCK_NAME = "gateway.lock"


class StateDirBusy(ConfigError):
    """Another process holds the state folder's lock (a second gateway on one folder)."""

    code = "state_dir_busy"

    def __init__(self, state_dir: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "a process whose pid is not recorded yet"
        super().__init__(
            f"state dir {state_dir} is in use by another spillover gateway ({holder}; lock file "
            f"{state_dir / LOCK_NAME}): stop that gateway or choose another --state-dir"
        )
        self.state_dir = state_dir
        self.pid = pid


class StateLock:
    """This process's hold on one state folder (see the module rules)."""

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd: int | None = fd
        self._holds = 1

    def __repr__(self) -> str:
        return f"<StateLock {self.state_dir} holds={self._holds}>"

    @property
    def held(self) -> bool:
        """Whether this process still holds the lock."""
        return self._fd is not None

    def retain(self) -> None:
        """Add one hold (the lock must still be held)."""
        if self._fd is None:
            raise RuntimeError(f"{self!r} was released")
        self._holds += 1

    def release(self) -> None:
        """Drop one hold; the last one unlocks (no-op once unlocked)."""
        if self._fd is None:
            return
        self._holds -= 1
        if self._holds > 0:
            return
        fd, self._fd = self._fd, None
        _HELD.pop(self.state_dir, None)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor drops the flock


_HELD: dict[Path, StateLock] = {}


def _holder_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    return None


def acquire(state_dir: Path) -> StateLock:
    """Lock ``state_dir`` (created if missing) for this process, or raise ``StateDirBusy``."""
    state_dir = state_dir.resolve()
    mine = _HELD.get(state_dir)
    if mine is not None and mine.held:
        mine.retain()
        return mine
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder_pid(fd)
        os.close(fd)
        raise StateDirBusy(state_dir, pid) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    lock = StateLock(state_dir, fd)
    _HELD[state_dir] = lock
    return lock
