"""The embeddings service: its workers on the one device and on the CPU, its queue, and the
run of one request from dispatch to vectors.

Rules:

1. Its GPU worker charges the gateway's one ``DeviceLedger`` (the chat model's too): the
   weights when it loads (a load that does not fit waits, and its requests go to the CPU
   path meanwhile; never a load into an OOM), and each request's predicted bytes
   (``core.embed_memory``) before it starts. Chat admission sees those bytes at once.
2. A queued request starts on whichever lane can start it first, the GPU preferred
   (``core.placement``: late binding). The queue is bounded (503 at once when full) and a
   request waits at most ``queue_max_age_s``.
3. A request that fails on the GPU (the worker died, an allocation failed, an OOM) is
   replayed on the CPU path at its request boundary: nothing of it was delivered, and the
   same inputs give the same vectors (``engine.embedder`` rule 2). Attempts are bounded by
   ``[failover].max_attempts`` and the gateway's retry budget.
4. Each attempt's lease (worker slot + device reservation) is released exactly once, when
   the worker has stopped working on it (its last event, or its exit), however the
   attempt ends (done, error, cancel).
5. A breaker per GPU worker (``core.breaker``) takes the GPU out of placement after
   repeated failures, as for chat.
6. The pressure ladder: a batch-priority service whose GPU worker is idle may be demoted
   for an interactive request that does not fit (chat admission's ``Demote``). Demoted, its
   requests go to its CPU path (reason ``demoted``) and its GPU worker is unloaded; it is
   never demoted with work in flight on the GPU, nor without a CPU path. It is promoted back
   once its weights have fitted with room to spare for ``promote_after_s``
   (``core.placement.promote_due``), and not demoted again for as long (no flapping).
   Both are journaled, counted in /metrics and shown in /v1/status with their reason.
"""

from __future__ import annotations

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
from spillover.core.embed_memory import EmbedMemoryModel
from spillover.core.placement import PlacementView, place, promote_due
from spillover.core.reasons import FailoverReason, Reason
from spillover.errors import CapacityError, QueueFull, RequestCancelled, WorkerFailed
from spillover.runtime.events import Done, Failed, Interrupted, Started, SupervisorEvent, Vectors, WorkerGone
from spillover.runtime.lanes import places_promised
from spillover.runtime.supervisor import Supervisor
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from spillover.engine.embedder import EmbedModelInfo, EmbedTokenizer
    from spillover.runtime.gateway import Gateway

__all__ = ["EmbedResult", "EmbeddingsService", "ServiceStatistics"]

log = logging.getLogger("spillover.embeddings")
IDLE_WAKE_S = 0.5
STOP_WAIT_S = 5.0  # longest a cancelled attempt waits for its worker to stop before the lease goes back


@dataclass(eq=False)
class _Job:
    rid: str
    nbytes: int
    enqueued_s: float
    future: asyncio.Future[_Dispatch]
    avoid_gpu: bool = False


@dataclass(frozen=True)
class _Dispatch:
    worker: WorkerClient
    lane: str
    reason: Reason
    nbytes: int  # charged to the device (0 off the GPU)
    probe_round: int | None = None


@dataclass(frozen=True)
class EmbedResult:
    """A finished request's vectors and where they were computed."""

    data: bytes  # n x dim float32, little-endian
    n: int
    dim: int
    lane: str
    reason: str
    attempts: int
    prompt_tokens: int


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


