"""A service beside chat with one whole answer per request (embeddings, transcription): its
workers on the one device and on the CPU, its queue, and the run of one request from
dispatch to its answer. ``runtime.embeddings`` and ``runtime.transcription`` are its kinds:
each loads its model, predicts a request's device bytes and shapes the worker's events
into a result; everything below is shared.

Rules:

1. Its GPU worker charges the gateway's one ``DeviceLedger`` (the chat model's too): the
   weights when it loads (a load that does not fit waits, and its requests go to the CPU
   path meanwhile; never a load into an OOM), and each request's predicted bytes (its
   kind's memory model) before it starts. Chat admission sees those bytes at once.
2. A queued request starts on whichever lane can start it first, the GPU preferred
   (``core.placement``: late binding). The queue is bounded (503 at once when full) and a
   request waits at most ``queue_max_age_s``. The ETA of a request is the work queued ahead
   of it (requests, or seconds of audio) at each lane's measured speed; a request whose
   client deadline that ETA cannot meet is refused at once, with the ETA.
3. A request that fails on the GPU (the worker died, an allocation failed, an OOM, a stall)
   is replayed on the CPU path at its request boundary: nothing of it was delivered, and the
   same inputs give the same answer (each kind's worker decodes deterministically).
   Attempts are bounded by ``[failover].max_attempts`` a run (a resume starts a new one, as
   ``runtime.executor`` rule 1 says) and the gateway's retry budget. A failover that the CPU
   lane has not started within ``[admission].delay_max_s`` (at least ``RETURN_AFTER_MIN_S``)
   may go back to the GPU (the restarted worker) as chat's does: once a run, not after a
   stall (which may be the request's own doing) and not on the run's last attempt. A GPU
   attempt stalls when its next event does not come within ``STALL_FACTOR`` times the
   expected time of what the worker computes before it (its kind's ``StallSteps``: an
   embeddings chunk, a transcription's window; at the GPU's seconds a unit: the first
   attempt's, then rising at once to a slower one's and falling a fifth of the way to a faster
   one's; a request's fixed cost counted apart), times the worker's slots (that many may
   share the device), and never sooner than ``[failover].stall_timeout_s``: a hung device
   (``spillover sim hang``) is not a slow one. Its worker is killed (its supervisor restarts
   it), as chat does with a stalled one.
4. Each attempt's lease (worker slot + device reservation) is released exactly once, when
   the worker has stopped working on it (its last event, or its exit), however the
   attempt ends (done, error, cancel). The wait for that is bounded: a killed worker whose
   exit is not seen within ``[supervisor].health_timeout_s`` gives its lease back anyway. A
   worker looks for a cancel between its events (an embeddings chunk, a transcription's
   segment), so a cancelled attempt's worker has as long to stop as its next event may take at
   its lane's measured speed (``stop_bound_s``, from ``STOP_WAIT_S`` to ``STOP_WAIT_MAX_S``);
   past it, it is hung and killed.
5. A breaker per GPU worker (``core.breaker``) takes the GPU out of placement after
   repeated failures, as for chat.
6. The pressure ladder: a batch-priority service whose GPU worker is idle may be demoted
   for an interactive request that does not fit (chat admission's ``Demote``). Demoted, its
   requests go to its CPU path (reason ``demoted``) and its GPU worker is unloaded; it is
   never demoted with work in flight on the GPU, nor without a CPU path. It is promoted back
   once its weights have fitted with room to spare for ``promote_after_s``
   (``core.placement.promote_due``), and not demoted again for as long (no flapping).
   Both are journaled, counted in /metrics and shown in /v1/status with their reason.
7. Its CPU replica is kept as ready as its ``cpu_readiness`` says (``runtime.readiness``, as
   for chat; ``engine.holder`` in the worker): the host-RAM guard counts the replica's model
   while it holds it, and a request is placed on a replica that does not hold it (it loads it)
   only when the guard's room holds the model. A failover's fault-to-CPU-result time is shown
   with the mode. Without ``cpu_readiness`` the replica is loaded at start and kept whatever
   the host room, as before readiness modes (its row's ``cpu_readiness`` is null): a mode the
   host room could take away is only ever one that was asked for.
8. When none of its workers is ready and every one that may run has failed its last start
   (a model file the worker cannot load: ``runtime.supervisor`` rule 8), a request is
   refused at once (503 ``model_load_failed``, naming each worker's failure, Retry-After the
   next attempt), and so are the requests queued for it: waiting would only end in a queue
   timeout that hides why. The supervisors keep retrying; the first ready worker ends it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.config import ServiceConfig
from spillover.core.breaker import (
    BreakerEvent,
    BreakerPolicy,
    BreakerState,
    advance,
    allows,
    attempt_ended,
    probe_started,
)
from spillover.core.placement import PlacementView, place, promote_due
from spillover.core.reasons import FailoverReason, Reason
from spillover.core.routing import fault_outcome
from spillover.errors import (
    CapacityError,
    ConfigError,
    DeadlineTooShort,
    NoWorkerReady,
    QueueFull,
    RequestCancelled,
    WorkerFailed,
)
from spillover.runtime import ticks
from spillover.runtime.events import (
    AudioInfo,
    Done,
    Failed,
    Interrupted,
    Progress,
    RequestEvent,
    Started,
    SupervisorEvent,
    WorkerGone,
)
from spillover.runtime.hostmem import CpuLaneHost
from spillover.runtime.lanes import places_promised
from spillover.runtime.readiness import ReplicaReadiness
from spillover.runtime.scheduler import RETURN_AFTER_MIN_S
from spillover.runtime.supervisor import Supervisor, cannot_start
from spillover.runtime.watchdog import Watchdog
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["DeviceService", "Served", "ServiceStatistics", "StallSteps"]

log = logging.getLogger("spillover.services")
OnPart = Callable[..., None]  # on_part(event, *, lane, reason, attempt)
IDLE_WAKE_S = 0.5  # the pump's safety net (on the shared tick): a pass needs an event otherwise
HOST_SHORT_WORDS = ": the host-RAM guard has no room for its CPU replica's model (host_budget)"
STOP_WAIT_S = 5.0  # the least a cancelled attempt waits for its worker to stop (``DeviceService.stop_bound_s``)
STOP_WAIT_MAX_S = 30.0  # the most it waits: past it, the worker is hung and killed
FASTEST_KEPT = 5  # measured rates a lane keeps for a deadline the request alone overruns (``hold_place``)
STALL_FACTOR = 4.0  # a GPU attempt stalls past this many times its expected time (rule 3)


async def _settles(fut: asyncio.Future[None], within_s: float) -> bool:
    """Wait up to ``within_s`` for ``fut``; whether it is done. A cancel of the waiting task
    (a second DELETE, the client leaving or the request's timeout while the first cancel's
    stop is awaited) does not cut the wait short: the caller is already on its way out, and
    only the worker's stop, or the bound, may end it (rule 4)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not fut.done():
        left = deadline - loop.time()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(fut), left)
    return fut.done()


