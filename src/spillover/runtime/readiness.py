"""Keeps one service's CPU replica as ready as its recovery budget asks (``core.readiness``
decides; this applies it).

``ReplicaReadiness.tick`` runs with every host-memory reading (``HostMemory.run``): it takes
the replica's reported step timings (``held`` reports), the failovers' observed recovery
times and the host room, picks a mode, and asks the worker to move when it holds another
(``WorkerClient.set_readiness``). A restarted replica starts in ``initial_mode`` again (so
the host baseline, taken then, holds no context) and the next tick moves it. Two things keep
a mode at the edge from flapping besides ``core.readiness``'s step: a move up needs the room
the replica's process was seen holding past its count too, less what of it it holds still
(``extra_bytes``, from ``HostMemory.measure``); a move under way counts as made
(``asked_bytes``); and after a pick that found the host short a move up waits until the
room has lasted ``UP_HOLD_S``.

The prediction is kept current by the replica itself: it re-measures a step every time it
really does one (a model load, a context). Each step's figure in the prediction is the slowest
of its last ``STEP_SAMPLES`` measurements (``WorkerClient.step_samples``, across the replica's
restarts): a load's time varied by a third from one load to the next here (67-114 ms for
SmolLM2), so the latest alone promised a recovery the next failover overran. The gateway's
start-up measurement counts only until a step has another: taken while every worker loads at
once from a cold page cache, it ran 2-4 times what later loads took for the embeddings and
transcription models (a transcription load 783 ms against 217-357 after; round 67), which no
failover repeats, and kept for five loads it would hold ``auto`` in a dearer mode. ``observe``
records a failover's fault-to-first-CPU-token time for /v1/status; it does not feed the
prediction, because it also holds the client prompt's prefill and any CPU queue wait, which no
readiness mode changes (one long prompt would otherwise hold the replica warm for good).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from spillover.core.readiness import CHEAPEST_FIRST, Choice, Why, host_cost, initial_mode, pick, recovery_ms
from spillover.runtime.worker_client import WorkerClient, WorkerState

__all__ = ["ReplicaReadiness"]

log = logging.getLogger("spillover.readiness")
REPLICA_STEP_SHARE = 10  # a context-less replica's move up needs a tenth of its model more room (hysteresis)
ASK_AGAIN_S = 2.0  # a move the replica did not make (e.g. its load failed) is asked again after this
# After a pick that found the host short, a move up waits until the room has held this long:
# a reading over the budget for a moment (another worker's load, a burst) drops the model once,
# not once every reading while it lasts (round 35: four moves in 0.8 s).
UP_HOLD_S = 2.0


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
        alone: bool = False,
    ) -> None:
        self.configured = configured
        self.alone = alone  # the model has no GPU lane: the replica is its only path
        self.budget_ms = budget_ms
        self.worker = worker
        self.weights_bytes = weights_bytes
        self.context_bytes = context_bytes
        self.choice = Choice(initial_mode(configured), Why.CONFIGURED if configured != "auto" else Why.NOT_MEASURED, "")
        self.last_failover: dict[str, Any] | None = None
        self.extra_bytes = 0  # a move up's margin for what its process holds past its count (``tick``)
        self._short_at = -UP_HOLD_S  # when a pick last found the host short (monotonic)
        self._asked: tuple[str, int, int] | None = None  # (mode, worker start, held report) last sent
        self._asked_at = -ASK_AGAIN_S
        # What the host-RAM guard counts the replica as holding (``HostMemory`` sets it when it
        # registers the replica): sooner than the reports (a context opens with its request).
        self.guard_bytes: Callable[[WorkerClient], int] | None = None

    def __repr__(self) -> str:
        return f"<ReplicaReadiness {self.configured} -> {self.choice.mode} ({self.choice.why})>"

    def initial_mode(self) -> str:
        """The mode its replica process starts in (``core.readiness.initial_mode``)."""
        return initial_mode(self.configured)

    def holding(self, w: WorkerClient) -> str:
        """The mode the worker reports it is in ('' before its first report)."""
        return str(w.held.get("mode", ""))

    def steps(self) -> dict[str, float]:
        """Each step's figure the prediction takes: the slowest of its latest measurements after
        the first (``WorkerClient.step_samples``, kept across the replica's restarts), the first
        while it has no other. Empty while the replica has not reported since its start (dead,
        starting: it holds nothing)."""
        w = self.worker()
        if w is None or not w.held:
            return {}
        return {step: max(w.step_samples.get(step) or [first]) for step, first in w.step_first.items()}

    def recovery(self) -> dict[str, float]:
        """Each mode's predicted recovery time from ``steps``; empty before the replica measured every step."""
        return recovery_ms(self.steps())

    def held_bytes(self, w: WorkerClient) -> int:
        """Host bytes the replica reports holding (its model when loaded, its contexts)."""
        return (self.weights_bytes if w.held.get("model") else 0) + w.contexts * self.context_bytes

    def host_bytes(self, w: WorkerClient) -> int:
        """Host bytes the replica holds as the host-RAM guard counts them (``/v1/status``'s
        ``host_bytes``, ``/api/ps``); its reports alone without a guard."""
        return self.guard_bytes(w) if self.guard_bytes is not None else self.held_bytes(w)

    def _costs(self, w: WorkerClient) -> dict[str, int]:
        return {
            m: host_cost(m, weights_bytes=self.weights_bytes, context_bytes=self.context_bytes, slots=w.spec.slots)
            for m in ("warm", "mmap", "on_demand")
        }

    def asked_bytes(self, w: WorkerClient) -> int:
        """What the replica was asked to hold and has not reported yet (a move under way; 0
        when none): ``HostMemory.room_bytes`` counts it as the replica's own, so the room its
        own load takes, which the host reading shows before the report, does not make the
        move look short and undo it half way (round 35's review)."""
        mode = self._outstanding(w)
        return self._costs(w)[mode] if mode else 0

    def _outstanding(self, w: WorkerClient) -> str:
        """The mode last asked of the worker when it has not reported since ('' when none)."""
        if self._asked is None or self._asked[1:] != (w.starts, w.held_seq):
            return ""
        return self._asked[0]

    def pending_bytes(self) -> int:
        """Host bytes the replica was asked to take and does not report holding yet (a move up
        under way): ``HostMemory`` counts them against every other replica's room, so two
        replicas never spend the same room, in one tick or before a load is reported."""
        w = self.worker()
        if w is None or w.state is not WorkerState.READY:
            return 0
        return max(0, self._costs(w)[self.choice.mode] - self.held_bytes(w))

    def tick(self, room_bytes: int, *, extra_bytes: int = 0, returning_bytes: int = 0) -> str | None:
        """Pick a mode for ``room_bytes`` of host room; the mode to ask the worker for, when it
        holds (or was asked for) another, else None. ``extra_bytes``: what the replica's process
        was seen holding past its count while loaded, less what of it it holds still
        (``HostMemory.extra_bytes``); ``returning_bytes``: of the room, what restarting workers
        take again (``HostMemory.returning_bytes``). A move up needs both as more room."""
        w = self.worker()
        if w is None or w.state is not WorkerState.READY:
            return None
        cost = self._costs(w)
        self.extra_bytes = extra_bytes
        # A move asked and not reported yet is where it is going: a pick back to the mode it
        # leaves is a move up (round 35: the status said warm for a reading while it dropped).
        current = self._outstanding(w) or self.holding(w) or self.choice.mode
        choice = pick(
            self.configured,
            self.budget_ms,
            self.recovery(),
            cost,
            room_bytes,
            current=current,
            # One context; a replica without contexts (embeddings, transcription), a tenth of
            # its model, so that a move up does not flap on the next reading's noise; and what
            # it holds past its count, which the next reading shows; and what restarting workers take again.
            step_bytes=(self.context_bytes or self.weights_bytes // REPLICA_STEP_SHARE) + extra_bytes + returning_bytes,
            alone=self.alone,
        )
        now = time.monotonic()
        if choice.why is Why.HOST_SHORT:
            self._short_at = now
        elif (
            now - self._short_at < UP_HOLD_S
            and current in CHEAPEST_FIRST
            and CHEAPEST_FIRST.index(choice.mode) > CHEAPEST_FIRST.index(current)
        ):  # the room came back a moment ago: held where it is until the room has lasted
            choice = Choice(current, Why.HOST_SHORT, choice.wanted)
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
        # In the mode already, but holding more than the mode keeps and than the room allows
        # (on_demand and mmap keep what their requests opened): asked again, it sheds that.
        over = self.held_bytes(w) > max(cost[choice.mode], room_bytes)
        # In the mode, but without the model the mode keeps (its load failed): asked again.
        short = choice.mode != "on_demand" and not w.held.get("model", True)
        if current == choice.mode and not over and not short:
            return None
        asked = (choice.mode, w.starts, w.held_seq)  # asked again only after a report that did not move
        if self._asked == asked or (
            self._asked is not None and self._asked[:2] == asked[:2] and now - self._asked_at < ASK_AGAIN_S
        ):
            return None
        self._asked, self._asked_at = asked, now
        return choice.mode

    def observe(self, ms: float) -> None:
        """A failover reached its first CPU result ``ms`` after the fault, with the replica in
        the mode it held then (shown in /v1/status; see the module docstring)."""
        w = self.worker()
        mode = (self.holding(w) if w is not None else "") or self.choice.mode
        self.last_failover = {"mode": mode, "recovery_ms": round(ms, 1), "at": time.time()}

    def status(self) -> dict[str, Any]:
        """Its part of the service's /v1/status row (``cpu_readiness``)."""
        w = self.worker()
        steps = self.steps()
        recovery = recovery_ms(steps)
        return {
            "configured": self.configured,
            "mode": self.choice.mode,
            "holding": self.holding(w) if w is not None else "",
            "why": str(self.choice.why),
            "wanted": self.choice.wanted,
            "recovery_budget_ms": self.budget_ms,
            "recovery_ms": {k: round(v, 1) for k, v in recovery.items()},
            "meets_budget": recovery.get(self.choice.mode, float("inf")) <= self.budget_ms,
            "timings_ms": dict((w.held.get("timings") or {}) if w is not None else {}),  # the latest of each
            "predicted_steps_ms": {k: round(v, 3) for k, v in steps.items()},  # what recovery_ms adds up
            "model_loaded": bool(w.held.get("model")) if w is not None else False,
            "contexts": w.contexts if w is not None else 0,
            "host_bytes": self.host_bytes(w) if w is not None else 0,
            "extra_bytes": self.extra_bytes,  # held past host_bytes when loaded, not held now: a move up's margin
            "last_failover": self.last_failover,
        }
