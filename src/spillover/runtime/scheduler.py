"""The scheduler loop: bounded lanes, admission decisions, dispatch to worker slots.

Every request enters the GPU lane (or the CPU lane when there is no GPU, or when the GPU
lane had no place left and the CPU lane one: ``spills_over``). The pump asks
``core.admission.decide`` for each waiting GPU job and executes the decision: reserve
pages and dispatch, wait, move to the CPU lane, or reject. A full queue answers at once.
A job refused only because no CPU path is ready, while a worker that could take it is still
starting (the gateway's start, a restart), waits for that worker instead (``_coming``).
While none of the model's workers is ready and every one that may run failed its last start
(an engine that aborts loading the file), a request is refused when it is queued, and the
queued ones with it, with that failure (503 ``model_load_failed``: ``runtime.supervisor``
rule 8), not with the refusal a full GPU gets. Not when it is promised a place: the request's
own errors (a model without a chat template is a 400) come first, and the refusal is journaled
and counted as any refusal after acceptance.

This module owns the decisions: which job leaves which lane for which worker, the breaker's
events, and when the next pass is due. The lanes themselves (queues, counters, speed and
wait estimates) and the ``Job``/``Dispatch`` values are in ``runtime.lanes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from spillover.config import LaneConfig
from spillover.core.admission import (
    AdmissionPolicy,
    AdmissionRequest,
    Admit,
    Decision,
    Delay,
    Demote,
    LaneView,
    Reject,
    Route,
    Shrink,
    decide,
    returning_bytes,
)
from spillover.core.breaker import (
    ATTEMPT_OUTCOMES,
    BreakerEvent,
    BreakerState,
    Circuit,
    advance,
    allows,
    attempt_ended,
    probe_started,
)
from spillover.core.deadlines import WAITS_FOR, DeadlineFacts, device_too_slow, late_everywhere, may_wait, wait_ends_s
from spillover.core.hostguard import HOST_REFUSALS, HostView, may_start_cpu
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import Footprint, MemoryModel
from spillover.core.reasons import Reason, RouteReason
from spillover.core.routing import DEVICE_ROUTES, MIN_SHRUNK_TOKENS, fits_lane, lane_max_tokens
from spillover.errors import CapacityError, NoWorkerReady, QueueFull
from spillover.runtime import ticks
from spillover.runtime.lanes import Dispatch, Job, Lane, LaneStatistics, fingerprint_of, places_promised
from spillover.runtime.worker_client import WorkerClient, WorkerState

__all__ = ["Dispatch", "Job", "LaneStatistics", "Scheduler"]

log = logging.getLogger("spillover.scheduler")
DEADLINE_SLACK_S = ticks.TICK_S  # a deadline's last starts are decided this early: a pass may come a tick late
# The device's estimate sends deadline work away (core.deadlines rule 4) only this long after a
# run last fed it: then the device gets the next one and is measured again (round 55: one slow
# first run kept an idle device from every request with a deadline for good).
DEVICE_ESTIMATE_FRESH_S = 60.0
IDLE_WAKE_S = 0.5  # a safety net only: nothing needs a pass without an event or a deadline
RETURN_AFTER_MIN_S = 0.5  # a failover waits on the CPU lane at least this long before it may return (``_may_move``)
HOST_RECHECK_S = 0.25  # how often CPU work held back by the host-RAM guard is looked at again
MIN_WAKE_S = 0.001
# A refusal's causes that say the device lacked memory (``Scheduler._memory_coming``): rule 6's,
# and rule 1's too long, which a shrinkable job gets when its capped size did not fit.
MEMORY_CAUSES = frozenset({Reason.MARGIN, Reason.KV_PAGES_EXHAUSTED, Reason.OBSERVED_PRESSURE, Reason.TOO_LONG_FOR_GPU})


# Why a split worker could not take a job, as a reason (``Scheduler._split_fit``).
SPLIT_REFUSALS = {
    "breaker": Reason.BREAKER_OPEN,
    "busy": Reason.GPU_BUSY,
    "room": Reason.KV_PAGES_EXHAUSTED,
    "long": Reason.TOO_LONG_FOR_GPU,
}

# What ``Scheduler._dispatch_split`` did with a job the resident profile could not take.
SplitOutcome = Literal["dispatched", "refused", "slow", "wait", "breaker", "busy", "room", "long", "no"]


class Scheduler:
    """Owns the lanes, the GPU ledger and breaker, and assigns jobs to workers."""

    def __init__(
        self,
        *,
        gpu_lane: LaneConfig | None,
        cpu_lane: LaneConfig,
        ledger: DeviceLedger | None,
        policy: AdmissionPolicy | None,
        clock: Callable[[], float] = time.monotonic,
        host_view: Callable[[int], HostView] | None = None,
        host_guard: bool = True,
    ) -> None:
        self.clock = clock
        self.host_view = host_view
        self.host_guard = host_guard
        self.cpu_blocked: Reason | Literal[""] = ""  # why queued CPU work waits ("": it does not)
        self._peak: dict[str, tuple[tuple[int, int], int]] = {}  # worker id -> ((starts, held report), peak busy)
        self.gpu = Lane("gpu", gpu_lane) if gpu_lane else None
        # the resident's context cap: its lane's, or fewer when the device holds no more
        # (``core.profiles`` rule 5; set by the chat model once it has planned its profile)
        self.gpu_ctx_cap_tokens = gpu_lane.ctx_cap_tokens if gpu_lane else 0
        self.cpu = Lane("cpu", cpu_lane)
        self.ledger = ledger
        self.policy = policy
        self.breaker = BreakerState()
        self.gpu_workers: list[WorkerClient] = []
        self.cpu_workers: list[WorkerClient] = []
        # The split profile (``core.profiles``): workers with the model's last layers on the
        # device, its memory model (their layers' KV) and context cap; set by the chat model.
        self.split_workers: list[WorkerClient] = []
        self.split_memory: MemoryModel | None = None
        self.split_ctx_cap_tokens = 0
        # The cpu profile (``core.profiles``): by plan, no worker runs on the device (``_by_plan``).
        self.off_device = False
        self.split_total = 0  # jobs the split workers took
        self.split_breaker = BreakerState()  # the split workers' own breaker (the GPU's is ``breaker``)
        self._wake = asyncio.Event()
        self._delay_due = math.inf  # the earliest end of an admission delay seen by the last pass
        self._view: LaneView | None = None  # the lanes as a pass saw them (see pump_once)
        self._host_held = False  # the last pass held CPU work back for host memory
        self.device_measured_s = -math.inf  # when the device's estimate was last fed a run
        self._cpu_may_start: bool | None = None  # the host guard's answer, asked once a pass (``_cpu_path``)
        # The pressure ladder's demotion step (set by the gateway when it has batch services):
        # idle batch services on the GPU, weights of demotions under way, and the action.
        self.demotable: Callable[[], tuple[tuple[str, int], ...]] = tuple
        self.demoting_bytes: Callable[[], int] = int
        self.demote: Callable[[str, Reason], None] = lambda name, why: None
        # The refusal while no worker of the model can start (set by the chat model:
        # ``runtime.supervisor.cannot_start``); None while one is ready or has not failed.
        self.cannot_start: Callable[[], NoWorkerReady | None] = lambda: None
        # How soon a device worker is expected ready (set by the chat model:
        # ``runtime.supervisor.back_in_s`` over its resident and split workers; inf: not expected).
        self.device_back_in_s: Callable[[], float] = lambda: math.inf
        self.decisions: deque[dict[str, Any]] = deque(maxlen=50)
        self.decision_counts: dict[str, int] = {}
        self.rebound_total = 0  # jobs routed to the CPU lane that the GPU took after all (late binding)

    def __repr__(self) -> str:
        g = len(self.gpu.queue) if self.gpu else "-"
        return f"<Scheduler gpu_q={g} cpu_q={len(self.cpu.queue)} breaker={self.breaker.circuit.value}>"

    # -- entry ---------------------------------------------------------------------
    def entry_lane(self, lane: str | None = None) -> str:
        """The lane a job asking for ``lane`` is queued on: the CPU lane when asked or when there
        is no GPU lane, else the GPU lane."""
        return "cpu" if lane == "cpu" or self.gpu is None else "gpu"

    def submit_nowait(self, job: Job, lane: str | None = None) -> None:
        """Queue a job (see ``entry_lane``), or raise QueueFull at once."""
        self._enqueue_nowait(job, self.cpu if self.entry_lane(lane) == "cpu" else self.gpu or self.cpu)

    def check_room_nowait(self, lane: str | None = None) -> None:
        """Raise QueueFull at once when the lane a job asking for ``lane`` would be queued on
        is full: a request is refused before it is accepted, not journaled and then shed."""
        self._check_room(self._lane(lane))

    def hold_place(self, rid: str, lane: str | None = None) -> None:
        """Promise request ``rid``, about to be accepted, a place on the lane a job asking for
        ``lane`` would be queued on; raise QueueFull at once when the lane is full or every
        place left (queue room and the slots that would take a job now) is promised already.
        The promise ends when its job is queued or ``release_place``; the queue's own check
        when the job is queued stays the exact bound. A request that asked for no lane and
        finds the GPU lane without a place is promised one on the CPU lane when it has one
        (``spills_over``): route to CPU comes before reject."""
        target = self._place_for(lane)
        if target is None:
            self._shed(self._lane(lane))
        else:
            target.promised.add(rid)

    def has_place(self, lane: str | None = None) -> bool:
        """Whether ``hold_place`` would promise a place now (nothing is promised or counted)."""
        return self._place_for(lane) is not None

    def _place_for(self, lane: str | None) -> Lane | None:
        """The lane ``hold_place`` promises a place on, None when it refuses."""
        target = self._lane(lane)
        if not self._no_place(target):
            return target
        spill = target is self.gpu and lane is None and not self.off_device
        if spill and any(w.state is WorkerState.READY for w in self.cpu_workers) and not self._no_place(self.cpu):
            return self.cpu  # it spills over (``spills_over``)
        return None

    def _no_place(self, lane: Lane) -> bool:
        """Every place of ``lane`` is taken or promised: its queue, and the slots that would take
        a job now."""
        return lane.free() <= 0 or places_promised(
            lane.cfg.queue_depth, len(lane.queue), len(lane.promised), self._takers(lane)
        )

    def refuse_spill(self) -> None:
        """A request promised a CPU place because the GPU lane had none (``spills_over``) that the
        CPU lane cannot hold after all (too long for it): the GPU lane's refusal, before anything
        is journaled (queued on the GPU past its promises, it took a place promised to another)."""
        self._shed(self.gpu or self.cpu)

    def spills_over(self, rid: str) -> bool:
        """Whether request ``rid``, which asked for no lane, was promised a place on the CPU lane
        because the GPU lane had none left (``hold_place``): it starts there (reason
        ``gpu_queue_full``), not refused while the CPU lane has room, and late binding may
        still move it to the GPU (``Job.movable``) once a GPU slot frees. Only onto a ready CPU
        worker, and not in the ``cpu`` profile (its GPU lane hands every job to the CPU anyway)."""
        return self.gpu is not None and rid in self.cpu.promised

    def release_place(self, rid: str) -> None:
        """Request ``rid`` no longer needs the place it was promised (idempotent)."""
        for lane in (self.gpu, self.cpu):
            if lane is not None:
                lane.promised.discard(rid)

    def _lane(self, lane: str | None) -> Lane:
        return self.cpu if self.entry_lane(lane) == "cpu" else self.gpu or self.cpu

    def _takers(self, lane: Lane) -> int:
        """At most how many jobs queued on ``lane`` now would leave its queue at once: its own
        workers' free slots (the GPU lane's: the device workers', split ones too). Not the CPU
        room admission may route GPU work to: a request promised a place on that ground went to
        the GPU queue all the same, admission could hold it there for the GPU, and the queue
        refused one after it was journaled (round 48); such a request spills over instead. The
        ``cpu`` profile's GPU lane hands every job to the CPU lane, whose room it counts."""
        cpu = sum(w.free_slots for w in self.cpu_workers)
        if lane is self.cpu:
            return cpu
        if self.off_device:
            return cpu + max(0, self.cpu.free() - len(self.cpu.promised))
        return sum(w.free_slots for w in (*self.gpu_workers, *self.split_workers))

    def _check_room(self, lane: Lane) -> None:
        if lane.free() <= 0:
            self._shed(lane)

    def _shed(self, lane: Lane) -> None:
        lane.shed_total += 1
        raise QueueFull(
            f"the {lane.name} queue is full ({lane.cfg.queue_depth} waiting)",
            retry_after_s=self._retry_after_s(lane),
        )

    def _enqueue_nowait(self, job: Job, lane: Lane) -> None:
        self.release_place(job.rid)  # its job takes the place now (or is refused)
        if (failed := self.cannot_start()) is not None:  # none of its workers can start
            raise failed
        if lane is self.cpu:
            self._check_deadline(job)
        self._check_room(lane)
        job.enqueued_s = self.clock()
        lane.append(job, job.enqueued_s, self._slots(lane))
        self.pump_once()  # a free slot takes the job at once: queue bounds stay exact

    def _check_deadline(self, job: Job) -> None:
        """Refuse at once a CPU job that cannot finish before the client's deadline; the
        refusal's estimate and Retry-After count the lane's running requests too (round 61:
        they did not, so a client that retried then was refused again), and, for a job the
        device may take (``Job.movable``), the device's return while its worker restarts
        (``_device_done_s``) when that is sooner."""
        if job.deadline_s is None:
            return
        if self.clock() + self._eta_s(job, self.cpu) > job.deadline_s:
            est = retry = self._eta_s(job, self.cpu, running=True)
            again = ""
            if (done := self._device_done_s(job)) < est:
                retry, again = done, f"; the device is expected back in about {self._device_back_s(job):.1f}s"
            raise CapacityError(
                f"the CPU lane would finish this request in about {est:.1f}s, after its deadline{again}",
                retry_after_s=max(1.0, retry),
                code="deadline_exceeded",
            )

    def _device_back_s(self, job: Job) -> float:
        """While no device worker is ready: how soon one is expected ready to take ``job``
        (``device_back_in_s``, and past the cooldown of its breaker should it have opened: the
        resident's, or the split's in the split-only profile; round 65: a refusal while the
        device restarted in 2 s said 16 s, the CPU lane's queue). Infinity while one is ready
        (its own estimates decide), when none is expected, or for a job longer than the
        device's context (the CPU lane's own)."""
        device = self.gpu_workers + self.split_workers
        if self.gpu is None or not device or any(w.state is WorkerState.READY for w in device):
            return math.inf
        cap = self._device_ctx_cap_tokens() or 0
        if not fits_lane(
            job.prompt_tokens, job.max_tokens, cap, shrinkable=job.allow_shrink, min_tokens=MIN_SHRUNK_TOKENS
        ):
            return math.inf
        back = self.device_back_in_s()
        if back == math.inf:
            return back
        breaker = self.breaker if self.gpu_workers else self.split_breaker
        return max(back, breaker.retry_after_s(self.clock()))

    def _device_ctx_cap_tokens(self) -> int | None:
        """The longest context the device's workers serve: the resident's (fewer tokens on a
        small device) or the split worker's, as admission counts them; None with neither."""
        caps = [self.gpu_ctx_cap_tokens] if self.gpu_workers else []
        caps += [self.split_ctx_cap_tokens] if self.split_workers else []
        return max(caps, default=None)

    def _device_job_s(self, job: Job) -> float:
        """The device's estimate of ``job``'s own work, at what it would run with there."""
        assert self.gpu is not None
        return self.gpu.job_seconds(job.prompt_tokens, self._device_max_tokens(job))

    def _device_done_s(self, job: Job) -> float:
        """For a job the device may take (``Job.movable``): how soon the device, restarting,
        would be back and have finished it (``_device_back_s``); infinity otherwise."""
        back = self._device_back_s(job) if job.movable else math.inf
        return back if back == math.inf else back + self._device_job_s(job)

    def _workers_of(self, lane: Lane) -> list[WorkerClient]:
        """The workers that take ``lane``'s jobs: the CPU workers, or the resident and the
        split worker."""
        return self.cpu_workers if lane is self.cpu else self.gpu_workers + self.split_workers

    def _slots(self, lane: Lane) -> int:
        """The slots of ``_workers_of(lane)`` (round 62: the GPU lane's configured count left the
        split's out, or counted a resident the split-only profile does not have)."""
        return sum(w.spec.slots for w in self._workers_of(lane))

    def _eta_s(self, job: Job, lane: Lane, running: bool = False) -> float:
        """How long ``job`` would take on ``lane`` from now, for its deadline: the work queued
        ahead of it (none on the GPU lane, where it starts when admitted) and its own, at the
        ``max_tokens`` it would run with there (a shrinkable job is cut to the CPU lane's
        context). The CPU lane's running requests are counted only with ``running``: any of
        them may end at its next token, so a job they would make late at their ``max_tokens``
        is queued, and refused at its last start if they have not ended by then (round 60:
        counted at their ``max_tokens``, they had a quarter of the deadline requests a CPU-only
        lane would have served in time refused at once, where answers end early)."""
        if lane is not self.cpu:
            return lane.job_seconds(job.prompt_tokens, job.max_tokens)
        return self.cpu.estimated_delay_s(self.clock(), self._slots(self.cpu), running) + self.cpu.job_seconds(
            job.prompt_tokens, self.cpu.max_tokens_of(job)
        )

    def _device_max_tokens(self, job: Job) -> int:
        """The ``max_tokens`` a job runs with on the device at most: a shrinkable one is cut to
        the resident's context while a resident could take it (ready, its breaker letting
        requests through, the job within its context), else the split's when there is a split
        worker, starting or not (round 55: a dead resident's context timed a job only the split
        would run; round 56: one too long for the resident was timed at one token; round 57: the
        split-only profile's starting split at the GPU lane's); admission may shrink it further
        to the memory there is."""
        assert self.policy is not None
        resident = (
            any(w.state is WorkerState.READY for w in self.gpu_workers)
            and allows(self.breaker, self.policy.breaker)
            and fits_lane(
                job.prompt_tokens,
                job.max_tokens,
                self.gpu_ctx_cap_tokens,
                shrinkable=job.allow_shrink,
                min_tokens=MIN_SHRUNK_TOKENS,
            )
        )
        cap = self.split_ctx_cap_tokens if self.split_workers and not resident else self.gpu_ctx_cap_tokens
        return lane_max_tokens(job.prompt_tokens, job.max_tokens, cap, shrinkable=job.allow_shrink)

    def _cpu_eta_now_s(self, job: Job) -> float:
        """How long the CPU lane would take to finish ``job`` were it sent there now
        (``_eta_s``), or infinity when it could not take it: no CPU path (``_cpu_path``), or
        the job too long for its context, as admission has it (a shrinkable one keeps at least
        ``MIN_SHRUNK_TOKENS``: round 55)."""
        if not self._cpu_path() or not fits_lane(
            job.prompt_tokens,
            job.max_tokens,
            self.cpu.cfg.ctx_cap_tokens,
            shrinkable=job.allow_shrink,
            min_tokens=MIN_SHRUNK_TOKENS,
        ):
            return math.inf
        return self._eta_s(job, self.cpu)

    def _cpu_path(self) -> bool:
        """Whether a GPU-lane job may go to the CPU lane now: allowed, a ready CPU worker, a
        place in its queue (admission's rule 7), and the host-RAM guard letting a request
        start there (``_host_lets_cpu_start``, asked once a pass: round 55, the last pass's
        hold was stale) (round 53: a dead worker's or a full queue's estimate decided deadlines
        it could never meet; round 54b: a held lane's free slot let one more in past the
        queue's depth)."""
        if self.policy is None or not self.policy.allow_cpu_route or self.cpu.free() <= 0:
            return False
        if not any(w.state is WorkerState.READY for w in self.cpu_workers):
            return False
        if self._cpu_may_start is None:  # once a pass: no CPU request starts before its dispatch
            self._cpu_may_start = self._host_lets_cpu_start()
        return self._cpu_may_start

    def _host_lets_cpu_start(self) -> bool:
        """The host-RAM guard's answer for the next CPU request on a ready worker with a free
        slot; with every slot busy, the request queues (the lane's wait counts what is queued
        ahead: round 56, a busy slot read as a hold)."""
        worker = next((w for w in self.cpu_workers if w.state is WorkerState.READY and w.free_slots > 0), None)
        if self.host_view is None or worker is None:
            return True
        return may_start_cpu(self.host_view(worker.busy), self.host_guard)[0]

    def _deadline(self, job: Job, now: float, device_tokens: int | None = None) -> DeadlineFacts | None:
        """What ``core.deadlines`` decides a job's deadline on: the device's estimate at
        ``device_tokens`` (by default what it would run with there, ``_device_max_tokens``;
        round 54b: a shrinkable job's wait was timed at its whole ``max_tokens``), the CPU
        lane's from now. None without a deadline."""
        if job.deadline_s is None:
            return None
        assert self.gpu is not None
        tokens = self._device_max_tokens(job) if device_tokens is None else device_tokens
        return DeadlineFacts(
            now_s=now,
            deadline_s=job.deadline_s,
            device_s=self.gpu.job_seconds(job.prompt_tokens, tokens),
            cpu_s=self._cpu_eta_now_s(job),
            device_measured=self.gpu.samples > 0 and now - self.device_measured_s <= DEVICE_ESTIMATE_FRESH_S,
            slack_s=DEADLINE_SLACK_S,
        )

    def _may_wait(self, job: Job, now: float) -> bool:
        """Whether the job's deadline (if any) still lets it wait for the device (rule 2)."""
        f = self._deadline(job, now)
        return f is None or may_wait(f)

    def _late_everywhere(self, job: Job, max_tokens: int, now: float) -> bool:
        """Refuse (``deadline_exceeded``) a job the device would start now (``max_tokens``
        there) when no lane would finish it in time (``core.deadlines`` rule 3): True when it
        was refused."""
        f = self._deadline(job, now, max_tokens)
        if f is None or not late_everywhere(f):
            return False
        assert self.gpu is not None
        self.gpu.queue.remove(job)
        self.gpu.shed_total += 1
        on_cpu = f", the CPU lane in about {f.cpu_s:.1f}s" if f.cpu_s < math.inf else ""
        self._fail(
            job,
            CapacityError(
                "no lane would finish this request before its deadline"
                f" (the device in about {f.device_s:.1f}s{on_cpu})",
                retry_after_s=max(1.0, min(f.device_s, f.cpu_s)),
                code="deadline_exceeded",
            ),
        )
        return True

    def _device_too_slow(self, job: Job, max_tokens: int, now: float) -> bool:
        """Whether a job the device would start now (``max_tokens`` there) goes to the CPU lane
        instead (``cpu_meets_deadline``, ``core.deadlines`` rule 4; round 53: an idle device
        measured too slow was given it)."""
        f = self._deadline(job, now, max_tokens)
        return f is not None and device_too_slow(f)

    def _waits_for_the_device(self, job: Job, d: Decision, now: float, split_busy: bool) -> bool:
        """A job sent to the CPU lane (past its delay, say) that the CPU lane cannot finish
        before its client's deadline waits on for a busy device (the resident's reason, or
        ``split_busy``: the split's slot or room, round 54b) while the device still could
        (``core.deadlines`` rule 5), when there is one: True when it waits."""
        busy = isinstance(d, Route) and (d.reason in WAITS_FOR or split_busy)
        if not busy or not (self.gpu_workers or self.split_workers):
            return False
        f = self._deadline(job, now)
        if f is None or f.cpu_in_time or not may_wait(f):
            return False
        assert self.gpu is not None
        self._wake_by(job, job.enqueued_s + self.gpu.cfg.queue_max_age_s, now)
        return True

    def cpu_ctx_cap_tokens(self) -> int:
        """The CPU lane's context cap (prompt + max_tokens)."""
        return self.cpu.cfg.ctx_cap_tokens

    @property
    def host_held(self) -> Reason | None:
        """Why the host-RAM guard holds the work queued on the CPU lane (``HOST_REFUSALS``, as
        the last pass found it), None when it does not: ``/v1/status``'s mode and chat row."""
        return (self.cpu_blocked or None) if self.cpu.queue and self.cpu_blocked in HOST_REFUSALS else None

    def withdraw(self, job: Job) -> None:
        """Remove a job that is still queued (its client went away)."""
        for lane in (self.gpu, self.cpu):
            if lane is not None and job in lane.queue:
                lane.queue.remove(job)
        self.kick()

    def kick(self) -> None:
        """Wake the pump."""
        self._wake.set()

    def look_again(self) -> None:
        """Device bytes changed outside this scheduler (a reading, another service's request or
        worker): wake the pump when a job waits on a lane. With both queues empty a pass would
        decide nothing, and the deadlines it keeps (the breaker's) wake it anyway (``_due``); an
        embeddings request would otherwise cost every idle chat scheduler a pass, twice."""
        if self.cpu.queue or (self.gpu is not None and self.gpu.queue):
            self._wake.set()

    def record_timing(
        self,
        lane: str,
        prompt_tokens: int,
        completion_tokens: int,
        prefill_s: float,
        total_s: float,
        answer_tokens: int | None = None,
    ) -> None:
        """Feed a finished attempt's measured speed (the tokens it prefilled and wrote) and its
        answer's length (``answer_tokens``, a continuation's delivered tokens too; by default
        ``completion_tokens``) into its lane's running estimates."""
        target = self.gpu if lane in DEVICE_ROUTES else self.cpu  # a split's runs are the device's (not the CPU lane's)
        if target is not None:
            target.record(prompt_tokens, completion_tokens, prefill_s, total_s, answer_tokens)
        if target is self.gpu:
            self.device_measured_s = self.clock()

    def confirmed(self, rid: str) -> None:
        """The worker reports the request's device memory allocated."""
        if self.ledger is not None:
            self.ledger.confirm(rid, self.clock())

    # -- completion ----------------------------------------------------------------
    def finished(self, rid: str, d: Dispatch, outcome: str) -> None:
        """Return a job's reservation and feed the breaker with the attempt's outcome
        (``core.breaker`` rule 7: ``ok`` | ``failed`` | ``severe`` count; ``cancelled`` and
        ``client`` only end a probe)."""
        if d.route in DEVICE_ROUTES and self.ledger is not None and self.ledger.holds(rid):
            self.ledger.release(rid, self.clock())
        lane = self.gpu if d.route in DEVICE_ROUTES else self.cpu
        if lane is not None:  # the attempt's own lane (a failover's next attempt may run already)
            lane.ended(rid)
        if self.policy is not None and outcome in ATTEMPT_OUTCOMES:
            if d.route == "gpu":
                self.breaker = attempt_ended(self.breaker, outcome, d.probe_round, self.clock(), self.policy.breaker)
            elif d.route == "split":
                self.split_breaker = attempt_ended(
                    self.split_breaker, outcome, d.probe_round, self.clock(), self.policy.breaker
                )
        self.kick()

    # -- the pump ------------------------------------------------------------------
    async def run(self) -> None:
        """Decide and dispatch until cancelled. A pass runs on an event (``kick``: a request
        queued or finished, a device reading, a worker change) or at the earliest deadline a
        pass can act on (``_due``); no polling."""
        while True:
            self._wake.clear()
            try:
                self.pump_once()
            except Exception:  # a bug must not stop every later dispatch: log it, go on
                log.exception("scheduler pass failed")
            now = self.clock()
            due = self._due(now)
            # Only the safety net: it ends on the shared tick (``runtime.ticks`` rule 4), no wake-up of its own.
            net = due >= now + IDLE_WAKE_S
            when = ticks.at(IDLE_WAKE_S) if net else asyncio.get_running_loop().time() + max(MIN_WAKE_S, due - now)
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: wait_for makes a task each pass
                async with asyncio.timeout_at(when):
                    await self._wake.wait()

    def _due(self, now: float) -> float:
        """The earliest moment a pass can decide something new without an event: a queued
        job's maximum age, the end of an admission delay, the breaker's cooldown or probe
        bound, the next host-memory reading while the host guard holds CPU work back."""
        due = now + IDLE_WAKE_S
        for lane in (self.gpu, self.cpu):
            if lane is not None and lane.queue:
                due = min(due, min(j.enqueued_s for j in lane.queue) + lane.cfg.queue_max_age_s)
        due = min(due, self._delay_due)
        for b in (self.breaker, self.split_breaker):
            if b.circuit is Circuit.OPEN:
                due = min(due, b.opened_at_s + b.cooldown_s)
            elif b.circuit is Circuit.HALF_OPEN and b.probes_in_flight and self.policy is not None:
                due = min(due, b.probe_started_s + self.policy.breaker.probe_timeout_s)
        if self.cpu.queue and self._host_held:
            due = min(due, now + HOST_RECHECK_S)
        return due

    def lane_view(self) -> LaneView:
        gpu_ready = any(w.state is WorkerState.READY for w in self.gpu_workers)
        cpu_ready = any(w.state is WorkerState.READY for w in self.cpu_workers)
        return LaneView(
            gpu_ready=gpu_ready,
            gpu_free_slots=sum(w.free_slots for w in self.gpu_workers),
            gpu_ctx_cap_tokens=self.gpu_ctx_cap_tokens if self.gpu else 0,
            cpu_ready=cpu_ready,
            cpu_queue_free=self.cpu.free(),
            cpu_ctx_cap_tokens=self.cpu.cfg.ctx_cap_tokens,
            cpu_retry_after_s=self._retry_after_s(),
            demotable=self.demotable(),
            demoting_bytes=self.demoting_bytes(),
        )

    def pump_once(self) -> None:
        """One pass: expire old jobs, decide GPU jobs, dispatch CPU jobs."""
        now = self.clock()
        self._delay_due = math.inf
        self._cpu_may_start = None
        for lane in (self.cpu, self.gpu):
            if lane is not None:
                lane.forget_unclaimed(self._workers_of(lane))
        if self.policy is not None:
            self.breaker = advance(self.breaker, BreakerEvent.TICK, now, self.policy.breaker)
            self.split_breaker = advance(self.split_breaker, BreakerEvent.TICK, now, self.policy.breaker)
        for lane in (self.gpu, self.cpu):
            if lane is None:
                continue
            for job in [j for j in lane.queue if now - j.enqueued_s > lane.cfg.queue_max_age_s]:
                retry_after_s = self._retry_after_s(lane)  # with itself still queued: what a retry waits behind
                lane.queue.remove(job)
                lane.expired_total += 1
                held = f" (held: {self.cpu_blocked})" if lane is self.cpu and self.cpu_blocked else ""
                held = held or (f" (waiting out: {job.waits_for})" if job.waits_for else "")
                self._fail(
                    job,
                    CapacityError(
                        f"waited {lane.cfg.queue_max_age_s:.0f}s in the {lane.name} queue{held}",
                        retry_after_s=retry_after_s,
                        code="queue_timeout",
                    ),
                )
            for job in [j for j in lane.queue if j.future.done()]:
                lane.queue.remove(job)
            if lane is self.cpu:
                self._expire_past_deadline(now)
            if lane.queue and (failed := self.cannot_start()) is not None:
                for job in lane.queue:
                    self._fail(job, self.cannot_start() or failed)  # each caller its own error
                lane.queue.clear()
        if self.gpu is not None and self.ledger is not None and self.policy is not None:
            # The lanes as they are, seen once for every job the pass delays (a job that is
            # not delayed changes them); each pass, and the late-binding loop after it, reads afresh.
            self._view = None
            for job in list(self.gpu.queue):
                self._decide_gpu(job, now)
            self._view = None
            self._rebind_to_gpu(now)
            self._rebind_to_split(now)
        self._expire_past_deadline(now)  # the jobs this pass queued: a pass at their last start
        self._dispatch_cpu(now)

    def _record(self, job: Job, d: Decision, now: float) -> None:
        name = type(d).__name__.lower()
        key = f"{name}:{d.reason}"
        self.decision_counts[key] = self.decision_counts.get(key, 0) + 1
        if isinstance(d, Delay) and job.last_reason is d.reason:
            return
        if not isinstance(d, Reject):  # a rejected job ends here: it has no lane to report
            job.last_reason = d.reason
        self.decisions.append(
            {"t_s": round(now, 3), "rid": job.rid, "decision": name, "reason": str(d.reason), "route": d.route}
        )

    def _admission(self, job: Job, now: float) -> Decision:
        """``core.admission.decide`` for a queued job, on the lanes as they are now."""
        assert self.ledger is not None and self.policy is not None
        arrived_s = job.arrived_s
        if not self._may_wait(job, now):  # waiting on would miss the deadline: decided as after its delay (rule 5)
            arrived_s = min(arrived_s, now - self.policy.delay_max_s)
        req = AdmissionRequest(
            request_id=job.rid,
            prompt_tokens=job.prompt_tokens,
            max_tokens=job.max_tokens,
            arrived_s=arrived_s,
            allow_shrink=job.allow_shrink,
        )
        if self._view is None:
            self._view = self.lane_view()
        return decide(req, self.ledger, self._view, self.breaker, now, self.policy)

    def _decide_gpu(self, job: Job, now: float) -> None:
        assert self.gpu is not None and self.ledger is not None and self.policy is not None
        d: Decision
        split: SplitOutcome = "no"
        if self._device_too_slow(job, self._device_max_tokens(job), now):  # free or busy (round 54b)
            d = Route(Reason.CPU_MEETS_DEADLINE)
            self._view = None
        else:
            d = self._admission(job, now)
            if not isinstance(d, Delay):  # anything else may change the lanes: the next job looks again
                self._view = None
        if isinstance(d, Route | Reject) and d.reason is not Reason.CPU_MEETS_DEADLINE:
            split = self._dispatch_split(job, d, now)
            if split == "dispatched":  # recorded as a split decision
                return
            if split == "refused":  # failed: its client's deadline
                return
            if split == "wait":  # a split slot or its room is coming back: bounded, as admission's delay
                self._wake_by(job, job.enqueued_s + self.policy.delay_max_s, now)
                return
            if split == "slow":  # the split would finish past the client's deadline, the CPU lane in time
                d = Route(Reason.CPU_MEETS_DEADLINE)
            elif split != "no" and not self.gpu_workers:  # only the split runs: why it could not is the device's
                d = self._split_refused(d, split, now)
            elif split == "breaker" and isinstance(d, Reject):  # beside a resident: its cooldown still counts
                d = dataclasses.replace(d, retry_after_s=max(d.retry_after_s, self.split_breaker.retry_after_s(now)))
            d = self._by_plan(d)
        # What could take it comes (a worker, a slot, our own requests' memory)?
        # Not a split worker's slot or start (round 57: such waits held the GPU queue's places
        # from requests the idle resident would run).
        comes = isinstance(d, Reject) and (self._coming(d) or self._slot_coming(d) or self._memory_coming(job, d, now))
        if comes and self._may_wait(job, now):  # it waits, as long as its deadline lets it
            job.waits_for = d.reason
            self._wake_by(job, job.enqueued_s + self.gpu.cfg.queue_max_age_s, now)
            return
        job.waits_for = ""
        if isinstance(d, Admit | Shrink):
            tokens = d.max_tokens if isinstance(d, Shrink) else job.max_tokens
            if self._late_everywhere(job, tokens, now):
                return  # the client's deadline comes first
            if self._device_too_slow(job, tokens, now):
                d = Route(Reason.CPU_MEETS_DEADLINE)
        if self._waits_for_the_device(job, d, now, split in ("busy", "room")):
            job.waits_for = f"the device, within its deadline ({d.reason})"
            return
        self._record(job, d, now)
        if isinstance(d, Admit | Shrink):
            self._dispatch_gpu(job, d, now, self.gpu)
        elif isinstance(d, Route):
            self.gpu.queue.remove(job)
            job.movable = True  # late binding checks the deadline itself (``_may_move``); its refusal too
            try:
                self._check_deadline(job)
            except CapacityError as exc:
                self.cpu.shed_total += 1  # the CPU lane could not finish it in time
                self._fail(job, exc)
                return
            job.last_reason = d.reason
            self.cpu.append(job, now, self._slots(self.cpu))
        elif isinstance(d, Reject):
            self.gpu.queue.remove(job)
            (self.cpu if d.refusal == Reason.CPU_QUEUE_FULL else self.gpu).shed_total += 1  # whose queue was full
            late = comes  # it would have waited for what comes, but not past its deadline
            self._fail(
                job,
                CapacityError(
                    f"no capacity for this request now ({d.reason})"
                    + (", and none that would come before its deadline" if late else ""),
                    retry_after_s=d.retry_after_s,
                    code="deadline_exceeded" if late else d.refusal,
                ),
            )
        elif isinstance(d, Delay):  # leave it queued; a pass asks again at the latest then
            self._wake_by(job, d.until_s, now)
        elif isinstance(d, Demote):  # unload a batch service; the job waits for its memory
            self.demote(d.service, d.reason)
            self._wake_by(job, d.until_s, now)

    def _expire_past_deadline(self, now: float) -> None:
        """A job queued on the CPU lane that could no longer finish before its client's
        deadline, were it to start now, is refused (``deadline_exceeded``); the others get a
        pass when that moment comes (round 53: one queued behind a long running job started
        four seconds past its deadline). A pass runs it before the GPU lane's decisions (their
        view of the CPU queue without the jobs it refuses: round 55) and again at its end (the
        jobs it queued get their pass: round 54b). A job whose last start came while no pass
        ran is refused even when a device frees in the same pass: late binding had the passes
        before it (a pass comes at each last start, ``DEADLINE_SLACK_S`` late at most)."""
        for job in [j for j in self.cpu.queue if j.deadline_s is not None]:
            assert job.deadline_s is not None
            last = job.deadline_s - self.cpu.job_seconds(job.prompt_tokens, self.cpu.max_tokens_of(job))
            if now <= last:
                self._delay_due = min(self._delay_due, last + DEADLINE_SLACK_S)
                continue
            self.cpu.queue.remove(job)
            self.cpu.expired_total += 1
            self._fail(
                job,
                CapacityError(
                    "waited in the cpu queue until it could no longer finish before its deadline",
                    retry_after_s=max(1.0, min(self._retry_after_s(self.cpu), self._device_done_s(job))),
                    code="deadline_exceeded",
                ),
            )

    def _wake_by(self, job: Job, until_s: float, now: float) -> None:
        """A pass at ``until_s`` at the latest, or when the job's deadline ends its wait (one
        still ahead: a wait it ended is decided in this pass, never a pass in the past)."""
        f = self._deadline(job, now)
        end = None if f is None else wait_ends_s(f)
        self._delay_due = min(self._delay_due, until_s if end is None or end <= now else min(until_s, end))

    def _reserve(self, rid: str, nbytes: int, now: float) -> bool:
        """Reserve a job's device bytes; False when they do not fit, or when an earlier
        attempt of the same request still holds its reservation: that attempt's worker has not
        let go of the request yet (``Execution._release``), so the job waits for its release."""
        assert self.ledger is not None
        return not self.ledger.holds(rid) and self.ledger.reserve_nowait(rid, nbytes, now) is not None

    def _dispatch_gpu(self, job: Job, d: Admit | Shrink, now: float, lane: Lane) -> bool:
        """Reserve the admitted job's pages and hand it a GPU slot (taking it off ``lane``);
        False when no slot or the pages are no longer there (it stays queued)."""
        assert self.gpu is not None and self.ledger is not None and self.policy is not None
        worker = next((w for w in self.gpu_workers if w.free_slots > 0), None)
        if worker is None or not self._reserve(job.rid, d.nbytes, now):
            return False
        self.breaker, probe_round = probe_started(self.breaker, now, self.policy.breaker)
        lane.queue.remove(job)
        self.gpu.admitted_total += 1
        max_tokens = d.max_tokens if isinstance(d, Shrink) else job.max_tokens
        worker.claim_slot(job.rid)
        self.gpu.started(job, now, max_tokens)
        job.future.set_result(
            Dispatch(
                worker,
                "gpu",
                d.reason,
                max_tokens,
                d.kv_tokens,
                d.nbytes,
                isinstance(d, Shrink),
                now - job.enqueued_s,
                job.position,
                job.estimated_delay_ms,
                probe_round,
            )
        )
        return True

    def _coming(self, d: Reject) -> bool:
        """A refusal for want of a CPU path, while a worker that could take the job is starting
        (the gateway's start, or a restart): the device worker for a job refused because none is
        ready, or a CPU worker when none is ready and the policy routes to the CPU. The job then
        waits for it (a worker's READY kicks a pass) up to the GPU lane's ``queue_max_age_s``;
        a start that fails leaves nothing starting, and the next pass refuses it. A job too long
        for the CPU lane waits for a starting device worker too (round 30: right after the
        start, with the CPU worker up first, a request within the GPU's cap was a 503)."""
        if d.refusal not in (Reason.CPU_UNAVAILABLE, Reason.TOO_LONG_FOR_CPU):
            return False

        def starting(workers: list[WorkerClient]) -> bool:
            return any(w.state is WorkerState.STARTING for w in workers)

        device = d.cause is Reason.GPU_UNAVAILABLE and starting(self.gpu_workers + self.split_workers)
        cpu_ready = any(w.state is WorkerState.READY for w in self.cpu_workers)
        cpu = (
            d.refusal is Reason.CPU_UNAVAILABLE
            and self.policy is not None
            and self.policy.allow_cpu_route
            and not cpu_ready
            and starting(self.cpu_workers)
        )
        return device or cpu

    def _slot_coming(self, d: Reject) -> bool:
        """A refusal of a job that fits the device and found every GPU slot taken past
        ``delay_max_s``, which the CPU path cannot take (its worker down or restarting, its
        queue full, the job too long for it): a slot comes back when a running request ends
        (a pass follows), so the job waits for one up to the GPU lane's ``queue_max_age_s``.
        It was refused ``gpu_busy+cpu_unavailable`` while the GPU was healthy and the CPU
        worker waited out a restart's back-off (round 16)."""
        return d.cause is Reason.GPU_BUSY and any(w.state is WorkerState.READY for w in self.gpu_workers)

    def _memory_coming(self, job: Job, d: Reject, now: float) -> bool:
        """A refusal for want of device memory, past ``delay_max_s``, of a job the CPU path cannot
        take (its worker down or restarting, its queue full, the job too long for it), when the
        memory our own running requests hold (and a demotion under way) would make room: it comes back as
        they do (each end, and each device reading that changed, starts a pass), so the job waits
        for it, as for a slot (``_slot_coming``), up to the GPU lane's ``queue_max_age_s``. Memory another
        process holds (a tenant), or a job larger than all that can come back (at its least, when
        it may shrink), is still refused at once. On a device just too small for the lane's cap, a
        shrinkable request over the CPU's cap was a 503 whenever any request ran beside it (round
        30, left then)."""
        assert self.ledger is not None and self.policy is not None and self.gpu is not None
        if d.cause not in MEMORY_CAUSES or not any(w.state is WorkerState.READY for w in self.gpu_workers):
            return False
        if not allows(self.breaker, self.policy.breaker):
            return False
        cap = self.gpu_ctx_cap_tokens
        if not fits_lane(
            job.prompt_tokens, job.max_tokens, cap, shrinkable=job.allow_shrink, min_tokens=MIN_SHRUNK_TOKENS
        ):
            return False
        room = self.ledger.headroom(now)
        if room is None:
            return False
        # one that may shrink needs room for its least form (admission shrinks it to the room there is)
        tokens = min(job.max_tokens, MIN_SHRUNK_TOKENS) if job.allow_shrink else job.max_tokens
        need = self.policy.memory.request_footprint(job.prompt_tokens, tokens).total_bytes
        return need <= room + returning_bytes(self.ledger, now) + self.demoting_bytes()  # rule 6a's, a demotion's too

    def _by_plan(self, d: Route | Reject) -> Route | Reject:
        """The cpu profile (``core.profiles``): no worker runs on the device, by plan, so a job
        admission finds no GPU for goes to the CPU because the model does not fit the device
        (``resident_does_not_fit``), not because a GPU is unavailable."""
        if not self.off_device:
            return d
        if isinstance(d, Route) and d.reason is Reason.GPU_UNAVAILABLE:
            return dataclasses.replace(d, reason=Reason.RESIDENT_DOES_NOT_FIT)
        if isinstance(d, Reject) and d.cause is Reason.GPU_UNAVAILABLE:
            return dataclasses.replace(d, cause=Reason.RESIDENT_DOES_NOT_FIT)
        return d

    def _split_refused(
        self, d: Route | Reject, why: Literal["breaker", "busy", "room", "long"], now: float
    ) -> Route | Reject:
        """The admission's decision for a job the split worker turned away when no resident
        worker runs (admission, seeing no GPU worker, says ``gpu_unavailable``): it says why the
        split did, as the GPU's own decisions do: ``breaker_open`` (a refusal's Retry-After at
        least the breaker's cooldown), ``gpu_busy`` (every split slot taken past
        ``delay_max_s``), or ``kv_pages_exhausted`` (its reservation did not fit the device)."""
        reason = SPLIT_REFUSALS[why]
        if isinstance(d, Route):
            return dataclasses.replace(d, reason=reason)
        wait = self.split_breaker.retry_after_s(now) if why == "breaker" else 0.0
        return dataclasses.replace(d, cause=reason, retry_after_s=max(d.retry_after_s, wait))

    def _dispatch_split(self, job: Job, d: Route | Reject, now: float) -> SplitOutcome:
        """A job the resident profile cannot take (admission routed it off the GPU or refused
        it) runs on a split worker instead, when one has a free slot, the job fits its context
        cap and its reservation (KV of the layers on the device, compute, fragmentation) fits
        the ledger now (``dispatched``). Its reason is the admission's, or
        ``resident_does_not_fit`` when only the split profile runs.

        When a ready split worker could take it but has no free slot or no room now, the job
        waits (``wait``) until ``delay_max_s`` after it was queued, as admission's own delay
        does (a slot ends, a release or a fresh reading brings the room back); past that the
        decision stands, and the answer says which it was (``busy``, ``room``); with no split
        worker ready or a job longer than its cap, it stands too (``no``); while the split
        worker's own breaker turns jobs away, too (``breaker``). A job longer than the split's
        context cap runs there shrunk to it when the client allows shrinking (and at least
        ``MIN_SHRUNK_TOKENS`` are left), as admission shrinks onto the resident; otherwise it
        stands (``long``)."""
        if self.ledger is None or self.split_memory is None or self.gpu is None or self.policy is None:
            return "no"
        waiting = now - job.enqueued_s < self.policy.delay_max_s and self._may_wait(job, now)
        budget = self._split_tokens(job)
        if budget is None and any(w.state is WorkerState.READY for w in self.split_workers):
            return "long"
        max_tokens, shrunk = budget or (job.max_tokens, False)
        fit = self._split_fit(job.prompt_tokens, max_tokens, now)
        if isinstance(fit, str):
            return "wait" if waiting and fit in ("busy", "room") else fit
        worker, fp = fit
        if self._late_everywhere(job, max_tokens, now):  # its client's deadline comes first
            return "refused"
        if self._device_too_slow(job, max_tokens, now):
            return "slow"
        if not self._reserve(job.rid, fp.total_bytes, now):  # as _split_fit found, unless a lease is still out
            return "wait" if waiting else "room"
        cause = d.cause if isinstance(d, Reject) else d.reason  # why it left the resident profile
        self._take_split(job, self.gpu, worker, fp, cause, max_tokens, shrunk, now)
        return "dispatched"

    def _split_tokens(self, job: Job) -> tuple[int, bool] | None:
        """The job's ``max_tokens`` on the split worker, and whether it was shrunk to the
        split's context cap to fit there (a client that allows shrinking, with at least
        ``MIN_SHRUNK_TOKENS`` left); None when it is longer than the cap and may not be."""
        cap = self.split_ctx_cap_tokens
        if job.prompt_tokens + job.max_tokens <= cap:
            return job.max_tokens, False
        if job.allow_shrink and job.prompt_tokens + MIN_SHRUNK_TOKENS <= cap:
            return cap - job.prompt_tokens, True
        return None

    def _take_split(
        self, job: Job, lane: Lane, worker: WorkerClient, fp: Footprint, cause: RouteReason, max_tokens: int,
        shrunk: bool, now: float,
    ) -> None:  # fmt: skip
        """Hand ``job`` (queued on ``lane``, its reservation ``fp`` made) the split worker's slot;
        ``cause``: why it left the resident profile (``resident_does_not_fit`` when only the
        split runs)."""
        assert self.policy is not None and self.gpu is not None
        self.split_breaker, probe_round = probe_started(self.split_breaker, now, self.policy.breaker)
        lane.queue.remove(job)
        self.split_total += 1
        reason = cause if self.gpu_workers else Reason.RESIDENT_DOES_NOT_FIT
        job.last_reason = reason
        key = f"split:{reason}"
        self.decision_counts[key] = self.decision_counts.get(key, 0) + 1
        self.decisions.append(
            {"t_s": round(now, 3), "rid": job.rid, "decision": "split", "reason": str(reason), "route": "split"}
        )
        worker.claim_slot(job.rid)
        self.gpu.started(job, now, max_tokens)
        job.future.set_result(
            Dispatch(
                worker,
                "split",
                reason,
                max_tokens,
                fp.kv_tokens,
                fp.total_bytes,
                shrunk,
                now - job.enqueued_s,
                job.position,
                job.estimated_delay_ms,
                probe_round,
            )
        )

    def _split_fit(
        self, prompt_tokens: int, max_tokens: int, now: float, *, settling: bool = False
    ) -> tuple[WorkerClient, Footprint] | Literal["breaker", "busy", "room", "no"]:
        """The split worker and footprint that could take a job of this size now (nothing is
        taken), or why none could: ``no`` (no split worker ready, or the job is longer than its
        cap), ``breaker`` (its breaker turns jobs away), ``busy`` (no free slot), ``room`` (its
        reservation does not fit the ledger; with ``settling``, not even with the room the next
        reading gives back: ``DeviceLedger.settling_bytes``, a model that just loaded)."""
        if self.ledger is None or self.split_memory is None or self.policy is None:
            return "no"
        ready = [w for w in self.split_workers if w.state is WorkerState.READY]
        if not ready or prompt_tokens + max_tokens > self.split_ctx_cap_tokens:
            return "no"
        if not allows(self.split_breaker, self.policy.breaker):  # its own breaker: the admission's way
            return "breaker"
        worker = next((w for w in ready if w.free_slots > 0), None)
        if worker is None:
            return "busy"
        fp = self.split_memory.request_footprint(prompt_tokens, max_tokens)
        if not self.ledger.fits(fp.total_bytes, now, settling=settling):
            return "room"
        return worker, fp

    def where_now(self, prompt_tokens: int = 1, max_tokens: int = 1) -> tuple[str, str]:
        """Where a small request would start now, and why, decided as a pass decides a queued
        job but with nothing reserved or dispatched (``/v1/status``'s service row while nothing
        waits): ``gpu``, ``split``, ``cpu``, or ``none`` (it would wait, or be refused)."""
        if self.gpu is None or self.ledger is None or self.policy is None:  # no device: the CPU lane
            if any(w.state is WorkerState.READY for w in self.cpu_workers):
                return "cpu", Reason.CPU_LANE.value
            return "none", Reason.NO_CPU_WORKER.value
        now = self.clock()
        req = AdmissionRequest(request_id="", prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrived_s=now)
        d = decide(req, self.ledger, self.lane_view(), self.breaker, now, self.policy)
        if isinstance(d, Admit | Shrink):
            return "gpu", str(d.reason)
        if isinstance(d, Delay) and self._fits_once_settled(req, now):  # a worker that just loaded
            return "gpu", Reason.FITS.value
        if not isinstance(d, Route | Reject):  # a delay, or a demotion it would wait for
            return "none", str(d.reason)
        fit = self._split_fit(prompt_tokens, max_tokens, now, settling=True)  # a pass waits one reading for it
        if not isinstance(fit, str):
            cause = d.cause if isinstance(d, Reject) else d.reason
            return "split", str(cause if self.gpu_workers else Reason.RESIDENT_DOES_NOT_FIT)
        if fit in ("busy", "room"):  # a pass holds it for the split's slot or room (bounded)
            return "none", SPLIT_REFUSALS[fit].value
        if fit == "breaker" and not self.gpu_workers:
            d = self._split_refused(d, fit, now)
        d = self._by_plan(d)
        return ("cpu" if isinstance(d, Route) else "none"), str(d.reason)

    def _fits_once_settled(self, req: AdmissionRequest, now: float) -> bool:
        """Whether a GPU slot is free and ``req`` fits the room the next device reading gives
        back (``DeviceLedger.settling_bytes``): admission's delay then lasts one reading."""
        assert self.ledger is not None and self.policy is not None
        if not any(w.free_slots > 0 for w in self.gpu_workers):
            return False
        fp = self.policy.memory.request_footprint(req.prompt_tokens, req.max_tokens)
        return self.ledger.fits(fp.total_bytes, now, settling=True)

    def _rebind_to_gpu(self, now: float) -> None:
        """Late binding: a job admission sent to the CPU lane that has not started yet runs on
        the GPU when the GPU can take it now (a free slot, and admission admits it there), so
        the GPU never idles while such work waits on the CPU lane. Jobs pinned to the CPU (the
        client's choice, the canary) stay; a failover's only after a wait (``_may_move``)."""
        if self.gpu is None or self.ledger is None or self.policy is None:
            return
        for job in [j for j in self.cpu.queue if self._may_move(j, now, self.gpu_workers)]:
            if not any(w.free_slots > 0 for w in self.gpu_workers):
                return
            self._view = None  # the last job may have taken a slot
            d = self._admission(job, now)
            if isinstance(d, Shrink) and job.returns:  # sized for the CPU lane; shrunk, a continuation
                continue  # could end inside what its client has (round 22): it runs as sized, or waits
            if isinstance(d, Admit | Shrink) and self._dispatch_gpu(job, d, now, self.cpu):
                self._record(job, d, now)
                self.rebound_total += 1

    def _rebind_to_split(self, now: float) -> None:
        """Late binding onto the split worker, as onto the GPU: a job that left the resident
        profile for the CPU lane (its wait for a split slot or room past ``delay_max_s``, or
        no split worker ready then) and has not started yet runs on the split worker when it
        has a free slot and the job's reservation fits now, so the split never idles while
        such work waits on the CPU lane. Jobs pinned to the CPU stay (a failover's only until
        ``_may_move``); a job longer than the split's cap runs there shrunk to it when the
        client allows shrinking, as a new one would (``_split_tokens``), and otherwise stays
        where it is."""
        if not self.split_workers or self.ledger is None or self.split_memory is None:
            return
        for job in [j for j in self.cpu.queue if self._may_move(j, now, self.split_workers)]:
            if (budget := self._split_tokens(job)) is None or (budget[1] and job.returns):  # as on the GPU
                continue
            max_tokens, shrunk = budget
            fit = self._split_fit(job.prompt_tokens, max_tokens, now)
            if fit in ("busy", "breaker"):  # nothing else can go there now either
                return
            if isinstance(fit, str):  # too long for it, or no room for this one: a smaller one may fit
                continue
            worker, fp = fit
            if not self._reserve(job.rid, fp.total_bytes, now):
                continue
            cause = job.last_reason or Reason.RESIDENT_DOES_NOT_FIT
            self._take_split(job, self.cpu, worker, fp, cause, max_tokens, shrunk, now)
            self.rebound_total += 1

    def _may_move(self, job: Job, now: float, workers: list[WorkerClient]) -> bool:
        """Whether late binding may move a job waiting on the CPU lane to ``workers`` (the
        device's): one admission sent there, or a failover's attempt (``Job.returns``) that the
        CPU lane has not started within ``delay_max_s``. A failover goes to the CPU replica
        first; but with the CPU lane busy or held by the host guard it waited there until its
        queue_timeout while the restarted device worker stood idle (round 19), where a resend
        with its key ran on the device at once. It goes back through admission, its breaker's
        probe included, and its run's ``max_attempts`` still bounds it; a continuation only to
        workers of the failed one's fingerprint (``Job.fingerprint``: a token-identical answer).
        Never a job whose client's deadline the measured device would miss (``core.deadlines``
        rule 4; round 54b: one was moved onto the device it had left for being too slow), timed
        at what ``workers`` would run (round 58: the split's tokens, not the resident's cut),
        nor one no lane would finish in time (rule 3: its last start on the CPU lane refuses it)."""
        f = self._deadline(job, now, self._tokens_on(job, workers))
        if f is not None and (late_everywhere(f) or (f.device_measured and not f.device_in_time)):
            return False
        if job.movable:
            return True
        if not job.returns or self.policy is None:
            return False
        if job.fingerprint is not None and any(fingerprint_of(w) != job.fingerprint for w in workers):
            return False
        # a CPU pass first, whatever delay_max_s says (0 would send it straight back: round 22)
        due = job.enqueued_s + max(self.policy.delay_max_s, RETURN_AFTER_MIN_S)
        if now >= due:
            return True
        self._delay_due = min(self._delay_due, due)  # a pass then, if the device can take it before
        return False

    def _tokens_on(self, job: Job, workers: list[WorkerClient]) -> int:
        """The ``max_tokens`` ``job`` would run with on ``workers`` (the split's, or the
        resident's), cut to their context when it may shrink."""
        if workers is self.split_workers:
            budget = self._split_tokens(job)
            return job.max_tokens if budget is None else budget[0]
        return lane_max_tokens(job.prompt_tokens, job.max_tokens, self.gpu_ctx_cap_tokens, shrinkable=job.allow_shrink)

    def _dispatch_cpu(self, now: float) -> None:
        self.cpu_blocked = ""
        self._host_held = False
        while self.cpu.queue:
            worker = next((w for w in self.cpu_workers if w.free_slots > 0), None)
            if worker is None:
                self.cpu_blocked = Reason.CPU_SLOTS_BUSY if self.cpu_workers else Reason.NO_CPU_WORKER
                return
            if self.host_view is not None:
                ok, why = may_start_cpu(self.host_view(worker.busy), self.host_guard)
                if not ok:
                    self.cpu_blocked = why
                    self._host_held = True  # host memory changes without an event: look again soon
                    return
            job = self.cpu.queue.popleft()
            self.cpu.admitted_total += 1
            worker.claim_slot(job.rid)
            max_tokens = self.cpu.max_tokens_of(job)
            self.cpu.started(job, now, max_tokens)
            self._note_busy(worker)
            reason = job.last_reason if job.last_reason is not None else Reason.CPU_LANE
            cap = self.cpu.cfg.ctx_cap_tokens
            job.future.set_result(
                Dispatch(
                    worker,
                    "cpu",
                    reason,
                    max_tokens,
                    cap,
                    0,
                    max_tokens < job.max_tokens,
                    now - job.enqueued_s,
                    job.position,
                    job.estimated_delay_ms,
                )
            )

    def peak_running(self, worker: WorkerClient) -> int:
        """Most requests this worker process has run at once since its last ``held`` report
        (which counts the contexts it holds; reset when it restarts), and at least those it
        runs now."""
        key, peak = self._peak.get(worker.spec.worker_id, ((worker.starts, worker.held_seq), 0))
        return max(peak if key == (worker.starts, worker.held_seq) else 0, worker.busy)

    def _note_busy(self, worker: WorkerClient) -> None:
        self._peak[worker.spec.worker_id] = ((worker.starts, worker.held_seq), self.peak_running(worker))

    def _fail(self, job: Job, exc: Exception) -> None:
        if not job.future.done():
            job.future.set_exception(exc)
            job.future.exception()

    def _retry_after_s(self, lane: Lane | None = None) -> float:
        """Retry-After for a refusal: when the lane's queued work is likely done (its ETA from
        measured speed), or the breaker's cooldown, never under a second. A GPU lane with no
        worker of its own (the ``cpu`` profile) hands all its jobs to the CPU lane: the CPU
        lane's ETA is its own."""
        lane = lane or self.cpu
        now = self.clock()
        eta = lane.estimated_delay_s(now, self._slots(lane))
        if lane is self.gpu and not (self.gpu_workers or self.split_workers):
            eta = max(eta, self.cpu.estimated_delay_s(now, self._slots(self.cpu)))
        return max(1.0, self.breaker.retry_after_s(now), eta)

    def soonest_wait_s(self) -> float:
        """The chat row's ``eta_s`` in ``/v1/status``: the soonest wait of a lane that takes
        requests now, over its slots that do (``_taking_slots``: round 66, a dead worker's slot
        read as free, and a ready device behind an open breaker as taking them), else of a lane
        with workers at all (round 63: the ``cpu`` profile's GPU lane has none; round 64: a dead
        worker's lane read 0 while its requests went to the other), 0 with none."""
        now = self.clock()
        lanes = [lane for lane in (self.gpu, self.cpu) if lane is not None and self._workers_of(lane)]
        taking = [(lane, n) for lane in lanes if (n := self._taking_slots(lane))]
        if taking:
            return min(lane.estimated_delay_s(now, n) for lane, n in taking)
        return min((lane.estimated_delay_s(now, self._slots(lane)) for lane in lanes), default=0.0)

    def _taking_slots(self, lane: Lane) -> int:
        """The slots of ``lane``'s ready workers whose breaker lets requests through."""
        if lane is self.cpu:
            return sum(w.spec.slots for w in self.cpu_workers if w.state is WorkerState.READY)
        n = 0
        for workers, breaker in ((self.gpu_workers, self.breaker), (self.split_workers, self.split_breaker)):
            if self.policy is None or allows(breaker, self.policy.breaker):
                n += sum(w.spec.slots for w in workers if w.state is WorkerState.READY)
        return n

    def statistics(self) -> list[LaneStatistics]:
        """A frozen snapshot of each lane, the GPU lane first."""
        now = self.clock()
        out = [self.cpu.statistics(now, self._workers_of(self.cpu))]
        if self.gpu is not None:  # the longest context its workers serve (it showed its configured
            # cap); none by plan (the cpu profile)
            cap = self._device_ctx_cap_tokens()
            cap = 0 if cap is None and self.off_device else cap
            # its running and slots: the resident's and the split worker's (both take its jobs)
            out.insert(0, self.gpu.statistics(now, self._workers_of(self.gpu), cap))
        return out
