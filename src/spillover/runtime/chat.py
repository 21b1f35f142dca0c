"""One chat model the gateway serves: its tokenizers, memory model, lanes and workers.

The gateway serves the ``[model]`` chat model (the *primary*: its workers are ``gpu0`` and
``cpu0``, and ``split0`` with ``[split]``; its lanes ``[gpu_lane]`` and ``[cpu_lane]``) and any
``[[services]]`` entry of kind ``chat`` (a GGUF each, workers ``<name>-gpu`` and
``<name>-cpu``, lanes sized by the entry).

Rules:

1. Each chat model has its own ``Scheduler`` (its bounded lanes, its breaker) and its own
   workers, and every one of them admits against the gateway's one ``DeviceLedger``: a
   request of one model sees the other's weights and reservations, and a model's GPU weights
   are reserved before its worker loads (``Supervisor(before_start=...)``), so a load that
   does not fit waits while the model's CPU lane serves.
2. A model without a chat template serves completions only: ``/v1/chat/completions`` for it
   is a 400 naming ``/v1/completions``.
3. Its CPU path is an exact replica (same GGUF) or none (``cpu = "none"``: admission never
   routes it to the CPU; a request that does not fit waits or is refused with Retry-After).
4. The replica is kept as ready as its lane's ``readiness`` says (``runtime.readiness``): a
   fixed mode, or ``auto`` by ``recovery_budget_ms``; every failover that reaches a first CPU
   token reports its recovery time to it.
5. What runs on the device is planned at start (``core.profiles``): the resident GPU worker,
   and with ``[split] enabled`` (primary only) a split worker (its last N layers on the
   device) that takes what the resident cannot; when the whole model does not fit, only the
   split worker runs. Without a split worker the resident always starts, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from spillover.config import Config, CpuLaneConfig, LaneConfig, ServiceConfig, SplitConfig, default_model_path
from spillover.core.admission import AdmissionPolicy
from spillover.core.breaker import BreakerPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel, ModelSpec
from spillover.core.profiles import MIB, ProfilePlan, plan_profile
from spillover.errors import ConfigError
from spillover.runtime.executor import Execution
from spillover.runtime.readiness import ReplicaReadiness
from spillover.runtime.scheduler import Scheduler
from spillover.runtime.supervisor import Supervisor, back_in_s, cannot_start
from spillover.runtime.worker_client import WorkerSpec, WorkerState

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["ChatModel", "chat_models"]

log = logging.getLogger("spillover.chat")


@dataclass(eq=False)
class ChatModel:
    """One chat model (rules in the module docstring); ``start`` makes its parts."""

    name: str
    aliases: tuple[str, ...]
    priority: str
    model_path: str
    gpu_lane: LaneConfig | None  # None: no GPU worker (or no GPU)
    cpu_lane: CpuLaneConfig
    cpu_path: bool = True  # False: ``cpu = "none"``, no CPU worker
    cpu_model_path: str = ""  # the CPU lane's GGUF: the fallback's, or the model's own (a replica)
    fallback_name: str | None = None  # the CPU lane serves this fallback model (primary only)
    worker_ids: tuple[str, str, str] = ("gpu0", "cpu0", "split0")
    split: SplitConfig | None = None  # its split worker's settings (primary only; None: no split worker)
    profile: ProfilePlan | None = None  # what runs on the device (None: no GPU here)
    tokenizer: Any = None
    cpu_tokenizer: Any = None  # the fallback model's, or None (the CPU lane uses ``tokenizer``)
    spec: ModelSpec | None = None
    memory: MemoryModel | None = None
    scheduler: Scheduler | None = None
    supervisors: list[Supervisor] = field(default_factory=list)
    load_waiting: bool = False  # its GPU worker's load waits for room on the device
    cpu_slot_bytes: int = 0  # host memory one CPU context costs (memory model)
    readiness: ReplicaReadiness | None = None  # its CPU replica's readiness (None: no CPU path)
    _canary_n: int = 0

    def __repr__(self) -> str:
        return f"<ChatModel {self.name} gpu={self.gpu_lane is not None} cpu={self.cpu_path}>"

    @property
    def ids(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    # -- life ----------------------------------------------------------------------------
    def _read_model(self, path: str, what: str = "") -> tuple[Any, ModelSpec]:
        """A GGUF file's tokenizer and spec; a file that cannot be either is a ConfigError that
        names the model (the start says it in one line: ``http.app.GatewayLifespan``)."""
        from spillover.engine.gguf_meta import read_model_spec
        from spillover.engine.llama_engine import Tokenizer

        try:
            return Tokenizer(path), read_model_spec(path)
        except Exception as exc:  # llama.cpp's load failure, gguf's, UnsupportedModel, a header that lies
            raise ConfigError.unreadable(what or f"chat model {self.name!r}", path, exc) from exc

    async def start(self, gw: Gateway) -> None:
        """Read the model, make its scheduler and supervisors (rule 1); the loops are the gateway's."""
        self.cpu_model_path = self.cpu_model_path or self.model_path
        self.tokenizer, model_spec = await asyncio.to_thread(self._read_model, self.model_path)
        self.spec = cpu_spec = model_spec
        if self.fallback_name is not None:
            what = f"chat model {self.name!r}'s CPU fallback model {self.fallback_name!r}"
            self.cpu_tokenizer, cpu_spec = await asyncio.to_thread(self._read_model, self.cpu_model_path, what)
            log.info("CPU lane serves the fallback model %s (%s), labelled degraded", self.fallback_name, cpu_spec)
        a = gw.cfg.admission
        gpu_batch = self.gpu_lane.n_batch_tokens if self.gpu_lane else gw.cfg.gpu_lane.n_batch_tokens
        self.memory = MemoryModel(
            model_spec, page_tokens=a.kv_page_tokens, fragmentation_ratio=a.fragmentation_ratio, n_batch=gpu_batch
        )
        gpu = self.gpu_lane is not None and gw.device is not None and gw.ledger is not None
        if not gpu and not self.cpu_path:
            raise ConfigError(
                f'chat model {self.name!r} has cpu = "none" and no GPU worker here (device.gpu = '
                f"{gw.cfg.device.gpu!r}): it could serve nothing"
            )
        policy = None
        if gpu:
            policy = AdmissionPolicy(
                memory=self.memory,
                delay_max_s=a.delay_max_s,
                allow_cpu_route=a.allow_cpu_route and self.cpu_path,
                breaker=BreakerPolicy(**dataclasses.asdict(gw.cfg.breaker)),
            )
        cpu_mm = MemoryModel(cpu_spec, n_batch=self.cpu_lane.n_batch_tokens, cpu_repack=True)
        cpu_weights = cpu_mm.weights_bytes()
        cpu_context = cpu_mm.context_bytes(self.cpu_lane.ctx_cap_tokens)
        self.cpu_slot_bytes = cpu_weights + cpu_context
        host_view = None
        if self.cpu_path:
            self.readiness = ReplicaReadiness(
                self.cpu_lane.readiness,
                self.cpu_lane.recovery_budget_ms,
                lambda: self.scheduler.cpu_workers[0] if self.scheduler and self.scheduler.cpu_workers else None,
                weights_bytes=cpu_weights,
                context_bytes=cpu_context,
                alone=not gpu,
            )
            # llama.cpp maps the file (engine.llama_engine): all but what its CPU backend repacks
            mapped = max(0, cpu_weights - cpu_spec.repack_bytes - cpu_spec.output_repack_bytes)
            host_view = gw.host.lane_view(
                lambda: self.scheduler,
                weights_bytes=cpu_weights,
                context_bytes=cpu_context,
                readiness=self.readiness,
                mapped_bytes=mapped,
            )
        self.scheduler = Scheduler(
            gpu_lane=self.gpu_lane if gpu else None,
            cpu_lane=self.cpu_lane,
            ledger=gw.ledger if gpu else None,
            policy=policy,
            host_view=host_view,
            host_guard=gw.cfg.device.host_guard,
        )
        self.scheduler.cannot_start = lambda: cannot_start(f"chat model {self.name!r}", self.supervisors)
        self.scheduler.device_back_in_s = lambda: back_in_s(
            [s for s in self.supervisors if s.worker.spec.lane != "cpu"], time.monotonic()
        )
        if gpu and gw.device is not None and gw.ledger is not None:
            usable, held = gw.ledger.usable_bytes, dict[str, int]()
            while True:  # a plan with less room holds fewer weights, so more services fit after them
                self._plan_profile(gw, usable, held)
                beside = gw.held_beside(self, usable - self.device_weights_bytes())
                if beside.keys() <= held.keys():
                    break
                held |= beside
            assert self.profile is not None
            self.scheduler.gpu_ctx_cap_tokens = self.resident_cap_tokens
            if self.resident_runs:
                spec = self._worker_spec(gw, "gpu", gw.device.spec)
                # Another model's load is a reservation that must fit first; the primary loads first.
                nbytes = self.memory.weights_bytes()  # predicted on any GPU (a sim worker charges exactly this)
                before = functools.partial(gw.reserve_weights, nbytes=nbytes, on_wait=self._load_waits)
                sup = Supervisor(
                    spec,
                    gw.cfg.supervisor,
                    device=gw.device,
                    on_change=gw.worker_event,
                    before_start=None if self is gw.chat else before,
                )
                self.supervisors.append(sup)
                self.scheduler.gpu_workers.append(sup.worker)
            if self.split_runs:
                self._start_split(gw, self.profile.split_layers)
            if not (self.resident_runs or self.split_runs):  # the cpu profile
                self.scheduler.off_device = True  # its jobs leave the device as resident_does_not_fit
                if self.readiness is not None:
                    self.readiness.alone = True  # no device worker to fail over from (core.readiness rule 4)
        if self.cpu_path:
            assert self.readiness is not None
            spec = dataclasses.replace(self._worker_spec(gw, "cpu", "cpu"), readiness=self.readiness.initial_mode())
            sup = Supervisor(spec, gw.cfg.supervisor, on_change=gw.worker_event)
            self.supervisors.append(sup)
            self.scheduler.cpu_workers.append(sup.worker)

    def _plan_profile(self, gw: Gateway, usable_bytes: int, held: dict[str, int]) -> None:
        """Which profile runs on the device (rule 5, ``core.profiles``), in the room the
        weights ``held`` beside it (by holder) leave."""
        assert self.memory is not None and self.gpu_lane is not None
        split_mm = None
        if self.split is not None:
            split_mm = dataclasses.replace(self.memory, n_batch=self.split.n_batch_tokens)
            self.split.check_layers(self.memory.spec.n_layers, self.name)
        beside = sum(held.values())
        self.profile = plan_profile(
            self.memory,
            gpu_ctx_tokens=self.gpu_lane.ctx_cap_tokens,
            usable_bytes=max(0, usable_bytes - beside),
            split=split_mm,
            split_slots=self.split.slots if self.split else 1,
            split_ctx_tokens=self.split.ctx_cap_tokens if self.split else 0,
            split_gpu_layers=self.split.gpu_layers if self.split else -1,
        )
        if beside:
            kept = f"{beside / MIB:.0f} MiB kept by {', '.join(sorted(held))}"
            why = f"{self.profile.why}; the device's {usable_bytes / MIB:.0f} MiB less {kept}"
            self.profile = dataclasses.replace(self.profile, why=why)
        log.info("chat model %s on the device: profile %s (%s)", self.name, self.profile.profile, self.profile.why)
        if self.profile.profile == "cpu":
            log.warning("chat model %s runs on the CPU only (%s)", self.name, self.profile.why)
        elif self.split is not None and self.profile.split_layers == 0:
            log.warning("chat model %s: no split worker runs (%s)", self.name, self.profile.why)

    def _start_split(self, gw: Gateway, layers: int) -> None:
        """The split worker: the model's last ``layers`` layers on the device; its requests'
        reservations come from its own memory model (those layers' KV, its batch's compute)."""
        assert self.split is not None and self.memory is not None and self.scheduler is not None
        assert gw.device is not None
        mm = dataclasses.replace(self.memory, n_batch=self.split.n_batch_tokens, n_gpu_layers=layers)
        nbytes = mm.weights_bytes()
        spec = WorkerSpec(
            worker_id=self.worker_ids[2],
            lane="split",
            device=gw.device.spec,
            model_path=self.model_path,
            state_dir=str(gw.cfg.state_path()),
            slots=self.split.slots,
            n_ctx=self.split.ctx_cap_tokens,
            n_threads=self.split.n_threads,
            n_batch=min(self.split.n_batch_tokens, self.split.ctx_cap_tokens),
            weights_bytes=nbytes if gw.device.spec.startswith("sim") else 0,
            gpu_layers=layers,
        )
        before = functools.partial(gw.reserve_weights, nbytes=nbytes, on_wait=self._load_waits)
        sup = Supervisor(spec, gw.cfg.supervisor, device=gw.device, on_change=gw.worker_event, before_start=before)
        self.supervisors.append(sup)
        self.scheduler.split_workers.append(sup.worker)
        self.scheduler.split_memory = mm
        self.scheduler.split_ctx_cap_tokens = self.split.ctx_cap_tokens

    def _load_waits(self, waiting: bool) -> None:
        self.load_waiting = waiting
        if self.scheduler is not None:
            self.scheduler.kick()

    def _worker_spec(self, gw: Gateway, lane: str, device: str) -> WorkerSpec:
        lc = self.gpu_lane if lane == "gpu" and self.gpu_lane is not None else self.cpu_lane
        assert self.memory is not None
        return WorkerSpec(
            worker_id=self.worker_ids[0 if lane == "gpu" else 1],
            lane=lane,
            device=device,
            model_path=self.model_path if lane == "gpu" else self.cpu_model_path,
            state_dir=str(gw.cfg.state_path()),
            slots=lc.slots,
            n_ctx=lc.ctx_cap_tokens,
            n_threads=lc.n_threads,
            n_batch=min(lc.n_batch_tokens, lc.ctx_cap_tokens),  # a longer batch only costs memory
            weights_bytes=self.memory.weights_bytes() if device.startswith("sim") else 0,
        )

    # -- the request path ------------------------------------------------------------------
    def has_template(self) -> bool:
        return bool(self.tokenizer is not None and self.tokenizer.chat_template)

    @property
    def resident_runs(self) -> bool:
        """Whether the resident GPU worker runs (where there is a device): when the plan is the
        ``gpu`` profile (``core.profiles`` rule 4: without a split worker, whenever one request
        fits beside its weights)."""
        return self.profile is None or self.profile.profile == "gpu"

    def device_weights_bytes(self) -> int:
        """The device bytes its planned workers' weights take (the resident's, the split's)."""
        if self.profile is None or self.memory is None:
            return 0
        held = self.memory.weights_bytes() if self.resident_runs else 0
        if self.split_runs:
            held += dataclasses.replace(self.memory, n_gpu_layers=self.profile.split_layers).weights_bytes()
        return held

    @property
    def split_runs(self) -> bool:
        """Whether a split worker runs: configured, and planned with layers on the device."""
        return self.split is not None and self.profile is not None and self.profile.split_layers > 0

    @property
    def resident_cap_tokens(self) -> int:
        """The resident's context cap: its lane's, or fewer when the device holds no more
        (``core.profiles`` rule 5; the lane's when the resident does not run)."""
        cap = self.gpu_lane.ctx_cap_tokens if self.gpu_lane is not None else 0
        return cap if self.profile is None or not self.resident_runs else min(cap, self.profile.resident_tokens)

    def context_cap_tokens(self, gpu: bool) -> int:
        """The longest prompt + max_tokens any of its lanes serves."""
        caps = [self.cpu_lane.ctx_cap_tokens] if self.cpu_path else []
        if gpu and self.gpu_lane is not None and self.resident_runs:
            caps.append(self.resident_cap_tokens)
        if gpu and self.split is not None and self.split_runs:
            caps.append(self.split.ctx_cap_tokens)
        if self.cpu_tokenizer is not None and caps:
            caps[0] = min(caps[0], self.cpu_tokenizer.n_ctx_train)
        n_train = self.tokenizer.n_ctx_train if self.tokenizer is not None else max(caps, default=0)
        return min(max(caps, default=0), n_train)

    def canary_due(self, gpu: bool, deadline: bool = False) -> bool:
        """Whether this request is the CPU canary (a fixed share of normal traffic). A request
        with a deadline never is, nor counts towards the share: pinned to the CPU lane, it was
        refused while an idle device would have finished it in time (round 59)."""
        ratio = self.cpu_lane.canary_ratio
        if ratio <= 0 or not gpu or not self.cpu_path or deadline:
            return False
        self._canary_n += 1
        return int(self._canary_n * ratio) > int((self._canary_n - 1) * ratio)

    def new_execution(self, gw: Gateway, rid: str, tokens: list[int], max_tokens: int, **kw: Any) -> Execution:
        assert self.scheduler is not None
        return Execution(
            rid=rid,
            tokens=tokens,
            max_tokens=max_tokens,
            scheduler=self.scheduler,
            journal=gw.journal,
            failover=gw.cfg.failover,
            budget=gw.budget,
            kill_worker=gw.kill_worker,
            on_failover=lambda kind: gw.metrics.failovers.labels(kind).inc(),
            on_recovered=self.readiness.observe if self.readiness is not None else lambda ms: None,
            cpu_fallback=self.fallback_name is not None,
            timeout_at_s=time.monotonic() + gw.cfg.server.request_timeout_s,
            stream_coalesce_s=gw.cfg.server.stream_coalesce_ms / 1000,
            **kw,
        )

    # -- status ------------------------------------------------------------------------------
    def ready(self) -> bool:
        return any(s.worker.state is WorkerState.READY for s in self.supervisors)

    def all_ready(self) -> bool:
        return all(s.worker.state is WorkerState.READY for s in self.supervisors)

    def device_bytes(self, ledger: DeviceLedger | None) -> int:
        """What it holds in the device ledger now: its GPU weights and its running requests'."""
        if ledger is None or self.scheduler is None:
            return 0
        device = self.scheduler.gpu_workers + self.scheduler.split_workers
        return sum(ledger.held_bytes(w.spec.weights_holder) + sum(map(ledger.held_bytes, w.claimed)) for w in device)

    def status_row(self, ledger: DeviceLedger | None, *, primary: bool) -> dict[str, Any]:
        """Its row in /v1/status ``services``: where a request starts now and why (while
        requests wait, the last admission decision; else where a small one would start now,
        ``Scheduler.where_now``), its queue, ETA and device bytes; a [[services]] entry's row
        has its workers and load state too."""
        assert self.scheduler is not None
        lanes = self.scheduler.statistics()
        queued = sum(x.depth for x in lanes)
        last = self.scheduler.decisions[-1] if self.scheduler.decisions else None
        where, why = (last["route"], last["reason"]) if queued and last else self.scheduler.where_now()
        if where == "cpu" and (held := self.scheduler.host_held) is not None:
            # its requests start on the CPU lane, where the host-RAM guard holds what waits: they
            # wait too, as a service's row says (round 19; one that starts on the device does not)
            where, why = "none", str(held)
        if self.scheduler.cannot_start() is not None:  # what its requests are answered now
            where, why = "none", "model_load_failed"
        row: dict[str, Any] = {
            "name": self.name,
            "kind": "chat",
            "priority": self.priority,
            "aliases": list(self.aliases),
            "where": where,
            "why": why,
            "queued": queued,
            "running": sum(x.running for x in lanes),
            "eta_s": round(self.scheduler.soonest_wait_s(), 3),
            "device_bytes": self.device_bytes(ledger),
            "cpu_readiness": self.readiness.status() if self.readiness is not None else None,
            "profile": (
                self.profile.as_dict() | {"split_worker": bool(self.scheduler.split_workers)}
                if self.profile is not None
                else {"profile": "cpu", "why": "no GPU device here"}
            ),
            "split_total": self.scheduler.split_total,
            "rebound_total": self.scheduler.rebound_total,  # late binding: CPU-lane jobs the device took after all
        }
        if not primary:  # the primary's workers and lanes are the document's own
            row |= {
                "breaker": self.scheduler.breaker.circuit.value,
                "load_waiting": self.load_waiting,
                "weights_bytes": self.memory.weights_bytes() if self.memory else 0,
                "lanes": [dataclasses.asdict(x) for x in lanes],
                "workers": [s.status_row() for s in self.supervisors],
            }
        return row


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "chat"


