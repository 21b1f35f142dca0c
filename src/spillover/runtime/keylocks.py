"""One Idempotency-Key, one execution at a time.

The key check ("is this key bound, to what, in which state?") and the action it leads to
(accept a new request, resume a resumable one, replay a stored answer) must be one atomic
step, or two concurrent requests with the same key both act. ``KeyLocks.hold(key)`` makes
them one: holders of the same key run one after the other; different keys never wait for
each other. Locks exist only while someone holds or waits for them (bounded by the
number of requests in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = ["KeyLockStatistics", "KeyLocks"]


@dataclass(frozen=True)
class KeyLockStatistics:
    """Frozen snapshot: keys held or waited for now, and how often a holder had to wait."""

    keys: int
    waits_total: int


class KeyLocks:
    """Per-key mutual exclusion for Idempotency-Keys (None: no lock at all)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self.waits_total = 0

    def __repr__(self) -> str:
        return f"<KeyLocks keys={len(self._locks)} waits={self.waits_total}>"

    @contextlib.asynccontextmanager
    async def hold(self, key: str | None) -> AsyncIterator[None]:
        """Hold ``key`` for the body of the ``async with``."""
        if key is None:
            yield
            return
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            if lock.locked():
                self.waits_total += 1
            async with lock:
                yield
        finally:
            lock_now, users_now = self._locks[key]
            if users_now <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock_now, users_now - 1)

    def statistics(self) -> KeyLockStatistics:
        return KeyLockStatistics(keys=len(self._locks), waits_total=self.waits_total)