class EmbeddingsService:
    """One ``[[services]]`` entry of kind ``embeddings`` (rules in the module docstring)."""

    kind = "embeddings"

    def __init__(self, gw: Gateway, cfg: ServiceConfig) -> None:
        self.gw = gw
        self.cfg = cfg
        self.name = cfg.name
        self.model_dir = ""
        self.info: EmbedModelInfo | None = None
        self.tokenizer: EmbedTokenizer | None = None
        self.memory: EmbedMemoryModel | None = None
        self.gpu: Supervisor | None = None
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
        self._seconds = {"gpu": 0.05, "cpu": 0.1}  # running mean per request, for the ETA
        self._reserved: dict[str, int] = {}  # rid -> device bytes held by a running GPU attempt
        self.demoted = False
        self.demotions = 0
        self.promotions = 0
        self.ladder: list[dict[str, Any]] = []  # the last demotions and promotions, with their reason
        self._room_since: float | None = None
        self._promoted_s = -math.inf
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return f"<EmbeddingsService {self.name} queued={len(self.queue)} breaker={self.breaker.circuit.value}>"

    # -- life -------------------------------------------------------------------------
    async def start(self) -> None:
        """Read the model, start its workers' supervisors and its pump (owned by the gateway's loops)."""
        from spillover.engine.embedder import EmbedTokenizer, default_embed_model_dir, read_embed_model_info

        self.model_dir = self.cfg.path or await asyncio.to_thread(default_embed_model_dir)
        self.info = await asyncio.to_thread(read_embed_model_info, self.model_dir, self.name)
        self.tokenizer = await asyncio.to_thread(EmbedTokenizer, self.model_dir)
        self.memory = EmbedMemoryModel(self.info, fragmentation_ratio=self.gw.cfg.admission.fragmentation_ratio)
        gw = self.gw
        if self.cfg.gpu and gw.device is not None and gw.ledger is not None:
            spec = self._spec("gpu", gw.device.spec)
            self.gpu = Supervisor(
                spec,
                gw.cfg.supervisor,
                device=gw.device,
                on_change=self._worker_event,
                before_start=functools.partial(
                    gw.reserve_weights, nbytes=self.memory.weights_bytes(), on_wait=self._load_waits
                ),
            )
        if self.cfg.cpu == "replica":
            self.cpu = Supervisor(self._spec("cpu", "cpu"), gw.cfg.supervisor, on_change=self._worker_event)
        for sup in self.supervisors():
            gw.loops.add(f"sup-{sup.worker.spec.worker_id}", sup.run)
        gw.loops.add(f"pump-{self.name}", self._pump_loop)

    def supervisors(self) -> list[Supervisor]:
        return [s for s in (self.gpu, self.cpu) if s is not None]

    def _spec(self, lane: str, device: str) -> WorkerSpec:
        assert self.memory is not None
        return WorkerSpec(
            worker_id=f"{self.name}-{lane}",
            lane=lane,
            device=device,
            model_path=self.model_dir,
            state_dir=str(self.gw.cfg.state_path()),
            slots=self.cfg.gpu_slots if lane == "gpu" else self.cfg.cpu_slots,
            n_ctx=self.info.max_tokens if self.info else 512,
            n_threads=self.cfg.n_threads,
            n_batch=self.cfg.batch_size,
            weights_bytes=self.memory.weights_bytes() if device.startswith("sim") else 0,
            kind="embeddings",
            batch_size=self.cfg.batch_size,
        )

    def _load_waits(self, waiting: bool) -> None:
        """Rule 1: its GPU worker's load waits for room (its requests go to the CPU path)."""
        self.load_waiting = waiting
        self.kick()

    def _worker_event(self, worker: WorkerClient, ev: SupervisorEvent) -> None:
        self.gw.worker_event(worker, ev)
        self.kick()

    # -- requests ---------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        assert self.tokenizer is not None
        return self.tokenizer.encode(texts)

    def hold_place(self, rid: str) -> None:
        """Promise request ``rid``, about to be accepted, a place; 503 at once when the queue
        is full or every place left (queue room and free slots) is promised already (rule 2).
        The promise ends when its job is queued or ``release_place``."""
        if places_promised(self.cfg.queue_depth, len(self.queue), len(self.promised), self._free_slots()):
            self.shed += 1
            raise QueueFull(
                f"the {self.name} queue is full ({self.cfg.queue_depth} waiting)", retry_after_s=self.eta_s()
            )
        self.promised.add(rid)

    def release_place(self, rid: str) -> None:
        """Request ``rid`` no longer needs the place it was promised (idempotent)."""
        self.promised.discard(rid)

    def predicted_bytes(self, inputs: list[list[int]]) -> int:
        assert self.memory is not None
        return self.memory.request_bytes([len(ids) for ids in inputs], self.cfg.batch_size)

    async def embed(
        self,
        rid: str,
        inputs: list[list[int]],
        *,
        attempt: int,
        on_move: Callable[[str, dict[str, Any]], Awaitable[None]],
    ) -> EmbedResult:
        """Compute ``inputs`` (wrapped ids): dispatch, run, and replay on the CPU path after a
        GPU failure (rule 3). ``on_move(state, fields)`` journals each step."""
        nbytes = self.predicted_bytes(inputs)
        fault: str | None = None
        max_attempts = self.gw.cfg.failover.max_attempts
        while True:
            attempt += 1
            d = await self._dispatch(rid, nbytes, avoid_gpu=fault is not None)
            reason = str(FailoverReason(fault)) if fault else str(d.reason)
            try:  # the lease is ours from here: released once, however the attempt ends (rule 4)
                await on_move("admitted", {"route": d.lane, "attempts": attempt, "reason": reason})
                got = await self._run_on(d, rid, inputs, on_move)
            finally:
                self._release(rid, d)
            if isinstance(got, Vectors):
                self.served[d.lane] += 1
                return EmbedResult(got.data, got.n, got.dim, d.lane, reason, attempt, sum(len(i) for i in inputs))
            kind, message = got
            if d.lane != "gpu" or self.cpu is None or attempt >= max_attempts or not self.gw.budget.take():
                raise WorkerFailed(f"the {d.lane} worker failed this request ({kind}: {message})", retry_after_s=1.0)
            fault = kind
            self.failovers += 1
            self.gw.metrics.failovers.labels(kind).inc()
            await on_move("queued", {"route": "cpu", "reason": str(FailoverReason(kind)), "attempts": attempt})

    async def _dispatch(self, rid: str, nbytes: int, *, avoid_gpu: bool) -> _Dispatch:
        job = _Job(rid, nbytes, time.monotonic(), asyncio.get_running_loop().create_future(), avoid_gpu)
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
        inputs: list[list[int]],
        on_move: Callable[[str, dict[str, Any]], Awaitable[None]],
    ) -> Vectors | tuple[str, str]:
        """One attempt: the vectors, or the failure (kind, message). Cancellation stops the
        worker and waits (bounded) until it has let go of the request (rule 4)."""
        msg = {"rid": rid, "inputs": inputs, "batch_size": self.cfg.batch_size, "reserve_bytes": d.nbytes}
        t0 = time.monotonic()
        vectors: Vectors | None = None
        events = d.worker.request("embed", msg)
        try:
            async for ev in events:
                if isinstance(ev, Started):
                    if d.lane == "gpu" and self.gw.ledger is not None:
                        self.gw.ledger.confirm(rid, time.monotonic())
                    await on_move("running", {})
                elif isinstance(ev, Vectors):
                    vectors = ev
                elif isinstance(ev, Done):
                    if vectors is None:
                        return ("engine", "the worker ended without vectors")
                    self._note(d, "ok", time.monotonic() - t0)
                    return vectors
                elif isinstance(ev, Failed):
                    self._note(d, "severe" if ev.kind in ("alloc_failed", "oom") else "failed", 0.0)
                    return (ev.kind, ev.message)
                elif isinstance(ev, WorkerGone):
                    self._note(d, "severe", 0.0)
                    return (ev.kind, ev.message)
                elif isinstance(ev, Interrupted):
                    raise RequestCancelled(f"request {rid} was cancelled")
            return ("exited", "the worker channel ended")
        except BaseException:
            d.worker.interrupt(rid)
            await self._until_stopped(d, rid)
            self._note(d, "cancelled", 0.0)
            raise
        finally:
            await events.aclose()

    async def _until_stopped(self, d: _Dispatch, rid: str) -> None:
        """Rule 4: the lease goes back only once the worker has let go of the request. One that
        does not stop within ``STOP_WAIT_S`` (a hang) is killed, and its exit is awaited."""
        stopped = d.worker.when_stopped(rid)
        if stopped is None:
            return
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(stopped), STOP_WAIT_S)
            return
        self.gw.note_event(d.worker.spec.worker_id, f"did not stop {rid} within {STOP_WAIT_S:.0f}s: killing it")
        await d.worker.kill()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(stopped), self.gw.cfg.supervisor.health_timeout_s)

    def _note(self, d: _Dispatch, outcome: str, seconds: float) -> None:
        """Feed the breaker (GPU) and the ETA."""
        if outcome == "ok":
            self._seconds[d.lane] = 0.8 * self._seconds[d.lane] + 0.2 * seconds
        if d.lane == "gpu":
            self.breaker = attempt_ended(self.breaker, outcome, d.probe_round, time.monotonic(), self.breaker_policy)

    def _release(self, rid: str, d: _Dispatch) -> None:
        """Rule 4: the attempt's slot and device reservation go back, once."""
        d.worker.release_slot(rid)
        ledger = self.gw.ledger
        if d.lane == "gpu" and ledger is not None and ledger.holds(rid):
            ledger.release(rid, time.monotonic())
        self._reserved.pop(rid, None)
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
        return self.memory.weights_bytes() if self.memory else None

    def demoting_bytes(self) -> int:
        """Weights of a demotion under way (not yet given back)."""
        if self.demoted and self._holds_weights() and self.memory:
            return self.memory.weights_bytes()
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
        if not self.demoted or self.gpu is None or ledger is None or self.memory is None:
            return
        if self._holds_weights():
            return  # still unloading
        a = self.gw.cfg.admission
        due, self._room_since = promote_due(
            headroom_bytes=ledger.headroom(now),
            weights_bytes=self.memory.weights_bytes(),
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_WAKE_S)

    def _view(self, nbytes: int, avoid_gpu: bool, now: float) -> PlacementView:
        g = self.gpu.worker if self.gpu is not None else None
        c = self.cpu.worker if self.cpu is not None else None
        ledger = self.gw.ledger
        host_ok = True
        if c is not None and self.gw.cfg.device.host_guard and self.gw.host.observed_bytes:
            host_ok = self.gw.host.observed_bytes < self.gw.host.budget_bytes
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
                    f"waited {self.cfg.queue_max_age_s:.0f}s for an {self.name} worker",
                    retry_after_s=self.eta_s(),
                    code="queue_timeout",
                )
            )
            job.future.exception()
        for job in list(self.queue):
            choice = place(self._view(job.nbytes, job.avoid_gpu, now))
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
            self.queue.remove(job)
            nbytes = job.nbytes if choice.lane == "gpu" else 0
            job.future.set_result(_Dispatch(worker, choice.lane, choice.reason, nbytes, probe_round))

    def _free_slots(self) -> int:
        return sum(s.worker.free_slots for s in self.supervisors())

    def eta_s(self) -> float:
        """Seconds until a request queued now would likely start and end: the queue ahead of
        it spread over the lanes' slots at their measured speed (never under 1 s)."""
        slots = sum(s.worker.spec.slots for s in self.supervisors() if s.worker.state is WorkerState.READY)
        per = min(self._seconds.values())
        return max(1.0, math.ceil((len(self.queue) + 1) / max(1, slots)) * per * 2)

    def statistics(self) -> ServiceStatistics:

        lane, why = self.last_choice
        if not self.queue:  # nothing waits: say where a request would start now
            small = self.memory.request_bytes([16], 1) if self.memory else 0
            c = place(self._view(small, False, time.monotonic()))
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
            weights_bytes=self.memory.weights_bytes() if self.memory else 0,
            reserved_bytes=sum(self._reserved.values()),
            device_bytes=self.device_bytes(),
            load_waiting=self.load_waiting,
            demoted=self.demoted,
            demotions=self.demotions,
            promotions=self.promotions,
            ladder=list(self.ladder),
            workers=[s.status_row() for s in self.supervisors()],
        )
