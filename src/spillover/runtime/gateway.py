"""The gateway process's runtime: wires config, devices, workers, supervisors and scheduler.

``Gateway`` owns the components' lives (start, the loops, stop), the device observation,
the journal's kept outcomes and start-up recovery. The /v1/status document is built in
``runtime.status``; host-memory observation for the CPU guard is ``runtime.hostmem``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from spillover.config import Config, parse_device
from spillover.core.ledger import DeviceLedger
from spillover.core.lifecycle import IllegalTransition, State
from spillover.core.reasons import Reason
from spillover.core.routing import DEVICE_ROUTES
from spillover.errors import JournalUnavailable
from spillover.runtime import statelock, ticks
from spillover.runtime.chat import ChatModel, chat_models
from spillover.runtime.devices import GpuDevice, cuda_available
from spillover.runtime.embeddings import EmbeddingsService
from spillover.runtime.events import SupervisorEvent, SupervisorEventKind
from spillover.runtime.executor import RetryBudget
from spillover.runtime.hostmem import HostMemory
from spillover.runtime.journal import Journal, JournalRecord
from spillover.runtime.keylocks import KeyLocks
from spillover.runtime.loops import LoopGroup
from spillover.runtime.recovery import recover
from spillover.runtime.registry import ModelRegistry
from spillover.runtime.requests import RequestService
from spillover.runtime.scheduler import Scheduler
from spillover.runtime.service import DeviceService
from spillover.runtime.status import DegradedAnswers, status_document
from spillover.runtime.supervisor import COMING_BACK_FAILED_STARTS, Supervisor
from spillover.runtime.transcription import TranscriptionService
from spillover.runtime.worker_client import WorkerClient, WorkerState

__all__ = ["Gateway", "resolve_gpu"]

log = logging.getLogger("spillover.gateway")
OBSERVE_INTERVAL_S = 0.1
KICK_EVERY_S = 0.5  # the schedulers look again at least this often while the device reading stays the same
MAX_PENDING_OUTCOMES = 10_000
_GONE = (SupervisorEventKind.DIED, SupervisorEventKind.START_FAILED, SupervisorEventKind.UNLOADED)
LOAD_RECHECK_S = 0.25  # how often a load waiting for room looks at the ledger again
# A stop ends what still runs this long before the server's grace is over: a GPU job's answer
# waits for its worker to let go of it (1 s was too short for an embeddings batch on the GPU).
STOP_AHEAD_S = 3.0
OUTCOME_TRIES = 10  # journal tries of a kept outcome before its stored answer is dropped


def resolve_gpu(cfg: Config) -> tuple[str, int] | None:
    """(kind, n) of the GPU lane's device, or None when there is no GPU lane."""
    kind, n = parse_device(cfg.device.gpu)
    if kind in ("none", "cpu"):
        return None
    if kind == "auto":
        return ("cuda", 0) if cuda_available(0) else ("sim", cfg.device.sim_capacity_mib)
    return kind, n