def chat_models(cfg: Config) -> list[ChatModel]:
    """The primary chat model (``[model]``) and each ``[[services]]`` chat entry."""
    primary = ChatModel(
        name=cfg.model.name,
        aliases=tuple(cfg.model.aliases),
        priority="interactive",
        model_path=cfg.model_path(),
        gpu_lane=cfg.gpu_lane,
        cpu_lane=cfg.cpu_lane,
        cpu_model_path=cfg.model.fallback_path or "",
        fallback_name=cfg.fallback_model_name(),
        split=cfg.split if cfg.split.enabled else None,
    )
    return [primary, *(_from_service(cfg, s) for s in cfg.services if s.kind == "chat")]


LaneT = TypeVar("LaneT", bound=LaneConfig)


def _from_service(cfg: Config, s: ServiceConfig) -> ChatModel:
    def lane(base: LaneT, slots: int) -> LaneT:
        return dataclasses.replace(
            base, slots=slots, n_threads=s.n_threads, queue_depth=s.queue_depth, queue_max_age_s=s.queue_max_age_s
        )

    slug = _slug(s.name)
    mode, budget = cfg.service_readiness(s)
    return ChatModel(
        name=s.name,
        aliases=tuple(s.aliases),
        priority=s.priority,
        model_path=s.path or default_model_path(),
        gpu_lane=lane(cfg.gpu_lane, s.gpu_slots) if s.gpu else None,
        cpu_lane=dataclasses.replace(
            lane(cfg.cpu_lane, s.cpu_slots), canary_ratio=0.0, readiness=mode, recovery_budget_ms=budget
        ),
        cpu_path=s.cpu == "replica",
        worker_ids=(f"{slug}-gpu", f"{slug}-cpu", f"{slug}-split"),
    )
