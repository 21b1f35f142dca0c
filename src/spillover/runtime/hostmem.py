"""Host-memory observation for the CPU lane's guard (``core.hostguard`` decides).

``HostMemory`` owns what the guard is shown: the resident memory of the gateway and its
workers (read every ``HOST_OBSERVE_INTERVAL_S`` by ``run``), its peak, the baseline (the
reading once everything is loaded, less what the CPU replicas held then), and the
``HostView`` built from those for each CPU dispatch the scheduler considers.

What a CPU replica holds is counted from its own reports (``held``): its model when loaded
(``weights_bytes``) and each open context (``context_bytes``), whatever readiness mode put
them there. Each reading also ticks the replicas' readiness (``runtime.readiness``) with
the room the guard leaves them.

A replica's idle move up also keeps room for what workers being restarted held while up and
will take again (``returning_bytes``: a dead GPU worker's memory is free in the reading until
its restart loads).

Against the budget a replica's model counts whole (its pages are resident). Against the
machine's available memory, the part llama.cpp maps from the model file (``mapped_bytes``)
never counts, loaded or not: the kernel counts that page cache as available already, so
dropping it gives nothing back and loading it takes nothing (``core.hostguard`` rule 4).
Counting it there made a replica that stepped down for want of room see less room than
before, for memory that was never taken.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spillover.core.hostguard import HostView
from spillover.runtime import ticks
from spillover.runtime.devices import ProcReader
from spillover.runtime.readiness import ReplicaReadiness
from spillover.runtime.worker_client import WorkerClient, WorkerState

if TYPE_CHECKING:
    from spillover.runtime.scheduler import Scheduler
    from spillover.runtime.supervisor import Supervisor

__all__ = ["HOST_OBSERVE_INTERVAL_S", "CpuLaneHost", "HostMemory", "HostStatistics"]

HOST_OBSERVE_INTERVAL_S = 0.2  # a whole number of ``ticks.TICK_S``: the reading wakes with the device's


@dataclass(frozen=True)
class HostStatistics:
    """A snapshot of the observed host memory."""

    observed_bytes: int  # RSS of the gateway and its workers, last reading
    peak_bytes: int  # the highest reading
    base_bytes: int  # the reading with everything loaded, less what the replicas held then (0: not yet)
    slot_bytes: int  # what one CPU context costs (memory model)
    budget_bytes: int
    replica_bytes: int  # what the CPU replicas hold now (models and contexts, predicted)


@dataclass
class _Measured:
    """One replica process's RSS as read (``HostMemory.measure``), for one start of its worker."""

    starts: int
    bare_bytes: int = 0  # its least RSS holding nothing (0: not seen yet)
    extra_bytes: int = 0  # the most it was seen holding past what is counted (allocator caches, buffers)
    now_extra_bytes: int = 0  # what it holds past its count and its bare RSS at the last reading


@dataclass(frozen=True)
class CpuLaneHost:
    """One CPU replica as the guard sees it: a chat model's lane (its scheduler, whose CPU
    worker and peak concurrency count) or an embeddings or transcription service's replica
    (``replica``: its worker; no per-request context), what its model and one of its contexts
    cost, and its readiness."""

    scheduler: Callable[[], Scheduler | None]
    weights_bytes: int
    context_bytes: int
    readiness: ReplicaReadiness | None = None
    replica: Callable[[], WorkerClient | None] | None = None  # a service's replica (no scheduler)
    mapped_bytes: int = 0  # of weights_bytes, what stays mapped from the model file (llama.cpp's mmap)

    @property
    def slot_bytes(self) -> int:
        """A context with its own weights: what the first context of an unloaded replica costs."""
        return self.weights_bytes + self.context_bytes

    def worker(self) -> WorkerClient | None:
        if self.replica is not None:
            return self.replica()
        sched = self.scheduler()
        return sched.cpu_workers[0] if sched is not None and sched.cpu_workers else None