class Gateway:
    """Everything behind the HTTP API. ``start()`` then ``stop()``."""

    def __init__(self, cfg: Config, *, on_fatal: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        # Every loop and replay has one owner; a loop that keeps failing takes the gateway
        # down (``on_fatal``: the server stops and exits non-zero), never silently.
        self.loops = LoopGroup(on_fatal=on_fatal or (lambda why: None))
        # Every chat model (``runtime.chat``): the [model] one first (the primary), then each
        # [[services]] chat entry. The CPU lane serves the fallback model when one is
        # configured, else a replica.
        self.chats: list[ChatModel] = chat_models(cfg)
        self.started_s = time.monotonic()
        self.device: GpuDevice | None = None
        self.ledger: DeviceLedger | None = None
        self.device_epoch = 0
        self.alloc_failures = 0
        self.device_hang = False
        self.events: list[dict[str, Any]] = []
        self.journal: Journal | None = None
        self.requests = RequestService(self)  # owns every request from accepted to terminal
        self.registry = ModelRegistry(cfg)  # every model id (and alias) served, and its kind
        kinds: dict[str, type[DeviceService]] = {"embeddings": EmbeddingsService, "transcription": TranscriptionService}
        self.services: dict[str, DeviceService] = {
            s.name: kinds[s.kind](self, s) for s in cfg.services if s.kind in kinds
        }
        self.degraded = DegradedAnswers()  # recent answers served off the GPU, for the mode
        self.listener: Callable[[], Any] | None = None  # the HTTP listener's statistics() (set by serve)
        self.budget = RetryBudget(cfg.failover.retry_budget_per_min)
        self.keys = KeyLocks()
        # How many holders (HTTP requests not yet answered, runs still running) each audio
        # upload has, by digest: an upload goes only when it has none (``http.audio`` rule 4).
        self.upload_holds: dict[str, int] = {}
        # Terminal outcomes the journal could not take yet (a full disk): written again by the
        # journal loop, oldest first; bounded (the oldest are dropped, and counted, past it).
        self.pending_outcomes: dict[str, tuple[State, dict[str, Any]]] = {}
        self.outcomes_dropped = 0
        self._outcome_tries: dict[str, int] = {}
        self._journal_wake = asyncio.Event()
        self.recovered: dict[str, int] = {}
        self.recovery_ended = False  # start-up recovery has replayed or ended what it could (or failed)
        # The gateway stops its requests (``stop_requests``): one it stops ends resumable
        # (``ServerStopping``), not as the client's cancellation.
        self.stopping = False
        self.ran: set[str] = set()  # GPU workers' weights holders that were ready once (worker_event)
        self.failed_starts: dict[str, int] = {}  # weights holder -> failed starts since it was last ready
        self.host = HostMemory(
            self.all_supervisors,
            budget_bytes=cfg.device.host_budget_mib * 1024 * 1024,
            min_free_bytes=cfg.device.host_min_free_mib * 1024 * 1024,
        )
        from spillover.metrics import Metrics

        self.metrics = Metrics(self.status)

    def __repr__(self) -> str:
        return f"<Gateway models={[c.name for c in self.chats]} device={self.device}>"

    # -- chat models ----------------------------------------------------------------
    @property
    def chat(self) -> ChatModel:
        """The primary chat model ([model])."""
        return self.chats[0]

    def chat_model(self, model_id: str) -> ChatModel:
        """The chat model a request names (``registry.resolve`` has checked it is chat)."""
        return next((c for c in self.chats if model_id in c.ids), self.chat)

    def schedulers(self) -> list[Scheduler]:
        return [c.scheduler for c in self.chats if c.scheduler is not None]

    # -- life ----------------------------------------------------------------------
    def embedding_services(self) -> list[EmbeddingsService]:
        """The services of kind embeddings (Ollama's /api/tags lists them)."""
        return [s for s in self.services.values() if isinstance(s, EmbeddingsService)]

    async def start(self) -> None:
        state = self.cfg.state_path()
        self.state_lock = statelock.acquire(state)  # one gateway per folder, before anything touches it
        state.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(
            self.cfg.journal_path(),
            retention_s=self.cfg.journal.retention_s,
            max_requests=self.cfg.journal.max_requests,
            max_bytes=self.cfg.journal.max_mib * 1024 * 1024,
        )
        await self.journal.open()
        gpu = resolve_gpu(self.cfg)
        if gpu is not None:
            self.device = GpuDevice(gpu[0], gpu[1], str(state))
            await asyncio.to_thread(self.device.init)
            self.ledger = DeviceLedger(
                device=self.device.spec,
                capacity_bytes=self.device.initial_capacity_bytes,
                margin_bytes=self.cfg.device.margin_mib * 1024 * 1024,
                freshness_s=self.cfg.admission.observed_freshness_s,
            )
            log.info(
                "GPU lane on %s%s",
                self.device.spec,
                " (simulated accelerator: no GPU found)" if gpu[0] == "sim" else "",
            )
        else:
            log.info("no GPU lane (device.gpu=%s): CPU only", self.cfg.device.gpu)
        for svc in self.services.values():  # what each keeps on the device, before a chat model plans its room
            await svc.read_model()
        for chat in self.chats:  # the primary's GPU worker loads first; the others' loads are reservations
            await chat.start(self)
            for s in chat.supervisors:
                self.loops.add(f"sup-{s.worker.spec.worker_id}", s.run)
            assert chat.scheduler is not None
            self.loops.add("scheduler" if chat is self.chat else f"scheduler-{chat.name}", chat.scheduler.run)
        for svc in self.services.values():  # after the chat model's: its GPU worker loads first
            await svc.start()
        for chat in self.chats:  # interactive chat of any model may demote a batch service
            if chat.priority != "interactive" or (sched := chat.scheduler) is None:
                continue
            sched.demotable = self._demotable
            sched.demoting_bytes = lambda: sum(s.demoting_bytes() for s in self.services.values())
            sched.demote = self._demote
        if self.device is not None:
            self.loops.add("observe", self._observe_loop)
        self.loops.add("host-observe", self.host.run)
        self.loops.add("journal-retention", self._journal_loop)
        # What was unfinished *before* this gateway serves anything: only those are orphans.
        orphans = await self.journal.unfinished()
        self.requests.orphans = {rec.id for rec in orphans}
        await self.loops.start()
        self.loops.spawn("recover", self._recover(orphans))

    def held_beside(self, chat: ChatModel, room: int) -> dict[str, int]:
        """The device bytes, by service, that will stay beside ``chat`` whatever it needs,
        when ``room`` is what its own weights leave: the services load after the chat models,
        in the order configured, each whose weights fit what is left (one that does not waits,
        holding nothing); of those, the weights of each that keeps them
        (``DeviceService.keeps_device_weights``: an interactive chat model may demote an idle
        batch service, which still takes its room first). ``ChatModel.start`` plans in what
        they leave (round 49a: the plan counted the whole device while whisper and bge held
        161 of its 268 MiB, and a request the plan said fit got a 503 every time). The other
        chat models are not counted: a second one's load waits until its weights fit, its
        requests on its CPU lane meanwhile."""
        held = {}
        for name, svc in self.services.items():
            if not svc.cfg.gpu or svc.weights_bytes() > room:
                continue
            room -= svc.weights_bytes()
            if svc.keeps_device_weights(by_interactive=chat.priority == "interactive"):
                held[name] = svc.weights_bytes()
        return held

    def _demotable(self) -> tuple[tuple[str, int], ...]:
        """The pressure ladder's candidates: idle batch services on the GPU, with their weights."""
        return tuple((n, b) for n, svc in self.services.items() if (b := svc.demotable_bytes()) is not None)

    def _demote(self, name: str, why: Reason) -> None:
        self.services[name].demote(f"room for interactive chat ({why})")

    def note_event(self, worker_id: str, event: str) -> None:
        """An event for /v1/status (the last 100 are kept)."""
        self.events.append({"t_s": round(time.monotonic() - self.started_s, 3), "worker": worker_id, "event": event})
        del self.events[:-100]

    def kick_scheduler(self) -> None:
        """Device bytes changed outside a chat scheduler (a reading, another service or model): each
        with work waiting looks again (``Scheduler.look_again``)."""
        for sched in self.schedulers():
            sched.look_again()

    def worker_event(self, worker: Any, ev: SupervisorEvent) -> None:
        """A supervisor event of any service's worker: logged, and a GPU worker's weights are
        held in the ledger from its start (reserved before it, for a load that had to fit)
        until it dies. Its supervisor restarts a worker that died into the room it had: the
        ledger keeps that room from other weights loads (``DeviceLedger.keep``), so a load that
        waited for room (another service's) cannot take it and leave the planned worker waiting
        behind it for good. A park or an unload gives it up, and so does a failed start of a
        worker that never ran (a model that cannot load holds no room from the others); one
        that ran keeps it through ``COMING_BACK_FAILED_STARTS`` failed restarts in a row (killed again
        while it restarted), no more (its model may no longer load)."""
        self.note_event(worker.spec.worker_id, str(ev))
        if self.ledger is not None and worker.spec.lane in DEVICE_ROUTES:
            holder = worker.spec.weights_holder
            now = time.monotonic()
            if ev.kind is SupervisorEventKind.STARTING and not self.ledger.holds(holder):
                self.ledger.force_reserve(holder, worker.spec.weights_bytes, now, kind="weights")
            elif ev.kind is SupervisorEventKind.READY:
                self.ledger.confirm(holder, now)
                self.ran.add(holder)
                self.failed_starts.pop(holder, None)
            elif ev.kind in _GONE and self.ledger.holds(holder):
                self.ledger.release(holder, now)  # remembered: this memory is coming back
                if ev.kind is SupervisorEventKind.DIED:  # its restart takes it back
                    self.ledger.keep(holder, worker.spec.weights_bytes)
            if ev.kind is SupervisorEventKind.START_FAILED:
                self.failed_starts[holder] = self.failed_starts.get(holder, 0) + 1
            if ev.kind in (SupervisorEventKind.PARKED, SupervisorEventKind.UNLOADED) or (
                ev.kind is SupervisorEventKind.START_FAILED
                and (holder not in self.ran or self.failed_starts[holder] >= COMING_BACK_FAILED_STARTS)
            ):
                self.ledger.drop_kept(holder)
        self.kick_scheduler()

    async def reserve_weights(self, worker: WorkerClient, *, nbytes: int, on_wait: Callable[[bool], None]) -> None:
        """A GPU worker's ``before_start``: its weights are reserved in the device ledger
        before it loads; until they fit the load waits (``on_wait(True)``; its model's
        requests go to its CPU path), never attempted into an allocation failure. Meanwhile
        the worker's ``waiting`` names the room it waits for: its ``/v1/status`` row is not a
        bare ``stopped`` or ``dead``."""
        assert self.ledger is not None
        holder = worker.spec.weights_holder
        waiting = False
        try:
            while not self.ledger.holds(holder):
                if self.ledger.reserve_nowait(holder, nbytes, time.monotonic(), kind="weights") is None:
                    if not waiting:
                        waiting = True
                        on_wait(True)
                        worker.waiting = f"room on the device for its {nbytes} bytes of weights"
                        worker.waits_for_room = True
                        self.note_event(worker.spec.worker_id, f"load waiting: {worker.waiting}")
                    await asyncio.sleep(LOAD_RECHECK_S)
        finally:
            worker.waiting = None  # it loads now, or the wait was cancelled (the gateway stops)
            worker.waits_for_room = False
        on_wait(False)

    async def _observe_loop(self) -> None:
        """Read the device every ``OBSERVE_INTERVAL_S`` (on the shared tick, ``runtime.ticks``: the
        other periodic loops wake with it). The sim ledger is a small locked file,
        read inline (a thread hop costs more than the read); NVML is read in a thread. The
        schedulers look again when the reading changed, and at least every ``KICK_EVERY_S``
        (a reading that stays the same only renews its freshness)."""
        assert self.device is not None and self.ledger is not None
        inline = self.device.kind == "sim"
        last: Any = None
        kicked = 0.0
        while True:
            try:
                taken = time.monotonic()
                r = self.device.read() if inline else await asyncio.to_thread(self.device.read)
                self.ledger.observe(r.used_bytes, taken, r.capacity_bytes)
                self.device_epoch, self.alloc_failures, self.device_hang = r.epoch, r.alloc_failures, r.hang
                if r != last or taken - kicked >= KICK_EVERY_S:
                    last, kicked = r, taken
                    self.kick_scheduler()
            except Exception as exc:  # a failed reading goes stale; admission stops trusting it
                last = None
                log.warning("device reading failed: %s", exc)
            await ticks.sleep(OBSERVE_INTERVAL_S)

    async def store_outcome(self, rid: str, state: State, **fields: Any) -> bool:
        """Journal a request's terminal state; False when it is not durable yet. When the
        journal cannot take it now (a full disk), the outcome is kept (bounded) and written
        again by the journal loop, so the request does not stay RUNNING and get re-run after a
        restart; its answer is not sent meanwhile (``not_durable``): a gateway killed before
        the write re-runs it, and its client must not have acted on the first run's answer. A
        move the lifecycle does not allow (a bug) still ends the request, as RESUMABLE_ERROR."""
        if self.journal is None:
            return True
        sent_anyway = False
        answer = fields.get("response")
        if state is State.COMPLETED and answer is not None and not self.journal.keeps(len(answer)):
            # It can never be kept: sent anyway (its state is what is journaled), and its key
            # then says so (``AnswerNotKept``) instead of replaying an empty answer.
            reason = f"answer not kept: {len(answer)} bytes, more than the journal keeps in one row"
            fields, sent_anyway = fields | {"response": None, "reason": reason}, True
        try:
            await self.journal.move(rid, state, **fields)
            return True
        except JournalUnavailable as exc:
            log.warning("journal: outcome of %s kept in memory until the journal takes it: %s", rid, exc)
            self.pending_outcomes[rid] = (state, fields)
            while len(self.pending_outcomes) > MAX_PENDING_OUTCOMES:
                del self.pending_outcomes[next(iter(self.pending_outcomes))]
                self.outcomes_dropped += 1
            self._journal_wake.set()
            return sent_anyway
        except IllegalTransition:
            log.exception("journal: %s cannot move to %s; ending it as resumable_error", rid, state.value)
            if state is not State.RESUMABLE_ERROR:
                return await self.store_outcome(rid, State.RESUMABLE_ERROR, **fields)
            return True

    async def _flush_outcomes(self) -> None:
        """Write the kept outcomes, each independently. One the journal still refuses after
        ``OUTCOME_TRIES`` tries is written without its stored answer: its state is what must
        not be lost. A completed one's answer was not sent (``store_outcome``), so it ends
        resumable instead: its key runs it again."""
        assert self.journal is not None
        for rid, (state, fields) in list(self.pending_outcomes.items()):
            tries = self._outcome_tries.get(rid, 0) + 1
            if tries > OUTCOME_TRIES and fields.get("response") is not None:
                fields = fields | {"response": None, "reason": "stored answer dropped: the journal had no room for it"}
                if state is State.COMPLETED:
                    state, fields = State.RESUMABLE_ERROR, fields | {"status_code": 503}
            try:
                await self.journal.move(rid, state, **fields)
            except JournalUnavailable:
                self._outcome_tries[rid] = tries
                continue  # still no room for this one: try the others, and this one again later
            except Exception as exc:  # e.g. an illegal move: the row moved on meanwhile
                log.warning("journal: dropping the kept outcome of %s: %s", rid, exc)
            self.pending_outcomes.pop(rid, None)
            self._outcome_tries.pop(rid, None)

    async def _journal_loop(self) -> None:
        """Retention every minute; kept outcomes every second until they are written."""
        assert self.journal is not None
        last_prune = -math.inf
        while True:
            self._journal_wake.clear()
            try:
                if time.monotonic() - last_prune >= 60.0 or self.pending_outcomes:
                    last_prune = time.monotonic()
                    await self.journal.prune()
                await self._flush_outcomes()
            except Exception as exc:
                log.warning("journal retention failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._journal_wake.wait(), 1.0 if self.pending_outcomes else 60.0)

    def _ready_to_replay(self) -> bool:
        """The primary chat model's workers are up, and every other model and service can serve
        somewhere (a GPU worker whose load waits for room does not hold recovery back: its CPU
        path serves)."""
        chat = self.chat.all_ready() and all(c.ready() for c in self.chats[1:])
        return chat and all(
            any(s.worker.state is WorkerState.READY for s in svc.supervisors()) for svc in self.services.values()
        )

    async def _recover(self, orphans: list[JournalRecord]) -> None:
        """After a restart the journal is the truth: once the workers are up (bounded wait),
        replay what can be (through the request service's endpoints) and end the rest."""
        deadline = time.monotonic() + self.cfg.supervisor.load_timeout_s
        while time.monotonic() < deadline and not self._ready_to_replay():
            await asyncio.sleep(0.1)
        try:
            self.recovered = await recover(self, orphans, self.loops.spawn)
        except Exception:  # e.g. the journal is unwritable at start: the orphans wait for a restart
            log.exception("start-up recovery failed; unfinished requests stay as they are until the next start")
        finally:
            self.recovery_ended = True

    # -- helpers for the request path -------------------------------------------------
    async def kill_worker(self, worker: WorkerClient, what: str = "no token progress") -> None:
        """A stalled worker (``what``: no token progress) is killed; its supervisor restarts it."""
        self.worker_event(worker, SupervisorEvent(SupervisorEventKind.STALLED, f"{what}: killing it"))
        await worker.kill("hung")

    def worker_info(self, worker_id: str) -> dict[str, Any]:
        """The ready-info a worker reported (pid, fingerprint, ...)."""
        for s in self.all_supervisors():
            if s.worker.spec.worker_id == worker_id:
                return s.worker.info or {}
        return {}

    def all_supervisors(self) -> list[Supervisor]:
        """Every worker's supervisor: the chat models', then each service's."""
        chats = [s for c in self.chats for s in c.supervisors]
        return chats + [s for svc in self.services.values() for s in svc.supervisors()]

    def begin_stop(self, grace_s: float) -> None:
        """uvicorn's shutdown begins: open requests get ``grace_s`` to end, then uvicorn cancels
        their handlers (a bare 500 to the client). ``STOP_AHEAD_S`` before that the gateway stops what
        still runs (``stop_requests``), so its client reads 503 ``server_stopping`` (a stream:
        its error event and ``[DONE]``). Until then a request ends as it would have (a client
        that goes away stops it, resumable)."""
        asyncio.get_running_loop().call_later(max(0.0, grace_s - STOP_AHEAD_S), self.stop_requests)

    def stop_requests(self) -> None:
        """From now on the gateway stops its requests: every live one ends resumable
        (``ServerStopping``, not as the client's cancellation), and a new one is refused with
        it (``RequestService.submit``) or, accepted meanwhile, stopped as it goes live."""
        self.stopping = True
        self.requests.cancel_all()

    async def stop(self) -> None:
        self.stop_requests()
        await self.loops.stop()
        for s in self.all_supervisors():
            await s.stop()
        if self.device is not None:
            self.device.close()
        if self.journal is not None:
            await self.journal.close()
        if (lock := getattr(self, "state_lock", None)) is not None:
            lock.release()

    # -- readiness and status --------------------------------------------------------
    def ready(self) -> bool:
        """At least one worker of the primary chat model can serve."""
        return self.loops.fatal is None and self.chat.ready()

    def status(self) -> dict[str, Any]:
        """The /v1/status document (``runtime.status``)."""
        return status_document(self)
