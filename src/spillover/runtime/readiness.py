"""Keeps one chat service's CPU replica as ready as its recovery budget asks (``core.readiness``
decides; this applies it).

``ReplicaReadiness.tick`` runs with every host-memory reading (``HostMemory.run``): it takes
the replica's reported step timings (``held`` reports), the failovers' observed recovery
times and the host room, picks a mode, and asks the worker to move when it holds another
(``WorkerClient.set_readiness``). A restarted replica starts in ``initial_mode`` again (so
the host baseline, taken then, holds no context) and the next tick moves it.

``observe`` records a failover's fault-to-first-CPU-token time, which keeps the prediction
current (it only ever raises a mode's figure above the measured steps).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from spillover.core.readiness import Choice, Why, host_cost, initial_mode, pick, recovery_ms
from spillover.runtime.worker_client import WorkerClient, WorkerState

__all__ = ["ReplicaReadiness"]

log = logging.getLogger("spillover.readiness")


class ReplicaReadiness:
    """One CPU replica's readiness: configured mode, budget, the last pick and observations."""

    def __init__(
        self,
        configured: str,
        budget_ms: float,
        worker: Callable[[], WorkerClient | None],
        *,
        weights_bytes: int,
        context_bytes: int,
    ) -> None:
        self.configured = configured
        self.budget_ms = budget_ms
        self.worker = worker
        self.weights_bytes = weights_bytes
        self.context_bytes = context_bytes
        self.choice = Choice(initial_mode(configured), Why.CONFIGURED if configured != "auto" else Why.NOT_MEASURED, "")
        self.observed: dict[str, float] = {}  # mode -> longest failover recovery seen in it (ms)
        self.last_failover: dict[str, Any] | None = None
        self._asked: tuple[str, int, int] | None = None  # (mode, worker start, held report) last sent

    def __repr__(self) -> str:
        return f"<ReplicaReadiness {self.configured} -> {self.choice.mode} ({self.choice.why})>"

    def initial_mode(self) -> str:
        """The mode its replica process starts in (``core.readiness.initial_mode``)."""
        return initial_mode(self.configured)

    def holding(self, w: WorkerClient) -> str:
        """The mode the worker reports it is in ('' before its first report)."""
        return str(w.held.get("mode", ""))

    def recovery(self) -> dict[str, float]:
        w = self.worker()
        timings = (w.held.get("timings") or {}) if w is not None else {}
        return recovery_ms(timings, self.observed)

    def tick(self, room_bytes: int) -> str | None:
        """Pick a mode for ``room_bytes`` of host room; the mode to ask the worker for, when it
        holds (or was asked for) another, else None."""
        w = self.worker()
        if w is None or w.state is not WorkerState.READY:
            return None
        cost = {
            m: host_cost(m, weights_bytes=self.weights_bytes, context_bytes=self.context_bytes, slots=w.spec.slots)
            for m in ("warm", "mmap", "on_demand")
        }
        current = self.holding(w) or self.choice.mode
        choice = pick(
            self.configured,
            self.budget_ms,
            self.recovery(),
            cost,
            room_bytes,
            current=current,
            step_bytes=self.context_bytes,
        )
        if choice != self.choice:
            log.info(
                "CPU replica %s: %s (%s; budget %.0f ms, recovery %s)",
                w.spec.worker_id,
                choice.mode,
                choice.why,
                self.budget_ms,
                {k: round(v) for k, v in self.recovery().items()},
            )
        self.choice = choice
        asked = (choice.mode, w.starts, w.held_seq)  # asked again after a report that did not move
        if current == choice.mode or self._asked == asked:
            return None
        self._asked = asked
        return choice.mode

    def observe(self, ms: float) -> None:
        """A failover reached its first CPU token ``ms`` after the fault, with the replica in
        the mode it held then: that mode's prediction is at least this from now on."""
        w = self.worker()
        mode = (self.holding(w) if w is not None else "") or self.choice.mode
        self.observed[mode] = max(self.observed.get(mode, 0.0), ms)
        self.last_failover = {"mode": mode, "recovery_ms": round(ms, 1), "at": time.time()}

    def status(self) -> dict[str, Any]:
        """Its part of the service's /v1/status row (``cpu_readiness``)."""
        w = self.worker()
        return {
            "configured": self.configured,
            "mode": self.choice.mode,
            "holding": self.holding(w) if w is not None else "",
            "why": str(self.choice.why),
            "wanted": self.choice.wanted,
            "recovery_budget_ms": self.budget_ms,
            "recovery_ms": {k: round(v, 1) for k, v in self.recovery().items()},
            "meets_budget": self.recovery().get(self.choice.mode, float("inf")) <= self.budget_ms,
            "timings_ms": dict((w.held.get("timings") or {}) if w is not None else {}),
            "model_loaded": bool(w.held.get("model")) if w is not None else False,
            "contexts": w.contexts if w is not None else 0,
            "last_failover": self.last_failover,
        }