class HostMemory:
    """Observes the host RAM of the gateway and its workers. ``run`` until cancelled;
    ``lane_view`` gives each chat model's scheduler its ``host_view``. With several chat
    models, what the guard predicts is the baseline plus every CPU lane's open contexts."""

    def __init__(
        self,
        supervisors: Callable[[], list[Supervisor]],
        *,
        budget_bytes: int,
        min_free_bytes: int,
    ) -> None:
        self.supervisors = supervisors  # every worker of the gateway: their RSS counts
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.lanes: list[CpuLaneHost] = []  # CPU replicas: the chat models' lanes (the primary's first), services'
        self.observed_bytes = 0
        self.peak_bytes = 0
        self.base_bytes = 0
        self._cpu_worker_starts: tuple[int, ...] = ()
        self._measured: dict[int, _Measured] = {}  # id(lane) -> its replica's RSS as read
        self._rss: dict[int, tuple[int, int]] = {}  # pid -> its RSS and the anonymous part of it, last reading
        # id(supervisor) -> its worker's pid, and the most RSS and anonymous part it was read holding while ready
        self._ready_rss: dict[int, tuple[int, int, int]] = {}
        self._proc = ProcReader()  # the /proc files, kept open: read several times a second

    def __repr__(self) -> str:
        mib = 1024 * 1024
        return (
            f"<HostMemory rss={self.observed_bytes / mib:.0f}MiB peak={self.peak_bytes / mib:.0f}MiB"
            f" budget={self.budget_bytes / mib:.0f}MiB>"
        )

    @property
    def slot_bytes(self) -> int:
        """What one context of the primary chat model's CPU lane costs (memory model)."""
        return next((lane.slot_bytes for lane in self.lanes if lane.replica is None), 0)

    def statistics(self) -> HostStatistics:
        return HostStatistics(
            observed_bytes=self.observed_bytes,
            peak_bytes=self.peak_bytes,
            base_bytes=self.base_bytes,
            slot_bytes=self.slot_bytes,
            budget_bytes=self.budget_bytes,
            replica_bytes=self.replicas_bytes(),
        )

    async def run(self) -> None:
        """Read the processes' RSS until cancelled; take the baseline once the (fresh) CPU
        workers are ready with no context and every worker is ready."""
        while True:
            every = self.supervisors()
            pids = [os.getpid()] + [s.worker.pid for s in every if s.worker.pid is not None]
            each: dict[int, int] = {}
            anon: dict[int, int] = {}
            rss = self._proc.rss(pids, each, anon)  # the gateway and its workers: a few /proc reads, inline
            self.observe(rss, each, every, anon)
            cpus = [(lane, lane.worker()) for lane in self.lanes]
            if cpus and all(w is not None and w.state is WorkerState.READY for _, w in cpus):
                starts = tuple(w.starts for _, w in cpus if w is not None)
                if starts != self._cpu_worker_starts:  # a fresh CPU worker: take the baseline again
                    self._cpu_worker_starts = starts
                    self.base_bytes = 0
                if self.base_bytes == 0 and all(s.worker.state is WorkerState.READY for s in every):
                    # everything loaded: the rest of the reading is what no replica report covers
                    self.base_bytes = max(1, rss - self.replicas_bytes())
            await self.tick_readiness()
            await ticks.sleep(HOST_OBSERVE_INTERVAL_S)

    def observe(
        self, rss_bytes: int, each: dict[int, int], every: list[Supervisor], anon: dict[int, int] | None = None
    ) -> None:
        """Take one reading: ``rss_bytes`` in all, ``each`` by pid (``anon``: the part of it not
        backed by files; all of it when not given), of ``every`` worker."""
        self.observed_bytes = rss_bytes
        self.peak_bytes = max(self.peak_bytes, rss_bytes)
        self._rss = {pid: (b, (anon or each).get(pid, b)) for pid, b in each.items()}
        for s in every:  # the most each worker held while up: its restart takes that again
            pid = s.worker.pid
            if s.worker.state is WorkerState.READY and pid in self._rss:
                # The most, not the last: a killed process gives its memory back before its pipe
                # closes and its state leaves READY, so its last reading can be 0 (round 44).
                was = self._ready_rss.get(id(s))
                held, held_anon = self._rss[pid]
                if was is not None and was[0] == pid:
                    held, held_anon = max(held, was[1]), max(held_anon, was[2])
                self._ready_rss[id(s)] = (pid, held, held_anon)
        self.measure(each)

    def measure(self, rss: dict[int, int]) -> None:
        """Each ready replica's RSS (``rss``: by pid): its least while it holds nothing, and the
        most it held past what is counted (its model and contexts) while it held something. A
        process's allocators keep more than the model (a transcription's decoding buffers, an
        encoder's arenas), which the reading counts and the count does not; a move up needs that
        much more room (``extra_bytes``), or the replica loads, is found short, drops and loads
        again on every reading (round 35: whisper's replica flapped four times in 0.8 s)."""
        for lane in self.lanes:
            w = lane.worker()
            if w is None or w.state is not WorkerState.READY or w.pid not in rss:
                continue
            m = self._measured.get(id(lane))
            if m is None or m.starts != w.starts:  # a fresh process: measured afresh
                m = self._measured[id(lane)] = _Measured(w.starts)
            held = self.held_bytes(lane, w)
            asked = lane.readiness.asked_bytes(w) if lane.readiness is not None else 0
            if held == 0 and asked == 0 and w.busy == 0:  # idle, holding nothing, nothing loading
                m.bare_bytes = min(m.bare_bytes or rss[w.pid], rss[w.pid])
            if m.bare_bytes:
                m.now_extra_bytes = max(0, rss[w.pid] - m.bare_bytes - held)
                if held:
                    m.extra_bytes = max(m.extra_bytes, m.now_extra_bytes)

    def extra_bytes(self, lane: CpuLaneHost) -> int:
        """What ``lane``'s replica was seen holding past its count (``measure``; 0 unknown), less
        what of it it holds still (after a drop, memory its allocators kept is in the reading
        already, and counting it again would keep the replica down for good)."""
        m = self._measured.get(id(lane))
        w = lane.worker()
        if m is None or w is None or m.starts != w.starts:
            return 0
        return max(0, m.extra_bytes - m.now_extra_bytes)

    @staticmethod
    def cpu_contexts(lane: CpuLaneHost, worker: WorkerClient) -> int:
        """Contexts a CPU worker holds: its own report, or (sooner) the peak concurrency its
        scheduler gave it since that report, since each concurrent request opens one."""
        sched = lane.scheduler()
        return max(worker.contexts, sched.peak_running(worker) if sched is not None else 0)

    @classmethod
    def model_loaded(cls, lane: CpuLaneHost, worker: WorkerClient) -> bool:
        """Whether a CPU replica holds its model (its report; any open context holds it too)."""
        return bool(worker.held.get("model", True)) or cls.cpu_contexts(lane, worker) > 0

    @classmethod
    def held_bytes(cls, lane: CpuLaneHost, worker: WorkerClient) -> int:
        """Host bytes a CPU replica holds now: its model when loaded, and its contexts."""
        loaded = cls.model_loaded(lane, worker)
        return (lane.weights_bytes if loaded else 0) + cls.cpu_contexts(lane, worker) * lane.context_bytes

    def replicas_bytes(self, *, but: CpuLaneHost | None = None) -> int:
        """What the CPU replicas hold now (all of them, or all but ``but``)."""
        total = 0
        for lane in self.lanes:
            w = lane.worker()
            if w is not None and lane is not but and w.state is WorkerState.READY:
                total += self.held_bytes(lane, w)
        return total

    def returning_bytes(self, lane: CpuLaneHost) -> tuple[int, int]:
        """Host memory that workers being restarted (other than ``lane``'s) held while last up
        (the most each was read holding) and do not hold now, their restart takes it again: in
        the reading (RSS), and of the machine's available memory (the anonymous part: pages
        mapped from a model file stay in the page cache, available all along). A dead GPU
        worker's memory is free in the reading until its restart loads (round 38: the chat
        replica at ``host_short`` took that room, loaded its model and dropped it again, once a
        crash). Only a worker taken to come back is counted (``Supervisor.coming_back``: fewer
        than ``COMING_BACK_FAILED_STARTS`` failed starts in a row; a start killed once, an OOM
        kill mid-load, is still counted: round 42), and not one whose start waits for room on
        the device (``waits_for_room``: that may take any time, while the CPU replicas serve
        its requests; round 43)."""
        own = lane.worker()
        rss = anon = 0
        for s in self.supervisors():
            last = self._ready_rss.get(id(s))
            if last is None or s.worker is own or not s.coming_back or s.worker.waits_for_room:
                continue
            now = self._rss.get(s.worker.pid, (0, 0)) if s.worker.pid is not None else (0, 0)
            rss += max(0, last[1] - now[0])
            anon += max(0, last[2] - now[1])
        return rss, anon

    def room_bytes(
        self, lane: CpuLaneHost, available_bytes: int | None = None, *, returning: tuple[int, int] = (0, 0)
    ) -> int:
        """Host memory ``lane``'s replica may hold while idle: the budget less everything else
        (the larger of the observed and the predicted use, less the replica's own holding), and
        no more than the machine has available beside what the replica holds already. Loads
        the other replicas were asked for and have not reported are counted as taken, and so is
        ``returning``: what restarting workers will take again (``returning_bytes()``)."""
        if available_bytes is None:
            available_bytes = self._proc.available()
        w = lane.worker()
        ready = w is not None and w.state is WorkerState.READY
        own = self.held_bytes(lane, w) if w is not None and ready else 0
        if w is not None and ready and lane.readiness is not None:  # a move under way: what it will hold
            own = max(own, lane.readiness.asked_bytes(w))
        # the mapped weights take none of the machine's available memory, held or not
        mapped = 0 if w is not None and ready and self.model_loaded(lane, w) else lane.mapped_bytes
        observed = self.observed_bytes + returning[0]
        used = max(observed, (self.base_bytes or self.observed_bytes) + self.replicas_bytes())
        # what the other replicas were asked to take and do not hold yet (their loads under way)
        pending = sum(o.readiness.pending_bytes() for o in self.lanes if o is not lane and o.readiness is not None)
        used += pending
        by_budget = self.budget_bytes - used + own  # max(observed, predicted), less what it holds itself
        by_machine = available_bytes + own + mapped - self.min_free_bytes - pending - returning[1]
        return min(by_budget, by_machine)

    async def tick_readiness(self) -> None:
        """Let each replica's readiness pick for its room; ask the worker to move when it must."""
        if not any(lane.readiness is not None for lane in self.lanes):
            return
        available = self._proc.available()  # one reading for every lane of this tick
        for lane in self.lanes:
            w = lane.worker()
            if lane.readiness is None or w is None:
                continue
            room = self.room_bytes(lane, available)
            # A move up does not take what a restarting worker will take again (a step down is
            # judged on the room as read: a model a request loaded meanwhile, ``load_allowed``,
            # is kept until the worker is back and the room is short).
            back = self.returning_bytes(lane)
            returning = room - self.room_bytes(lane, available, returning=back) if any(back) else 0
            mode = lane.readiness.tick(room, extra_bytes=self.extra_bytes(lane), returning_bytes=returning)
            if mode is not None:
                await w.set_readiness(mode)

    def lane_view(
        self,
        scheduler: Callable[[], Scheduler | None],
        *,
        weights_bytes: int,
        context_bytes: int,
        readiness: ReplicaReadiness | None = None,
        mapped_bytes: int = 0,
    ) -> Callable[[int], HostView]:
        """Register a chat model's CPU lane; its scheduler's ``host_view``."""
        lane = CpuLaneHost(scheduler, weights_bytes, context_bytes, readiness, mapped_bytes=mapped_bytes)
        self._register(lane)
        return lambda running: self._view(lane, running)

    def add_replica(
        self, worker: Callable[[], WorkerClient | None], *, weights_bytes: int, readiness: ReplicaReadiness
    ) -> CpuLaneHost:
        """Register an embeddings or transcription service's CPU replica (its model, no context)."""
        return self._register(CpuLaneHost(lambda: None, weights_bytes, 0, readiness, replica=worker))

    def _register(self, lane: CpuLaneHost) -> CpuLaneHost:
        """Count ``lane``'s replica from now on; its readiness shows what the guard counts."""
        self.lanes.append(lane)
        if lane.readiness is not None:
            lane.readiness.guard_bytes = functools.partial(self.held_bytes, lane)
        return lane

    def load_allowed(self, lane: CpuLaneHost) -> bool:
        """Whether ``lane``'s replica may hold its model now: it does already, or the room the
        guard leaves it holds the model (a request to an unloaded replica loads it)."""
        w = lane.worker()
        if w is None or w.state is not WorkerState.READY or self.model_loaded(lane, w):
            return True
        return self.room_bytes(lane) >= lane.weights_bytes

    def _view(self, lane: CpuLaneHost, running: int) -> HostView:
        """What the host guard is shown for a dispatch on ``lane`` with ``running`` requests running."""
        cpu = lane.worker()
        assert cpu is not None, "no CPU worker"
        base = self.base_bytes or self.observed_bytes
        loaded = self.model_loaded(lane, cpu)
        return HostView(
            running=running,
            contexts=self.cpu_contexts(lane, cpu),
            slots=cpu.spec.slots,
            predicted_bytes=base + self.replicas_bytes(),
            observed_bytes=self.observed_bytes,
            slot_bytes=lane.context_bytes + (0 if loaded else lane.weights_bytes),
            budget_bytes=self.budget_bytes,
            available_bytes=self._proc.available(),
            min_free_bytes=self.min_free_bytes,
            mapped_bytes=0 if loaded else lane.mapped_bytes,
        )
