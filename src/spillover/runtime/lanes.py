"""The scheduler's lanes and the values it hands out.

``Lane`` owns one bounded queue: its jobs in order, its admitted/shed/expired counters,
the running (EWMA) estimates of its prefill and decode speed, the ETA estimates made from
them, and its ``LaneStatistics`` snapshot. ``Job`` is a request waiting on a lane and
``Dispatch`` where and under which limits it runs. ``runtime.scheduler`` decides which job
leaves which lane for which worker.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spillover.config import LaneConfig
from spillover.core.reasons import RouteReason
from spillover.core.routing import lane_max_tokens
from spillover.runtime.worker_client import WorkerClient

__all__ = ["Dispatch", "Job", "Lane", "LaneStatistics", "fingerprint_of", "places_promised"]


def fingerprint_of(worker: WorkerClient) -> tuple[str, str] | None:
    """A worker's (compatibility, numerics) fingerprint from its ready-info, None without one."""
    fp = (worker.info or {}).get("fingerprint") or {}
    compat, numerics = fp.get("compat"), fp.get("numerics")
    return (str(compat), str(numerics)) if compat and numerics else None


@dataclass
class Job:
    """One request waiting for a slot."""

    rid: str
    prompt_tokens: int
    max_tokens: int
    arrived_s: float
    allow_shrink: bool = False
    lane: str = "gpu"
    enqueued_s: float = 0.0
    future: asyncio.Future[Dispatch] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    last_reason: RouteReason | None = None  # why it is on its lane now (a CPU dispatch reports it)
    position: int = 0  # 1-based position when queued
    estimated_delay_ms: int = 0
    deadline_s: float | None = None  # monotonic; the client's deadline for completion
    running: bool = False  # the attempt was sent to its worker
    movable: bool = False  # sent to the CPU lane by admission (not pinned there): the GPU may still take it
    # a failover's attempt, pinned to the CPU lane: the device may take it back once the CPU lane
    # has not started it within admission's delay_max_s (``Scheduler._may_move``)
    returns: bool = False
    # a continuation's (it carries delivered tokens): the fingerprint, compatibility and numerics,
    # a device worker must have to take it back (the failed worker's), as the CPU replica must
    fingerprint: tuple[str, str] | None = None
    released: bool = False  # its lease (slot, reservation) was given back
    waits_for: str = ""  # the refusal it waits out (a worker, a slot, memory coming): named if it times out

    @property
    def dispatch(self) -> Dispatch | None:
        """Where the job was dispatched, once it was."""
        f = self.future
        if not f.done() or f.cancelled() or f.exception() is not None:
            return None
        return f.result()


@dataclass(frozen=True)
class Dispatch:
    """Where a job runs and under which limits."""

    worker: WorkerClient
    route: str  # gpu | cpu | split
    reason: RouteReason
    max_tokens: int
    kv_tokens: int
    reserve_bytes: int
    shrunk: bool
    queued_s: float
    queue_position: int = 0
    estimated_delay_ms: int = 0
    probe_round: int | None = None  # a half-open probe of this breaker round (``opens``), else None


def places_promised(depth: int, queued: int, promised: int, takers: int) -> bool:
    """Whether every place of a queue is taken or promised: ``queued`` jobs wait, ``promised``
    requests are still being accepted (tokenized, journaled) with a place held for them, and at
    most ``takers`` jobs would leave the queue at once (free slots). A request arriving now is
    refused at once instead of racing the promised ones for the last place."""
    return queued + promised >= depth + takers


@dataclass(frozen=True)
class LaneStatistics:
    """Frozen snapshot of one lane."""

    lane: str
    depth: int
    max_depth: int
    oldest_age_s: float
    running: int
    slots: int
    ctx_cap_tokens: int
    admitted_total: int
    shed_total: int
    expired_total: int
    prefill_tps: float
    decode_tps: float
    estimated_delay_ms: int
    queued: tuple[dict[str, Any], ...] = ()


