"""The supervisor: start a worker, watch its health, restart it with capped back-off.

Rules:

1. A worker that dies is restarted after ``backoff`` seconds; the back-off doubles on each
   death up to ``restart_backoff_max_s`` and resets after 30 s of healthy running.
2. Before reloading a GPU worker it waits (bounded by ``release_wait_s``) until the device
   shows the dead process's memory released; meanwhile its worker's ``waiting`` (in
   ``/v1/status``) says so.
3. A worker whose pings go unanswered for ``health_timeout_s`` is killed (then restarted).
   The time the gateway's own loop ran late (a machine whose cores something else holds)
   is not counted against the worker, and what its pipe already holds is read before the
   verdict: a starved gateway never kills a worker whose pong waits unread.
4. Nothing here touches another worker or lane.
5. The loop never ends by accident: an exception in one round (a device that cannot be
   read, a spawn that raises) is logged with its traceback and the round is retried after
   the capped back-off. Only ``stop()`` or cancellation ends it. A device reading that
   fails while waiting for release counts as "not released yet" (rule 2's bound holds).
6. A start may wait for a condition given by the owner (``before_start``): a GPU worker's
   load is a device reservation, and it is not attempted before its weights fit. The owner
   says what it waits for in the worker's ``waiting`` (``Gateway.reserve_weights``).
7. The owner may park a worker (``park``: it is stopped, its memory given back, and not
   restarted) and resume it later (``resume``): a demoted batch service's GPU worker.
8. A start that fails (a model the worker cannot load, or an engine that aborts loading it) is
   kept as ``start_failure`` until a start succeeds: the owner can answer at once instead of
   queueing for a worker that keeps failing the same way (``cannot_start``: every model and
   service, chat included), and ``/v1/status`` shows it. It is kept before the worker's death
   is told (the owner's pass on that event already sees it), the attempt after it counts as a
   restart, and its Retry-After is that attempt's time (while a retry runs, the time of the
   one after it, should the retry fail as the last start did).
9. Each successful start's length is kept (``start_took_s``): how soon a dead worker is expected
   back (``back_in_s``: its back-off's rest, then a start as long as its last) tells a client
   refused meanwhile when to come back (round 65: a refusal while the device restarted in 2 s
   said 16 s, the CPU lane's queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from spillover.config import SupervisorConfig
from spillover.errors import NoWorkerReady
from spillover.runtime import ticks
from spillover.runtime.devices import GpuDevice
from spillover.runtime.events import SupervisorEvent, SupervisorEventKind
from spillover.runtime.worker_client import WorkerClient, WorkerGone, WorkerSpec, WorkerState

K = SupervisorEventKind

__all__ = ["Supervisor", "cannot_start"]

log = logging.getLogger("spillover.supervisor")
HEALTHY_RESET_S = 30.0


# A worker that ran is taken to come back through this many failed restarts in a row (killed
# again while it restarted), no more (its model may no longer load): the device ledger keeps its
# room that long (``Gateway.worker_event``), and the host guard its memory (``HostMemory``).
COMING_BACK_FAILED_STARTS = 3


def cannot_start(what: str, supervisors: Iterable[Supervisor]) -> NoWorkerReady | None:
    """Rule 8: the refusal for a request to ``what`` (a service, a chat model) while none of
    its workers is ready and every one that may run (not parked) failed its last start, naming
    each failure, Retry-After the soonest next attempt; None otherwise."""
    sups = [s for s in supervisors if not s.parked]
    if not sups or any(s.worker.state is WorkerState.READY or s.start_failure is None for s in sups):
        return None
    why = "; ".join(f"{s.worker.spec.lane} worker: {s.start_failure}" for s in sups)
    return NoWorkerReady(
        f"{what} has no worker that can start ({why})",
        retry_after_s=max(1.0, min(s.next_start_s for s in sups) - time.monotonic()),
        code="model_load_failed",
    )


def back_in_s(supervisors: Iterable[Supervisor], now: float) -> float:
    """Rule 9: how soon one of ``supervisors``' workers is expected ready, from ``now``
    (monotonic): 0 when one is; one starting, what is left of a start as long as its last;
    one waiting out its back-off (or about to: the back-off it will sleep), that wait and then
    such a start. Infinity when none is expected: no start measured yet, parked, stopped, its
    last start failed (rule 8 answers for those), waiting for the device's memory (rules 2 and
    6: no telling how long), or a start already longer than its last (round 66: it read 0)."""
    soonest = math.inf
    for s in supervisors:
        if s.worker.state is WorkerState.READY:
            return 0.0
        took = s.start_took_s
        if took is None or not s.restarting or s.start_failure is not None or s.worker.waiting:
            continue
        if s.starting:
            left = s.start_began_s + took - now
            if left < 0:
                continue
        else:  # next_start_s from before this life's start: its back-off is not set yet
            backoff_ends = s.next_start_s if s.next_start_s > s.start_began_s else now + s.backoff_s
            left = max(0.0, backoff_ends - now) + took
        soonest = min(soonest, left)
    return soonest


class Supervisor:
    """Keeps one worker running."""

    def __init__(
        self,
        spec: WorkerSpec,
        cfg: SupervisorConfig,
        *,
        device: GpuDevice | None = None,
        on_change: Callable[[WorkerClient, SupervisorEvent], None] = lambda w, e: None,
        before_start: Callable[[WorkerClient], Awaitable[None]] | None = None,
    ) -> None:
        self.cfg = cfg
        self._before_start = before_start
        self.device = device
        self._on_change = on_change
        self._exited = asyncio.Event()
        self.worker = WorkerClient(spec, self._worker_exited)
        self.restarts = 0
        self.backoff_s = cfg.restart_backoff_initial_s
        self.events: list[tuple[float, str]] = []
        self.errors = 0  # supervisor rounds that raised (rule 5)
        self.start_failure: str | None = None  # rule 8
        # When the next start comes (monotonic; rule 8's Retry-After): the back-off's end; while
        # a retry runs, when the one after it would come should it fail as the last one did.
        self.next_start_s = 0.0
        self._failed_start_s = 0.0  # how long the last failed start took to fail
        self.failed_starts = 0  # starts that failed since the worker was last ready
        self._starting = False  # a start is under way: its worker's death is a failed start
        self.start_began_s = 0.0  # when the last start began (monotonic)
        self.start_took_s: float | None = None  # how long the last successful start took (rule 9)
        self._stopping = False
        self._may_run = asyncio.Event()  # cleared while parked (rule 7)
        self._may_run.set()

    def __repr__(self) -> str:
        return f"<Supervisor {self.worker.spec.worker_id} restarts={self.restarts}>"

    def status_row(self) -> dict[str, Any]:
        """Its worker's line in /v1/status: the worker's statistics and its restarts."""
        return dataclasses.asdict(self.worker.statistics()) | {
            "restarts": self.restarts,
            "start_failure": self.start_failure,
        }

    def _event(self, kind: SupervisorEventKind, detail: str = "") -> None:
        ev = SupervisorEvent(kind, detail)
        self.events.append((time.monotonic(), str(ev)))
        del self.events[:-50]
        log.info("worker %s: %s", self.worker.spec.worker_id, ev)
        try:
            self._on_change(self.worker, ev)
        except Exception:  # the listener's bug must not end supervision (rule 5)
            log.exception("worker %s: listener failed on %s", self.worker.spec.worker_id, ev)

    @property
    def parked(self) -> bool:
        return not self._may_run.is_set()

    @property
    def starting(self) -> bool:
        """A start is under way (spawned, loading)."""
        return self._starting

    @property
    def coming_back(self) -> bool:
        """Its worker, down, is taken to come back: it restarts, and fewer than
        ``COMING_BACK_FAILED_STARTS`` of its starts in a row failed (a restart killed once is
        still coming back; one whose model no longer loads is not)."""
        return self.restarting and self.failed_starts < COMING_BACK_FAILED_STARTS

    @property
    def restarting(self) -> bool:
        """Its worker is down (dead, backing off or loading again) and will be started again:
        not stopped for good, not parked. (True while it first starts too: it held nothing yet.)"""
        return not self._stopping and not self.parked and self.worker.state is not WorkerState.READY

    async def park(self, why: str) -> None:
        """Rule 7: stop the worker (its device memory is given back) and do not restart it
        until ``resume()``."""
        if self.parked:
            return
        self._may_run.clear()
        self._event(K.PARKED, why)
        await self._end_worker()

    def resume(self, why: str) -> None:
        """Rule 7: start the worker again (through ``before_start``, as any start)."""
        if self.parked:
            self._event(K.RESUMED, why)
            self._may_run.set()

    def _worker_exited(self, worker: WorkerClient, gone: WorkerGone) -> None:
        self._exited.set()
        if self._starting:  # rule 8: kept before the death is told (``start`` raises this text)
            self.start_failure = f"{gone.kind}: {gone.message}"
            self.next_start_s = time.monotonic() + self.backoff_s  # the back-off that follows
        if not self._stopping and not self.parked:
            self._event(K.DIED, f"{gone.kind}: {gone.message}")
        elif self.parked:
            self._event(K.UNLOADED, f"{gone.kind}: {gone.message}")

    async def run(self) -> None:
        """Start, watch and restart the worker until stopped or cancelled (rule 5)."""
        while not self._stopping:
            try:
                await self._run_once()
            except Exception as exc:  # a bug or a broken device: log it, keep supervising
                self.errors += 1
                log.exception("worker %s: supervisor round failed", self.worker.spec.worker_id)
                self._event(K.SUPERVISOR_ERROR, f"{type(exc).__name__}: {exc}")
                if self._stopping:
                    return
                await self._end_worker()  # the round's state is unknown: start from a dead worker
                await self._sleep_backoff(0.0)

    async def _end_worker(self) -> None:
        """Kill the worker if it runs and wait (bounded) for its exit event."""
        if self.worker.state in (WorkerState.READY, WorkerState.STARTING) and self.worker.pid is not None:
            await self.worker.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exited.wait(), self.cfg.health_timeout_s)

    async def _run_once(self) -> None:
        """One life of the worker: wait for the device, start, watch until it exits, back off."""
        await self._may_run.wait()
        self._exited.clear()
        pid_before = self.worker.pid
        if pid_before is not None and self.device is not None:
            await self._wait_released(pid_before)
        if self._before_start is not None:  # e.g. the load's device memory must fit first (rule 6)
            await self._before_start(self.worker)
        began = self.start_began_s = time.monotonic()
        if self.start_failure is not None:  # a retry: refusals meanwhile name the try after it
            self.next_start_s = began + self._failed_start_s + self.backoff_s
        try:
            self._event(K.STARTING)
            self._starting = True
            try:
                info = await self.worker.start(self.cfg.load_timeout_s)
            finally:
                self._starting = False
            self.start_failure = None
            self.failed_starts = 0
            self.start_took_s = time.monotonic() - began
            self._event(K.READY, f"pid={info.get('pid')}")
        except Exception as exc:
            self.start_failure = str(exc) or type(exc).__name__
            self.failed_starts += 1
            self._failed_start_s = time.monotonic() - began
            self.next_start_s = time.monotonic() + self.backoff_s  # the back-off below
            self._event(K.START_FAILED, self.start_failure)
            await self.worker.kill()  # a no-op when no process was spawned (or it is gone)
            with contextlib.suppress(TimeoutError):  # bounded: nothing may have been spawned
                await asyncio.wait_for(self._exited.wait(), self.cfg.health_timeout_s)
            self.restarts += 1  # the next attempt is a restart too (an operator alerts on them)
            await self._sleep_backoff(0.0)
            return
        up_since = time.monotonic()
        health = asyncio.create_task(self._health_loop(), name="health")
        try:
            await self._exited.wait()
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
        if self._stopping or self.parked:
            return
        self.restarts += 1
        await self._sleep_backoff(time.monotonic() - up_since)

    async def _sleep_backoff(self, up_for_s: float) -> None:
        if up_for_s >= HEALTHY_RESET_S:
            self.backoff_s = self.cfg.restart_backoff_initial_s
        delay = self.backoff_s
        self.backoff_s = min(self.cfg.restart_backoff_max_s, self.backoff_s * 2)
        self.next_start_s = time.monotonic() + delay
        self._event(K.RESTARTING, f"in {delay:.2f}s")
        await asyncio.sleep(delay)

    async def _wait_released(self, pid: int) -> None:
        assert self.device is not None
        deadline = time.monotonic() + self.cfg.release_wait_s
        failure: Exception | None = None
        try:
            while time.monotonic() < deadline:
                try:
                    held = await asyncio.to_thread(self.device.held_by, pid)
                except Exception as exc:  # unknown counts as not released (rule 5)
                    if failure is None:
                        log.warning("worker %s: cannot read the device: %r", self.worker.spec.worker_id, exc)
                    failure = exc
                else:
                    if held == 0:
                        return
                self.worker.waiting = f"the device to release the memory of its last process (pid {pid})"
                await asyncio.sleep(0.05)
        finally:
            self.worker.waiting = None  # released, given up on, or the supervisor stops
        why = f" (device unreadable: {failure!r})" if failure is not None else ""
        self._event(K.NOT_RELEASED, f"device memory of pid {pid} not released after {self.cfg.release_wait_s}s{why}")

    async def _health_loop(self) -> None:
        """Rule 3: ping every ``health_interval_s``; kill the worker once its pong is older
        than ``health_timeout_s``, less the time this loop itself woke late since then."""
        w = self.worker
        pong_s, late_s = w.last_pong_s, 0.0  # the gateway's own lateness since the last pong
        while w.state is WorkerState.READY:
            try:
                await w.ping()
            except Exception:  # an unanswered ping is what the pong age below detects
                log.exception("worker %s: ping failed", w.spec.worker_id)
            slept_from, loop_from = time.monotonic(), asyncio.get_running_loop().time()
            # On the shared tick (``runtime.ticks``): every worker's ping wakes with the other periodic loops.
            planned = await ticks.sleep(self.cfg.health_interval_s) - loop_from  # the interval, within half a tick
            late = time.monotonic() - slept_from - planned
            for _ in range(2):  # two loop turns: the pipe's pending lines are read (and a pong seen)
                await asyncio.sleep(0)
            if w.last_pong_s != pong_s:
                pong_s, late_s = w.last_pong_s, 0.0
            if (pong_s or 0.0) < slept_from + planned:  # the lateness came after the pong
                late_s += max(0.0, late)
            age = time.monotonic() - (pong_s or 0.0)
            if age - late_s > self.cfg.health_timeout_s:
                held_up = f" ({late_s:.1f}s of it the gateway's own lateness)" if late_s >= 0.1 else ""
                self._event(K.UNHEALTHY, f"no pong for {age:.1f}s{held_up}: killing")
                await w.kill("hung")  # its requests' failure is a stall, not a crash (round 19)
                return

    async def stop(self) -> None:
        """Stop the worker for good."""
        self._stopping = True
        await self.worker.stop()