class StallSteps:
    """What a GPU attempt computes before its next event, in its kind's units (rule 3): told
    each event, it says what the next wait covers. This one: the whole request, every time."""

    def __init__(self, units: float) -> None:
        self.units = units  # before the next event

    @property
    def stop_units(self) -> float:
        """What a cancelled attempt's worker may still compute before it stops (rule 4): by
        default what comes before the next event."""
        return self.units

    def after(self, ev: RequestEvent) -> None:
        """An event came: what is computed before the next one."""


@dataclass(eq=False)
class _Job:
    rid: str
    nbytes: int
    enqueued_s: float
    future: asyncio.Future[_Dispatch]
    avoid_gpu: bool = False
    work: float = 1.0  # in its kind's unit (a request, seconds of audio), for the ETA
    returns: bool = False  # a failover that may go back to the GPU if the CPU lane does not start it (rule 3)


@dataclass(frozen=True)
class _Dispatch:
    worker: WorkerClient
    lane: str
    reason: Reason
    nbytes: int  # charged to the device (0 off the GPU)
    probe_round: int | None = None


@dataclass(eq=False)
class _Recovery:
    """A failover's time from the GPU fault to the CPU attempt's first result (its first
    vectors or segment, else its answer; a transcription's ``AudioInfo``, told once the audio
    is decoded, is not one), told to the replica's readiness once (rule 7)."""

    fault_at: float
    readiness: ReplicaReadiness
    told: bool = False

    def seen(self) -> None:
        if not self.told:
            self.told = True
            self.readiness.observe((time.monotonic() - self.fault_at) * 1000)

    def wrap(self, on_part: Callable[[RequestEvent], None] | None) -> Callable[[RequestEvent], None]:
        def part(ev: RequestEvent) -> None:
            if not isinstance(ev, AudioInfo):
                self.seen()
            if on_part is not None:
                on_part(ev)

        return part


@dataclass(frozen=True)
class Served:
    """A finished request: its worker's answer events (between Started and Done), where it
    was computed and after how many attempts."""

    parts: list[RequestEvent]
    done: Done
    lane: str
    reason: str
    attempts: int


@dataclass(frozen=True)
class ServiceStatistics:
    """A frozen snapshot of one service for /v1/status, /metrics and the status page."""

    name: str
    kind: str
    priority: str
    aliases: tuple[str, ...]
    where: str  # "gpu" | "cpu" | "none": where a request would start now
    why: str
    queued: int
    running: int
    eta_s: float
    served: dict[str, int]
    failovers: int
    shed: int  # requests refused at once because its queue was full
    breaker: str
    weights_bytes: int
    reserved_bytes: int
    device_bytes: int  # what it holds in the device ledger now: loaded weights and its requests'
    load_waiting: bool
    demoted: bool
    demotions: int
    promotions: int
    ladder: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    cpu_readiness: dict[str, Any] | None = None  # its CPU replica's readiness (None: no CPU path)