class Lane:
    """One bounded queue of jobs, its counters and its running speed estimates."""

    def __init__(self, name: str, cfg: LaneConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.queue: deque[Job] = deque()
        self.admitted_total = 0
        self.shed_total = 0
        self.expired_total = 0
        self.promised: set[str] = set()  # requests being accepted that were promised a place
        # the requests running on its workers' slots: when each started, its prompt and
        # ``max_tokens`` there (``started``, ``ended``): its wait counts their remaining work, at
        # the lane's speed now
        self.running: dict[str, tuple[float, int, int]] = {}
        # Running estimates (EWMA) of this lane's speed, from the workers' own timings.
        self.prefill_tps = 400.0
        self.decode_tps = 40.0
        self.samples = 0
        self.completion_tokens: float | None = None  # tokens a finished request wrote (EWMA)

    def free(self) -> int:
        return self.cfg.queue_depth - len(self.queue)

    def record(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        prefill_s: float,
        total_s: float,
        answer_tokens: int | None = None,
    ) -> None:
        """Feed one finished attempt's measured timings into the speed estimates, and its
        answer's length (``answer_tokens``, by default ``completion_tokens``) into the typical
        length (round 63: a continuation fed only its own tokens)."""
        alpha = 0.3 if self.samples else 1.0
        if prefill_s > 0 and prompt_tokens > 0:
            self.prefill_tps += alpha * (prompt_tokens / prefill_s - self.prefill_tps)
        decode_s = total_s - prefill_s
        if decode_s > 0 and completion_tokens > 1:
            self.decode_tps += alpha * ((completion_tokens - 1) / decode_s - self.decode_tps)
        answer = completion_tokens if answer_tokens is None else answer_tokens
        last = self.completion_tokens
        self.completion_tokens = answer if last is None else last + alpha * (answer - last)
        self.samples += 1

    def job_seconds(self, prompt_tokens: int, max_tokens: int) -> float:
        """Estimated service time of one job on one slot of this lane."""
        return prompt_tokens / max(self.prefill_tps, 1e-3) + max_tokens / max(self.decode_tps, 1e-3)

    def max_tokens_of(self, job: Job) -> int:
        """The ``max_tokens`` ``job`` runs with on this lane: a shrinkable one (admission let it
        through on that ground) gets the room the lane's context has."""
        return lane_max_tokens(job.prompt_tokens, job.max_tokens, self.cfg.ctx_cap_tokens, shrinkable=job.allow_shrink)

    def started(self, job: Job, now: float, max_tokens: int) -> None:
        """``job`` started on one of this lane's workers at ``now``, with ``max_tokens`` there."""
        self.running[job.rid] = (now, job.prompt_tokens, max_tokens)

    def ended(self, rid: str) -> None:
        """A request that ran here gave its slot back (no-op for one not running here)."""
        self.running.pop(rid, None)

    def forget_unclaimed(self, workers: list[WorkerClient]) -> None:
        """End the running requests none of ``workers`` holds a slot for any more (a worker
        that died or restarted let go of them before their ``ended``)."""
        claimed = {rid for w in workers for rid in w.claimed}
        for rid in [r for r in self.running if r not in claimed]:
            del self.running[rid]

    def estimated_delay_s(self, now: float, slots: int | None = None, running: bool = True) -> float:
        """Wait before a new job starts on ``slots`` (its workers' slots; by default the lane's
        configured count): each slot is free once its running request's remaining work is done,
        and the queued jobs ahead take the earliest free slot in turn, each at what it runs with
        here (``max_tokens_of``; round 54b: a shrinkable job queued on the CPU lane was counted
        at its whole GPU-sized ``max_tokens``); never under the queued work spread over the
        slots (round 62: a lane held by the host-RAM guard, or with its worker down, read 0
        with a job queued: nothing starts there). A running request's remaining work is
        ``_remaining_s``'s; Retry-After and ``/v1/status`` count it (round 59: they left it
        out), a client's deadline does not (``running`` False: ``Scheduler._eta_s``)."""
        slots = max(1, self.cfg.slots if slots is None else slots, len(self.running))
        ahead = [self.job_seconds(j.prompt_tokens, self.max_tokens_of(j)) for j in self.queue]
        free_at = [self._remaining_s(t, p, m, now) for t, p, m in self.running.values()] if running else []
        free_at += [0.0] * (slots - len(free_at))
        heapq.heapify(free_at)
        for work in ahead:
            heapq.heappush(free_at, heapq.heappop(free_at) + work)
        return max(free_at[0], sum(ahead) / slots)

    def _remaining_s(self, started_s: float, prompt_tokens: int, max_tokens: int, now: float) -> float:
        """The work left to a request running here since ``started_s``: until the tokens this
        lane's requests have been writing (round 62: an open-ended one counted its whole
        context), and once past that, or before any request ended, until its ``max_tokens``
        (round 63: one past the typical length counted as done, so Retry-After said a second
        while a long answer held the slot); 0 once past its ``max_tokens``."""
        ends = [started_s + self.job_seconds(prompt_tokens, max_tokens)]
        if self.completion_tokens is not None:
            typical = min(max_tokens, math.ceil(self.completion_tokens))
            ends.insert(0, started_s + self.job_seconds(prompt_tokens, typical))
        return max(0.0, next((end for end in ends if end > now), now) - now)

    def __repr__(self) -> str:
        return f"<Lane {self.name} queued={len(self.queue)}/{self.cfg.queue_depth}>"

    def append(self, job: Job, now: float, slots: int | None = None) -> None:
        """Put a job at the end of this lane at ``now``, with its position and the estimated
        wait here (on ``slots``: ``estimated_delay_s``)."""
        job.lane = self.name
        job.position = len(self.queue) + 1
        job.estimated_delay_ms = int(self.estimated_delay_s(now, slots) * 1000)
        self.queue.append(job)

    def statistics(self, now: float, workers: list[WorkerClient], ctx_cap_tokens: int | None = None) -> LaneStatistics:
        """A frozen snapshot of this lane, served by ``workers`` whose longest context is
        ``ctx_cap_tokens`` (by default the lane's configured cap)."""
        slots = sum(w.spec.slots for w in workers)
        return LaneStatistics(
            lane=self.name,
            depth=len(self.queue),
            max_depth=self.cfg.queue_depth,
            oldest_age_s=round(now - self.queue[0].enqueued_s, 3) if self.queue else 0.0,
            running=sum(w.busy for w in workers),
            slots=slots,
            ctx_cap_tokens=self.cfg.ctx_cap_tokens if ctx_cap_tokens is None else ctx_cap_tokens,
            admitted_total=self.admitted_total,
            shed_total=self.shed_total,
            expired_total=self.expired_total,
            prefill_tps=round(self.prefill_tps, 1),
            decode_tps=round(self.decode_tps, 1),
            estimated_delay_ms=int(self.estimated_delay_s(now, slots) * 1000),
            queued=tuple(
                {
                    "rid": j.rid,
                    "position": i + 1,
                    "age_s": round(now - j.enqueued_s, 3),
                    "prompt_tokens": j.prompt_tokens,
                    "max_tokens": j.max_tokens,
                }
                for i, j in enumerate(self.queue)
            ),
        )
