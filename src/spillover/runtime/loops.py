"""The owner of every gateway task: one ``asyncio.TaskGroup``.

Rules:

1. A *loop* (a supervisor, the scheduler, the observers, the journal's) runs for the
   gateway's whole life. One that raises or returns is logged with its traceback, counted,
   and restarted after a capped, doubling back-off.
2. A loop that fails ``max_failures`` times within ``window_s`` cannot be trusted to keep
   its promise (a dead supervisor keeps a worker dead): it takes the gateway down, loudly.
   The group's task group is cancelled, ``fatal`` says why, and ``on_fatal`` is called
   (the gateway stops the server and exits non-zero).
3. A *one-off* task (a recovered request's replay) belongs to the same group. Its failure
   is logged and counted, never fatal.
4. ``stop()`` cancels the group and waits for every task to unwind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["LoopFailed", "LoopGroup", "LoopStatistics"]

log = logging.getLogger("spillover.loops")


class LoopFailed(Exception):
    """A loop failed too often (rule 2)."""


@dataclass(frozen=True)
class LoopStatistics:
    loops: tuple[str, ...]
    restarts: dict[str, int]
    tasks_failed: int
    fatal: str | None


class LoopGroup:
    """Runs loops and one-off tasks under one TaskGroup (the rules above)."""

    def __init__(
        self,
        *,
        on_fatal: Callable[[str], None],
        restart_s: float = 0.5,
        restart_max_s: float = 30.0,
        max_failures: int = 10,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_fatal = on_fatal
        self.restart_s = restart_s
        self.restart_max_s = restart_max_s
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self.restarts: dict[str, int] = {}
        self.tasks_failed = 0
        self.fatal: str | None = None
        self._loops: dict[str, Callable[[], Awaitable[None]]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._main: asyncio.Task[None] | None = None
        self._running = asyncio.Event()

    def __repr__(self) -> str:
        return f"<LoopGroup loops={len(self._loops)} restarts={sum(self.restarts.values())} fatal={self.fatal!r}>"

    def statistics(self) -> LoopStatistics:
        return LoopStatistics(tuple(self._loops), dict(self.restarts), self.tasks_failed, self.fatal)

    def add(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """A loop to run once the group starts (rule 1)."""
        assert self._main is None, "loops are added before start()"
        self._loops[name] = loop

    async def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name="gateway-loops")
        await self._running.wait()

    def spawn(self, name: str, work: Awaitable[None]) -> None:
        """A one-off task in the group (rule 3)."""
        if self._tg is None:
            raise RuntimeError("the loop group is not running")

        async def run() -> None:
            try:
                await work
            except Exception:
                self.tasks_failed += 1
                log.exception("gateway task %s failed", name)

        self._tg.create_task(run(), name=name)

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for name, loop in self._loops.items():
                    tg.create_task(self._keep(name, loop), name=name)
                self._running.set()
        except* LoopFailed as eg:
            self.fatal = str(eg.exceptions[0])
            log.critical("%s: the gateway goes down", self.fatal)
            self.on_fatal(self.fatal)
        finally:
            self._tg = None
            self._running.set()

    async def _keep(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Rules 1 and 2 for one loop."""
        delay = self.restart_s
        failures: deque[float] = deque()
        while True:
            try:
                await loop()
                log.error("gateway loop %s returned; restarting it in %.1fs", name, delay)
            except Exception:
                log.exception("gateway loop %s failed; restarting it in %.1fs", name, delay)
            now = self.clock()
            failures.append(now)
            while failures and now - failures[0] > self.window_s:
                failures.popleft()
            if len(failures) >= self.max_failures:
                raise LoopFailed(f"gateway loop {name} failed {len(failures)} times in {self.window_s:.0f}s")
            self.restarts[name] = self.restarts.get(name, 0) + 1
            await asyncio.sleep(delay)
            delay = min(self.restart_max_s, delay * 2)

    async def stop(self) -> None:
        """Rule 4."""
        main = self._main
        if main is None:
            return
        main.cancel()
        try:
            await main
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
