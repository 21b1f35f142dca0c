"""Host-memory observation for the CPU lane's guard (``core.hostguard`` decides).

``HostMemory`` owns what the guard is shown: the resident memory of the gateway and its
workers (read every ``HOST_OBSERVE_INTERVAL_S`` by ``run``), its peak, the baseline taken
once everything is loaded and no CPU context is open yet, and the ``HostView`` built from
those for each CPU dispatch the scheduler considers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spillover.core.hostguard import HostView
from spillover.runtime.devices import processes_rss
from spillover.runtime.worker_client import WorkerClient, WorkerState

if TYPE_CHECKING:
    from spillover.runtime.scheduler import Scheduler
    from spillover.runtime.supervisor import Supervisor

__all__ = ["HOST_OBSERVE_INTERVAL_S", "HostMemory", "HostStatistics"]

HOST_OBSERVE_INTERVAL_S = 0.25


@dataclass(frozen=True)
class HostStatistics:
    """A snapshot of the observed host memory."""

    observed_bytes: int  # RSS of the gateway and its workers, last reading
    peak_bytes: int  # the highest reading
    base_bytes: int  # the reading with everything loaded and no CPU context (0: not yet)
    slot_bytes: int  # what one CPU context costs (memory model)
    budget_bytes: int


class HostMemory:
    """Observes the host RAM of the gateway and its workers. ``run`` until cancelled;
    ``view`` is the scheduler's ``host_view``."""

    def __init__(
        self,
        supervisors: list[Supervisor],
        *,
        budget_bytes: int,
        min_free_bytes: int,
        others: Callable[[], list[Supervisor]] = list,
    ) -> None:
        self.supervisors = supervisors  # the gateway's own list, filled in as it starts them
        self.others = others  # the other services' workers: their RSS counts too
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.scheduler: Scheduler | None = None  # set once the gateway has made it
        self.slot_bytes = 0  # set at start, from the CPU lane's memory model
        self.observed_bytes = 0
        self.peak_bytes = 0
        self.base_bytes = 0
        self._cpu_worker_starts = 0

    def __repr__(self) -> str:
        mib = 1024 * 1024
        return (
            f"<HostMemory rss={self.observed_bytes / mib:.0f}MiB peak={self.peak_bytes / mib:.0f}MiB"
            f" budget={self.budget_bytes / mib:.0f}MiB>"
        )

    def statistics(self) -> HostStatistics:
        return HostStatistics(
            observed_bytes=self.observed_bytes,
            peak_bytes=self.peak_bytes,
            base_bytes=self.base_bytes,
            slot_bytes=self.slot_bytes,
            budget_bytes=self.budget_bytes,
        )

    def _cpu_worker(self) -> WorkerClient | None:
        return next((s.worker for s in self.supervisors if s.worker.spec.lane == "cpu"), None)

    async def run(self) -> None:
        """Read the processes' RSS until cancelled; take the baseline once a (fresh) CPU
        worker is ready with no context and every worker is ready."""
        while True:
            every = self.supervisors + self.others()
            pids = [os.getpid()] + [s.worker.pid for s in every if s.worker.pid is not None]
            rss = await asyncio.to_thread(processes_rss, pids)  # the gateway and its workers
            self.observed_bytes = rss
            self.peak_bytes = max(self.peak_bytes, rss)
            cpu = self._cpu_worker()
            if cpu is not None and cpu.state is WorkerState.READY:
                if cpu.starts != self._cpu_worker_starts:  # a fresh CPU worker: no contexts yet
                    self._cpu_worker_starts = cpu.starts
                    self.base_bytes = 0
                if (
                    self.base_bytes == 0
                    and self.cpu_contexts(cpu) == 0
                    and all(s.worker.state is WorkerState.READY for s in every)
                ):
                    self.base_bytes = rss  # everything loaded, no CPU context yet
            await asyncio.sleep(HOST_OBSERVE_INTERVAL_S)

    def cpu_contexts(self, worker: WorkerClient) -> int:
        """Contexts the CPU worker holds: its own report, or (sooner) the peak concurrency
        the scheduler gave it since it started, since each concurrent request opens one."""
        assert self.scheduler is not None
        return max(worker.contexts, self.scheduler.peak_running(worker))

    def view(self, running: int) -> HostView:
        """What the host guard is shown for a CPU dispatch with ``running`` requests running."""
        import psutil

        cpu = self._cpu_worker()
        assert cpu is not None, "no CPU worker"
        contexts = self.cpu_contexts(cpu)
        base = self.base_bytes or self.observed_bytes
        return HostView(
            running=running,
            contexts=contexts,
            slots=cpu.spec.slots,
            predicted_bytes=base + contexts * self.slot_bytes,
            observed_bytes=self.observed_bytes,
            slot_bytes=self.slot_bytes,
            budget_bytes=self.budget_bytes,
            available_bytes=int(psutil.virtual_memory().available),
            min_free_bytes=self.min_free_bytes,
        )