class DeviceService(abc.ABC):
    """One ``[[services]]`` entry of a unary kind (rules in the module docstring)."""

    kind = ""
    op = ""  # the worker op that runs one request

    def __init__(self, gw: Gateway, cfg: ServiceConfig) -> None:
        self.gw = gw
        self.cfg = cfg
        self.name = cfg.name
        self.model_dir = ""
        self.gpu: Supervisor | None = None
        self._model_read = False
        self.cpu: Supervisor | None = None
        self.queue: deque[_Job] = deque()
        self.breaker = BreakerState()
        self.breaker_policy = BreakerPolicy(**dataclasses.asdict(gw.cfg.breaker))
        self.served = {"gpu": 0, "cpu": 0}
        self.failovers = 0
        self.shed = 0
        self.promised: set[str] = set()  # requests being accepted that were promised a place
        self.load_waiting = False
        self.last_choice = ("none", "starting")
        self._rate = dict(self.initial_rate)  # running mean seconds per unit of work, per lane
        # Each lane's latest measured seconds a unit of work (``hold_place``'s refusal of a
        # deadline the request alone overruns: never on a guess, and at the fastest of them).
        self._fastest: dict[str, deque[float]] = {"gpu": deque(maxlen=FASTEST_KEPT), "cpu": deque(maxlen=FASTEST_KEPT)}
        # Seconds a stall unit per lane (rule 3's bound: the GPU's; rule 4's stop: each lane's),
        # measured or not: the CPU's first guess is the GPU's, as much slower as the initial rates say.
        cpu_slower = self.initial_rate["cpu"] / self.initial_rate["gpu"]
        self._stall_rate = {"gpu": self.initial_stall_rate, "cpu": self.initial_stall_rate * cpu_slower}
        self._stall_measured: set[str] = set()
        self._reserved: dict[str, int] = {}  # rid -> device bytes held by a running GPU attempt
        self._running_work: dict[str, float] = {}  # rid -> work of a dispatched attempt, for the ETA
        self.demoted = False
        self.demotions = 0
        self.promotions = 0
        self.ladder: list[dict[str, Any]] = []  # the last demotions and promotions, with their reason
        self._room_since: float | None = None
        self._promoted_s = -math.inf
        self._wake = asyncio.Event()
        self.readiness: ReplicaReadiness | None = None  # its CPU replica's (rule 7)
        self.host_lane: CpuLaneHost | None = None

    initial_rate = {"gpu": 0.05, "cpu": 0.1}
    work_is_size = False  # whether a request's ``work`` grows with it (a transcription's seconds), not 1 a request
    initial_stall_rate = 0.05  # GPU seconds a stall unit until measured (rule 3; a kind sets its own)
    stall_overhead_units = 0.0  # a request's fixed cost (the channel, a launch), in stall units

    def stall_units(self, msg: dict[str, Any], work: float) -> float:
        """What a GPU attempt's time grows with, in all (rule 3): its work, unless its kind knows better."""
        return work

    def stall_steps(self, msg: dict[str, Any], work: float) -> StallSteps:
        """What each wait for a GPU attempt's next event covers (rule 3)."""
        return StallSteps(self.stall_units(msg, work))

    def _measured(self, seconds: float, units: float, lane: str = "gpu") -> None:
        """An attempt of ``units`` on ``lane`` took ``seconds``. The first is the rate (the initial one is
        a guess); after it, a slower one is the rate at once, a faster one moves it a fifth of the
        way (rule 3: a bound errs long). The request's fixed cost counts as its kind's
        ``stall_overhead_units``: else a tiny request's rate, which is mostly that cost, would
        stretch every large one's bound many times over."""
        rate = seconds / max(units + self.stall_overhead_units, 1e-9)
        if lane in self._stall_measured and rate <= self._stall_rate[lane]:
            rate = 0.8 * self._stall_rate[lane] + 0.2 * rate
        self._stall_rate[lane] = rate
        self._stall_measured.add(lane)

    def _next_event_s(self, lane: str, units: float, slots: int) -> float:
        """The longest ``units`` of work may take on ``lane`` before their next event: the lane's
        measured seconds a unit (the fixed cost counted), times ``STALL_FACTOR`` and the ``slots``
        sharing the worker (rule 3's stall bound and rule 4's stop wait both start from it)."""
        expected = self._stall_rate[lane] * (units + self.stall_overhead_units)
        return STALL_FACTOR * expected * slots

    def stall_bound_s(self, units: float, slots: int) -> float:
        """How long a GPU attempt of ``units`` on a worker running up to ``slots`` requests at once
        may go without an event before it is a stall (rule 3)."""
        return max(self.gw.cfg.failover.stall_timeout_s, self._next_event_s("gpu", units, slots))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} queued={len(self.queue)} breaker={self.breaker.circuit.value}>"

    # -- life -------------------------------------------------------------------------
    @abc.abstractmethod
    async def load_model(self) -> None:
        """Read the kind's model (sets ``model_dir`` and what ``weights_bytes`` needs)."""

    @abc.abstractmethod
    def weights_bytes(self) -> int:
        """The device bytes its GPU worker's weights take (its kind's memory model)."""

    @abc.abstractmethod
    def probe_bytes(self) -> int:
        """The device bytes of a small request: where one would start now, for /v1/status."""

    def spec_fields(self) -> dict[str, Any]:
        """Kind-specific ``WorkerSpec`` fields."""
        return {}

    def host_weights_bytes(self) -> int:
        """The host bytes its CPU replica's loaded model takes (the device figure by default)."""
        return self.weights_bytes()

    async def read_model(self) -> None:
        """Read the model (once: the gateway reads every service's before the chat models plan
        their device room, ``Gateway.held_beside``). A model it cannot read is a ConfigError
        naming the service."""
        if self._model_read:
            return
        try:
            await self.load_model()
        except Exception as exc:
            where = self.model_dir or self.cfg.path or "its packaged model"
            raise ConfigError.unreadable(f"{self.kind} service {self.name!r}", where, exc) from exc
        self._model_read = True

    def keeps_device_weights(self, *, by_interactive: bool) -> bool:
        """Whether its GPU weights stay on the device whatever a chat model needs: it runs a
        GPU worker, and it is no batch service with a CPU path that such a chat may demote
        (rule 6)."""
        if not self.cfg.gpu:
            return False
        demotable = (
            by_interactive
            and self.cfg.priority == "batch"
            and self.cfg.cpu != "none"
            and self.gw.cfg.admission.demote_batch_services
        )
        return not demotable

    async def start(self) -> None:
        """Read the model, start its workers' supervisors and its pump (owned by the gateway's loops)."""
        await self.read_model()
        gw = self.gw
        if self.cfg.gpu and gw.device is not None and gw.ledger is not None:
            spec = self._spec("gpu", gw.device.spec)
            self.gpu = Supervisor(
                spec,
                gw.cfg.supervisor,
                device=gw.device,
                on_change=self._worker_event,
                before_start=functools.partial(
                    gw.reserve_weights, nbytes=self.weights_bytes(), on_wait=self._load_waits
                ),
            )
        if self.cfg.cpu == "replica" and not self.cfg.cpu_readiness:  # loaded at start and kept (rule 7)
            self.cpu = Supervisor(self._spec("cpu", "cpu"), gw.cfg.supervisor, on_change=self._worker_event)
        elif self.cfg.cpu == "replica":
            mode, budget = gw.cfg.service_readiness(self.cfg)
            self.readiness = ReplicaReadiness(
                mode,
                budget,
                lambda: self.cpu.worker if self.cpu is not None else None,
                weights_bytes=self.host_weights_bytes(),
                context_bytes=0,
                alone=self.gpu is None,
            )
            self.host_lane = gw.host.add_replica(
                self.readiness.worker, weights_bytes=self.host_weights_bytes(), readiness=self.readiness
            )
            spec = dataclasses.replace(self._spec("cpu", "cpu"), readiness=self.readiness.initial_mode())
            self.cpu = Supervisor(spec, gw.cfg.supervisor, on_change=self._worker_event)
        for sup in self.supervisors():
            gw.loops.add(f"sup-{sup.worker.spec.worker_id}", sup.run)
        gw.loops.add(f"pump-{self.name}", self._pump_loop)

    def supervisors(self) -> list[Supervisor]:
        return [s for s in (self.gpu, self.cpu) if s is not None]

    def _spec(self, lane: str, device: str) -> WorkerSpec:
        fields: dict[str, Any] = {"n_ctx": 512, "n_batch": self.cfg.batch_size} | self.spec_fields()
        return WorkerSpec(
            worker_id=f"{self.name}-{lane}",
            lane=lane,
            device=device,
            model_path=self.model_dir,
            state_dir=str(self.gw.cfg.state_path()),
            slots=self.cfg.gpu_slots if lane == "gpu" else self.cfg.cpu_slots,
            n_threads=self.cfg.n_threads,
            weights_bytes=self.weights_bytes() if device.startswith("sim") else 0,
            kind=self.kind,
            **fields,
        )

    def _load_waits(self, waiting: bool) -> None:
        """Rule 1: its GPU worker's load waits for room (its requests go to the CPU path)."""
        self.load_waiting = waiting
        self.kick()

    def _worker_event(self, worker: WorkerClient, ev: SupervisorEvent) -> None:
        self.gw.worker_event(worker, ev)
        self.kick()

    # -- requests ---------------------------------------------------------------------
    def hold_place(self, rid: str, *, nbytes: int = 0, work: float = 1.0, deadline_s: float | None = None) -> None:
        """Promise request ``rid``, about to be accepted, a place; 503 at once when the queue
        is full or every place left (queue room and free slots) is promised already, or when
        the lane it would start on now cannot finish it within ``deadline_s`` seconds (rule 2).
        The promise ends when its job is queued or ``release_place``. Refused at once while no
        worker can start (rule 8)."""
        if (failed := self.cannot_start()) is not None:
            raise failed
        now = time.monotonic()
        if places_promised(self.cfg.queue_depth, len(self.queue), len(self.promised), self._takers(nbytes, now)):
            self.shed += 1
            raise QueueFull(
                f"the {self.name} queue is full ({self.cfg.queue_depth} waiting)", retry_after_s=self.eta_s(work)
            )
        if deadline_s is not None:
            lane = place(self._view(nbytes, False, now)).lane
            lane = "gpu" if lane == "gpu" or self.cpu is None else "cpu"  # waiting: the CPU path is its way out
            eta = self.lane_eta_s(lane, work)
            lanes = [name for name, sup in (("gpu", self.gpu), ("cpu", self.cpu)) if sup is not None]
            fastest = [min(self._fastest[name]) for name in lanes if self._fastest[name]]
            alone = work * min(fastest) if self.work_is_size and len(fastest) == len(lanes) else 0.0
            if alone > deadline_s:  # even the faster path at its fastest, with nothing ahead: a retry is in vain
                raise DeadlineTooShort(
                    f"the {self.name} service's faster path would take about {alone:.1f}s for this request alone,"
                    f" with nothing ahead of it, longer than its deadline ({deadline_s:.1f}s)"
                )
            if eta > deadline_s:
                raise CapacityError(
                    f"the {self.name} {lane.upper()} path would finish this request in "
                    f"about {eta:.1f}s, after its deadline ({deadline_s:.1f}s)",
                    retry_after_s=eta,
                    code="deadline_exceeded",
                )
        self.promised.add(rid)

    def cannot_start(self) -> NoWorkerReady | None:
        """Rule 8 (``runtime.supervisor.cannot_start``)."""
        return cannot_start(f"the {self.name} service", self.supervisors())

    def release_place(self, rid: str) -> None:
        """Request ``rid`` no longer needs the place it was promised (idempotent)."""
        self.promised.discard(rid)

    async def serve(
        self,
        rid: str,
        msg: dict[str, Any],
        *,
        nbytes: int,
        work: float,
        attempt: int,
        on_move: Callable[[str, dict[str, Any]], Awaitable[None]],
        on_part: OnPart | None = None,
    ) -> Served:
        """Run request ``rid`` (its worker op's fields ``msg``, ``nbytes`` of device memory on
        the GPU): dispatch, run, and replay on the CPU path after a GPU failure (rule 3).
        ``on_move(state, fields)`` journals each step; ``on_part`` sees each answer event as
        it arrives (for a stream), with the attempt's lane, reason and number. A failure
        that is the request's own (``bad_audio``) is raised at once as ``request_error`` makes it."""
        fault: str | None = None
        fault_at = 0.0
        returned = False  # a failover went back to the GPU this run (rule 3: once)
        max_attempts = self.gw.cfg.failover.max_attempts + attempt  # this run's, after the earlier runs'
        while True:
            attempt += 1
            returns = fault is not None and fault != "stall" and not returned and attempt < max_attempts
            d = await self._dispatch(rid, nbytes, work, avoid_gpu=fault is not None, returns=returns)
            returned = returned or (fault is not None and d.lane == "gpu")
            reason = str(FailoverReason(fault)) if fault else str(d.reason)
            recovery = self._recovery(fault_at) if fault is not None and d.lane == "cpu" else None
            try:  # the lease is ours from here: released once, however the attempt ends (rule 4)
                await on_move("admitted", {"route": d.lane, "attempts": attempt, "reason": reason})
                part = functools.partial(on_part, lane=d.lane, reason=reason, attempt=attempt) if on_part else None
                got = await self._run_on(
                    d, rid, msg, work, on_move, recovery.wrap(part) if recovery else part, attempt=attempt
                )
            finally:
                self._release(rid, d)
            if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], Done):
                if recovery is not None:  # no answer event came before it: the answer is the first result
                    recovery.seen()
                self.served[d.lane] += 1
                return Served(got[0], got[1], d.lane, reason, attempt)
            kind, message = got
            self.request_error(kind, message)
            if d.lane != "gpu" or self.cpu is None or attempt >= max_attempts or not self.gw.budget.take():
                raise WorkerFailed(f"the {d.lane} worker failed this request ({kind}: {message})", retry_after_s=1.0)
            fault, fault_at = kind, time.monotonic()
            self.failovers += 1
            self.gw.metrics.failovers.labels(kind).inc()
            await on_move("queued", {"route": "cpu", "reason": str(FailoverReason(kind)), "attempts": attempt})

    def _recovery(self, fault_at: float) -> _Recovery | None:
        return _Recovery(fault_at, self.readiness) if self.readiness is not None else None

    def request_error(self, kind: str, message: str) -> None:
        """Raise the client's error for a failure that is the request's own (not the lane's:
        no failover would help); return for the rest. Every failure is the lane's by default."""
        return None

    async def _dispatch(
        self, rid: str, nbytes: int, work: float, *, avoid_gpu: bool, returns: bool = False
    ) -> _Dispatch:
        loop = asyncio.get_running_loop()
        job = _Job(rid, nbytes, time.monotonic(), loop.create_future(), avoid_gpu, work, returns)
        self.release_place(rid)  # its job takes the place it was promised
        self.queue.append(job)
        self.pump_once()
        try:
            return await job.future
        except asyncio.CancelledError:
            # Dispatched (slot claimed, bytes reserved) just as its request was cancelled:
            # nobody will run it, so its lease goes back here (rule 4).
            f = job.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self._release(rid, f.result())
            raise
        finally:
            if job in self.queue:
                self.queue.remove(job)

    async def _run_on(
        self,
        d: _Dispatch,
        rid: str,
        msg: dict[str, Any],
        work: float,
        on_move: Callable[[str, dict[str, Any]], Awaitable[None]],
        on_part: Callable[[RequestEvent], None] | None = None,
        *,
        attempt: int = 1,
    ) -> tuple[list[RequestEvent], Done] | tuple[str, str]:
        """One attempt (number ``attempt`` of its request): its answer events and Done, or the
        failure (kind, message). Its RUNNING move says its route and attempt, as chat's does.
        Cancellation stops the worker and waits (bounded) until it has let go of the request
        (rule 4)."""
        t0 = time.monotonic()
        parts: list[RequestEvent] = []
        steps = self.stall_steps(msg, work)  # what the next event covers: the stall bound (GPU), the stop's (rule 4)
        events = d.worker.request(self.op, {"rid": rid, **msg, "reserve_bytes": d.nbytes})
        watchdog, pending = Watchdog(), functools.partial(d.worker.has_event, rid)  # its rule 4: no lost event
        try:
            while True:
                # No stall bound on the CPU lane: only the GPU's next event is timed (rule 3).
                bound = self.stall_bound_s(steps.units, d.worker.spec.slots) if d.lane == "gpu" else None
                try:
                    async with watchdog.guard(bound, pending) if bound is not None else contextlib.nullcontext():
                        ev = await anext(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    return await self._stalled(d, rid, bound)
                steps.after(ev)
                if isinstance(ev, Progress):
                    continue
                if isinstance(ev, Started):
                    if d.lane == "gpu" and self.gw.ledger is not None:
                        self.gw.ledger.confirm(rid, time.monotonic())
                    await on_move("running", {"route": d.lane, "attempts": attempt})
                elif isinstance(ev, Done):
                    took = time.monotonic() - t0
                    self._note(d, "ok", took / max(work, 1e-3))
                    self._measured(took, self.stall_units(msg, work), d.lane)
                    return (parts, ev)
                elif isinstance(ev, Failed):  # the request's own fault (bad audio) says nothing of the GPU
                    self._note(d, fault_outcome(ev.kind), 0.0)
                    return (ev.kind, ev.message)
                elif isinstance(ev, WorkerGone):  # killed for a hang: a stall, as chat counts it
                    hung = ev.kind == "hung"
                    self._note(d, "failed" if hung else "severe", 0.0)
                    return ("stall" if hung else ev.kind, ev.message)
                elif isinstance(ev, Interrupted):
                    raise RequestCancelled(f"request {rid} was cancelled")
                else:
                    parts.append(ev)
                    if on_part is not None:
                        on_part(ev)
            return ("exited", "the worker channel ended")
        except BaseException:
            d.worker.interrupt(rid)
            await self._until_stopped(d, rid, self.stop_bound_s(d, steps.stop_units))
            self._note(d, "cancelled", 0.0)
            raise
        finally:
            watchdog.close()
            await events.aclose()

    async def _stalled(self, d: _Dispatch, rid: str, bound: float | None) -> tuple[str, str]:
        """Rule 3: no event of a GPU attempt for ``bound`` seconds. Its worker is killed (its
        supervisor restarts it) and its exit awaited (rule 4: the lease goes back after), and the
        attempt fails with ``stall``, which the CPU path replays."""
        self._note(d, "failed", 0.0)  # as chat counts a stall for the breaker
        stopped = d.worker.when_stopped(rid)
        await self.gw.kill_worker(d.worker, "no progress")
        if stopped is not None:  # a cancel meanwhile (a DELETE) goes on up: the request ends, no replay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stopped), self.gw.cfg.supervisor.health_timeout_s)
        return ("stall", f"no progress on the GPU for {bound:.1f}s")

    def stop_bound_s(self, d: _Dispatch, units: float) -> float:
        """How long a cancelled attempt's worker may take to stop (rule 4): as long as its next
        event may take, ``units`` of its kind's work away (it looks for the cancel between
        events), at its lane's measured seconds a unit, times ``STALL_FACTOR`` and the worker's
        slots; within ``STOP_WAIT_S`` and ``STOP_WAIT_MAX_S``. A fixed 5 s killed a transcription
        worker busy with one 30 s window under load, and with it every other request it ran (a
        stall, failed over and replayed whole: round 31); the ceiling keeps a hung worker from
        holding the request, and its slot, for long (the units can be a whole file's audio)."""
        return min(STOP_WAIT_MAX_S, max(STOP_WAIT_S, self._next_event_s(d.lane, units, d.worker.spec.slots)))

    async def _until_stopped(self, d: _Dispatch, rid: str, within_s: float) -> None:
        """Rule 4: the lease goes back only once the worker has let go of the request. One that
        does not stop ``within_s`` (a hang) is killed, and its exit is awaited."""
        stopped = d.worker.when_stopped(rid)
        if stopped is None or await _settles(stopped, within_s):
            return
        self.gw.note_event(d.worker.spec.worker_id, f"did not stop {rid} within {within_s:.1f}s: killing it")
        await d.worker.kill("hung")
        await _settles(stopped, self.gw.cfg.supervisor.health_timeout_s)

    def _note(self, d: _Dispatch, outcome: str, rate: float) -> None:
        """Feed the breaker (GPU) and the ETA (``rate``: seconds per unit of work)."""
        if outcome == "ok":
            self._rate[d.lane] = 0.8 * self._rate[d.lane] + 0.2 * rate
            self._fastest[d.lane].append(rate)
        if d.lane == "gpu":
            self.breaker = attempt_ended(self.breaker, outcome, d.probe_round, time.monotonic(), self.breaker_policy)

    def _release(self, rid: str, d: _Dispatch) -> None:
        """Rule 4: the attempt's slot and device reservation go back, once."""
        d.worker.release_slot(rid)
        ledger = self.gw.ledger
        if d.lane == "gpu" and ledger is not None and ledger.holds(rid):
            ledger.release(rid, time.monotonic())
        self._reserved.pop(rid, None)
        self._running_work.pop(rid, None)
        self.gw.kick_scheduler()
        self.kick()

    # -- the pressure ladder (rule 6) -----------------------------------------------------
    def _holds_weights(self) -> bool:
        """Whether the device ledger holds its GPU worker's weights (loaded, or still unloading)."""
        ledger = self.gw.ledger
        return self.gpu is not None and ledger is not None and ledger.holds(self.gpu.worker.spec.weights_holder)

    def device_bytes(self) -> int:
        """What it holds in the device ledger now: its GPU weights (loaded, loading or still
        unloading) and its running requests' reservations."""
        ledger = self.gw.ledger
        if ledger is None or self.gpu is None:
            return 0
        return ledger.held_bytes(self.gpu.worker.spec.weights_holder) + sum(self._reserved.values())

    def demotable_bytes(self) -> int | None:
        """Its GPU weights when it may be demoted now (batch, loaded, idle), else None."""
        g = self.gpu.worker if self.gpu is not None else None
        if self.cfg.priority != "batch" or g is None or self.demoted or self.cpu is None:
            return None  # a service without a CPU path is never demoted: its requests need a lane
        if time.monotonic() - self._promoted_s < self.gw.cfg.admission.promote_after_s:
            return None  # just promoted: it stays at least as long as it had to wait (no flapping)
        if g.state is not WorkerState.READY or g.busy > 0 or not self._holds_weights():
            return None
        if not self.gw.cfg.admission.demote_batch_services:
            return None
        return self.weights_bytes()

    def demoting_bytes(self) -> int:
        """Weights of a demotion under way (not yet given back)."""
        if self.demoted and self._holds_weights():
            return self.weights_bytes()
        return 0

    def demote(self, why: str) -> bool:
        """Unload the GPU worker for interactive work (rule 6); False when it may not be now."""
        if self.demotable_bytes() is None or self.gpu is None:
            return False
        self.demoted = True  # placement stops sending work to the GPU at once (no await before)
        self._room_since = None
        self.demotions += 1
        self._ladder_event("demoted", why)
        self.gw.loops.spawn(f"demote-{self.name}", self.gpu.park(f"demoted: {why}"))
        return True

    def _promote_if_due(self, now: float) -> None:
        ledger = self.gw.ledger
        if not self.demoted or self.gpu is None or ledger is None:
            return
        if self._holds_weights():
            return  # still unloading
        a = self.gw.cfg.admission
        due, self._room_since = promote_due(
            headroom_bytes=ledger.headroom(now),
            weights_bytes=self.weights_bytes(),
            reserve_bytes=a.promote_headroom_mib * 1024 * 1024,
            low_since_s=self._room_since,
            now_s=now,
            hold_s=a.promote_after_s,
        )
        if due:
            self.demoted = False
            self._promoted_s = now
            self.promotions += 1
            why = f"its weights fitted with {a.promote_headroom_mib} MiB to spare for {a.promote_after_s:.0f}s"
            self._ladder_event("promoted", why)
            self.gpu.resume(f"promoted: {why}")

    def _ladder_event(self, event: str, why: str) -> None:
        self.ladder.append({"t_s": round(time.monotonic() - self.gw.started_s, 3), "event": event, "reason": why})
        del self.ladder[:-20]
        self.gw.metrics.service_ladder.labels(self.name, event).inc()
        self.gw.note_event(f"{self.name}-gpu", f"{event}: {why}")
        if self.gw.journal is not None:
            self.gw.loops.spawn(f"journal-{event}-{self.name}", self._journal_event(event, why))
        self.kick()

    async def _journal_event(self, event: str, why: str) -> None:
        assert self.gw.journal is not None
        try:
            await self.gw.journal.record_service_event(self.name, event, why)
        except Exception as exc:  # a full disk: the event is still counted and shown
            log.warning("%s: could not journal %s: %s", self.name, event, exc)

    # -- the pump -----------------------------------------------------------------------
    def kick(self) -> None:
        self._wake.set()

    async def _pump_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                self.pump_once()
                self._promote_if_due(time.monotonic())
            except Exception:
                log.exception("%s: pump pass failed", self.name)
            with contextlib.suppress(TimeoutError):  # a safety net, on the shared tick (``runtime.ticks`` rule 4)
                async with asyncio.timeout_at(ticks.at(IDLE_WAKE_S)):
                    await self._wake.wait()

    def _view(self, nbytes: int, avoid_gpu: bool, now: float) -> PlacementView:
        g = self.gpu.worker if self.gpu is not None else None
        c = self.cpu.worker if self.cpu is not None else None
        ledger = self.gw.ledger
        host_ok = True
        if c is not None and self.gw.cfg.device.host_guard and self.gw.host.observed_bytes:
            host_ok = self.gw.host.observed_bytes < self.gw.host.budget_bytes
            if host_ok and self.host_lane is not None:  # rule 7: an unloaded replica loads its model
                host_ok = self.gw.host.load_allowed(self.host_lane)
        return PlacementView(
            gpu_configured=g is not None,
            gpu_ready=g is not None and g.state is WorkerState.READY,
            gpu_free_slots=g.free_slots if g is not None else 0,
            breaker_allows=allows(self.breaker, self.breaker_policy),
            headroom_bytes=ledger.headroom(now) if ledger is not None else None,
            nbytes=nbytes,
            cpu_ready=c is not None and c.state is WorkerState.READY,
            cpu_free_slots=c.free_slots if c is not None else 0,
            host_allows=host_ok,
            avoid_gpu=avoid_gpu,
            demoted=self.demoted,
        )

    def pump_once(self) -> None:
        """Expire old jobs; start each queued job on the first lane that can take it (rule 2)."""
        now = time.monotonic()
        self.breaker = advance(self.breaker, BreakerEvent.TICK, now, self.breaker_policy)
        for job in [j for j in self.queue if j.future.done()]:
            self.queue.remove(job)
        for job in [j for j in self.queue if now - j.enqueued_s > self.cfg.queue_max_age_s]:
            self.queue.remove(job)
            job.future.set_exception(
                CapacityError(
                    f"waited {self.cfg.queue_max_age_s:.0f}s for a {self.name} worker"
                    + (HOST_SHORT_WORDS if self.last_choice[1] == Reason.HOST_BUDGET else ""),
                    retry_after_s=self.eta_s(job.work),
                    code="queue_timeout",
                )
            )
            job.future.exception()
        if self.queue and self.cannot_start() is not None:  # rule 8
            for job in self.queue:
                if not job.future.done() and (failed := self.cannot_start()) is not None:
                    job.future.set_exception(failed)
                    job.future.exception()
            self.queue.clear()
        for job in list(self.queue):
            choice = place(self._view(job.nbytes, job.avoid_gpu and not self._may_return(job, now), now))
            self.last_choice = (choice.lane, str(choice.reason))
            if choice.lane == "wait":
                continue
            worker = self.gpu.worker if choice.lane == "gpu" and self.gpu else self.cpu.worker if self.cpu else None
            assert worker is not None
            probe_round = None
            if choice.lane == "gpu":
                assert self.gw.ledger is not None
                if self.gw.ledger.reserve_nowait(job.rid, job.nbytes, now) is None:
                    continue
                self._reserved[job.rid] = job.nbytes
                self.breaker, probe_round = probe_started(self.breaker, now, self.breaker_policy)
                self.gw.kick_scheduler()  # chat admission sees the bytes at once
            worker.claim_slot(job.rid)
            self._running_work[job.rid] = job.work
            self.queue.remove(job)
            nbytes = job.nbytes if choice.lane == "gpu" else 0
            job.future.set_result(_Dispatch(worker, choice.lane, choice.reason, nbytes, probe_round))

    def _may_return(self, job: _Job, now: float) -> bool:
        """Rule 3: whether a failover the CPU lane has not started within admission's
        ``delay_max_s`` (at least ``RETURN_AFTER_MIN_S``) may go back to the GPU, as chat's
        does (``Scheduler._may_move``): its slots busy or the host guard holding it, it waited
        there until its queue_timeout while the restarted GPU worker stood idle (round 28)."""
        return job.returns and now - job.enqueued_s >= max(self.gw.cfg.admission.delay_max_s, RETURN_AFTER_MIN_S)

    def _takers(self, nbytes: int, now: float) -> int:
        """How many queued jobs of ``nbytes`` could start at once: the GPU's free slots only
        while it could take one (its breaker, its room), the CPU's while the host has room
        (round 28: an open breaker's free slots let the queue grow past ``queue_depth``)."""
        v = self._view(nbytes, False, now)
        gpu = v.gpu_free_slots if place(v).gpu_reason is Reason.FITS else 0
        return gpu + (v.cpu_free_slots if v.cpu_ready and v.host_allows else 0)

    def _free_slots(self) -> int:
        return sum(s.worker.free_slots for s in self.supervisors())

    def eta_s(self, work: float = 1.0) -> float:
        """Seconds until a request of ``work`` queued now would likely start and end: the work
        queued ahead of it spread over the lanes' slots at their measured speed (never under 1 s)."""
        slots = sum(s.worker.spec.slots for s in self.supervisors() if s.worker.state is WorkerState.READY)
        per = min(self._rate.values())
        return max(1.0, math.ceil((self._queued_work() + work) / max(1, slots)) * per * 2)

    def lane_eta_s(self, lane: str, work: float) -> float:
        """Rule 2: seconds until a request of ``work`` would end on ``lane`` alone: its queue
        share and the work running there, at that lane's measured speed."""
        sup = self.gpu if lane == "gpu" else self.cpu
        if sup is None:
            return math.inf
        slots = max(1, sup.worker.spec.slots)
        ahead = self._queued_work() + sum(w for rid, w in self._running_work.items() if rid in sup.worker.claimed)
        return (ahead / slots + work) * self._rate[lane]

    def _queued_work(self) -> float:
        return sum(j.work for j in self.queue)

    def statistics(self) -> ServiceStatistics:

        lane, why = self.last_choice
        if not self.queue:  # nothing waits: say where a request would start now
            c = place(self._view(self.probe_bytes(), False, time.monotonic()))
            lane, why = c.lane, str(c.reason if c.lane != "cpu" else c.gpu_reason)
        return ServiceStatistics(
            name=self.name,
            kind=self.kind,
            priority=self.cfg.priority,
            aliases=tuple(self.cfg.aliases),
            where="none" if lane == "wait" and not self._free_slots() else lane,
            why=why,
            queued=len(self.queue),
            running=sum(s.worker.busy for s in self.supervisors()),
            eta_s=round(self.eta_s(), 3),
            served=dict(self.served),
            failovers=self.failovers,
            shed=self.shed,
            breaker=self.breaker.circuit.value,
            weights_bytes=self.weights_bytes() if self.model_dir else 0,
            reserved_bytes=sum(self._reserved.values()),
            device_bytes=self.device_bytes(),
            load_waiting=self.load_waiting,
            demoted=self.demoted,
            demotions=self.demotions,
            promotions=self.promotions,
            ladder=list(self.ladder),
            workers=[s.status_row() for s in self.supervisors()],
            cpu_readiness=self.readiness.status() if self.readiness is not None else None,
        )
