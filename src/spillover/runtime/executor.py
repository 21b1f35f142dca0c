"""One accepted request across its attempts: dispatch, watch, fail over, never lose it.

Rules (DESIGN.md, "Failover rules"):

1. Only the gateway retries, at most ``max_attempts`` per request and within a gateway-wide
   ``retry_budget_per_min``.
2. Failures of a GPU attempt are classified: ``alloc_failed`` (before generation), ``oom``
   (during generation), ``crash`` / ``driver_reset`` (the process died), ``stall`` (no
   token for ``stall_timeout_s``; slow but progressing is not a stall), ``engine``.
   Each feeds the breaker; a stalled worker is killed so the supervisor restarts it.
3. Nothing delivered yet (non-stream, or a stream before its first token): the request
   is replayed on the CPU replica with the same id and the next attempt number.
4. Tokens delivered: continue on the CPU replica only when that is provably identical
   (greedy, no grammar, identical compatibility *and* numerics fingerprints; the replica
   re-checks every delivered token before producing a new one). Otherwise the request
   ends with ``FailoverInterrupted`` (resumable, carries the request id).
5. A failed CPU attempt has no replica to go to: ``WorkerFailed`` (resumable).
6. A configured fallback model on the CPU lane (``[model].fallback_path``) is not a replica:
   a request may be replayed on it (rule 3; the answer is labelled degraded and names the
   fallback model) but a stream is never continued on it (rule 4 needs identical
   fingerprints). It gets the prompt in its own tokens (``cpu_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.config import FailoverConfig
from spillover.core.lifecycle import State
from spillover.errors import (
    AllocationFailed,
    CapacityError,
    FailoverInterrupted,
    RequestCancelled,
    SpilloverError,
    WorkerFailed,
)
from spillover.runtime.scheduler import Dispatch, Job, Scheduler
from spillover.runtime.worker_client import WorkerClient, WorkerGone

if TYPE_CHECKING:
    from spillover.runtime.journal import Journal

__all__ = ["Execution", "Finished", "RetryBudget", "RouteInfo", "TokenOut"]

SEVERE = frozenset({"alloc_failed", "oom", "crash", "driver_reset"})
PREFILL_FLOOR_TPS = 50.0  # slowest prompt evaluation still counted as progress (tokens/s)
CPU_STALL_FACTOR = 4.0  # the CPU lane is slower and shared: its stall bound is this much longer


@dataclass(frozen=True)
class RouteInfo:
    """Where the request runs now; ``restart`` means earlier tokens are void (not delivered)."""

    route: str
    reason: str
    attempt: int
    worker_id: str
    max_tokens: int
    kv_tokens: int
    shrunk: bool
    queued_s: float
    queue_position: int
    estimated_delay_ms: int
    restart: bool
    failover: str | None = None  # the failure that caused this attempt


@dataclass(frozen=True)
class TokenOut:
    """A generated token and the text it releases."""

    id: int
    text: str


@dataclass(frozen=True)
class Finished:
    """The generation ended normally."""

    finish_reason: str
    completion_tokens: int


Event = RouteInfo | TokenOut | Finished


class RetryBudget:
    """At most ``per_min`` failover retries in any 60 s window, gateway-wide."""

    def __init__(self, per_min: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_min = per_min
        self.clock = clock
        self._used: deque[float] = deque()
        self.denied = 0

    def take(self) -> bool:
        now = self.clock()
        while self._used and now - self._used[0] > 60.0:
            self._used.popleft()
        if len(self._used) >= self.per_min:
            self.denied += 1
            return False
        self._used.append(now)
        return True


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass
class Execution:
    """Drives one request; ``events()`` yields RouteInfo / TokenOut / Finished."""

    rid: str
    tokens: list[int]
    max_tokens: int
    params: dict[str, Any]
    incremental: bool  # tokens reach the client as they come (a plain text stream)
    allow_shrink: bool
    scheduler: Scheduler
    journal: Journal | None
    failover: FailoverConfig
    budget: RetryBudget
    kill_worker: Callable[[WorkerClient], Any]
    on_failover: Callable[[str], None] = lambda kind: None
    attempt: int = 0
    delivered: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _job: Job | None = None
    _next_lane: str | None = None
    _cause: str | None = None
    _cancelled: bool = False
    _cpu_reason: str = "client_prefers_cpu"
    deadline_s: float | None = None
    cpu_tokens: list[int] | None = None  # the prompt for the CPU lane's fallback model, when it differs
    cpu_fallback: bool = False  # the CPU lane serves a configured fallback model, not a replica

    def __repr__(self) -> str:
        return f"<Execution {self.rid} attempt={self.attempt} delivered={len(self.delivered)}>"

    # -- queueing ------------------------------------------------------------------
    def submit_nowait(self) -> Job:
        """Queue the next attempt; raises QueueFull at once when the lane is full."""
        self.attempt += 1
        job = Job(
            rid=self.rid,
            prompt_tokens=self._job_prompt_tokens(),
            max_tokens=self.max_tokens,
            arrived_s=time.monotonic(),
            allow_shrink=self.allow_shrink and not self.delivered,
            deadline_s=self.deadline_s,
        )
        if self._next_lane == "cpu":
            job.last_reason = f"failover:{self._cause}" if self._cause else self._cpu_reason
        self.scheduler.submit_nowait(job, lane=self._next_lane)
        self._job = job
        return job

    def prefer_cpu(self, reason: str = "client_prefers_cpu") -> None:
        """Start on the CPU lane: the client asked (``"spillover": {"prefer": "cpu"}``),
        or this request is the CPU canary."""
        self._next_lane = "cpu"
        self._cpu_reason = reason

    def cancel(self) -> None:
        """Cancel: withdraw from the queue or stop the worker (the consumer sees RequestCancelled)."""
        self._cancelled = True
        if self._job is not None:
            self.scheduler.withdraw(self._job)
            if not self._job.future.done():
                self._job.future.set_exception(RequestCancelled(f"request {self.rid} was cancelled"))
                self._job.future.exception()

    async def _move(self, target: State, **fields: Any) -> None:
        if self.journal is not None:
            await self.journal.move(self.rid, target, **fields)

    # -- the attempt loop ----------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Run attempts until the request finishes or cannot go on (raises SpilloverError)."""
        if self._job is None:
            self.submit_nowait()
        while True:
            assert self._job is not None
            job = self._job
            try:
                d = await job.future
            except asyncio.CancelledError:
                self.cancel()
                if job.future.done() and not job.future.cancelled() and job.future.exception() is None:
                    self._release(job.future.result(), "cancelled")
                raise
            if self._cancelled:
                self._release(d, "cancelled")
                raise RequestCancelled(f"request {self.rid} was cancelled")
            await self._move(State.ADMITTED, route=d.route, attempts=self.attempt, reason=d.reason)
            try:
                async for ev in self._run_attempt(d):
                    yield ev
                return
            except _Failure as f:
                self.failures.append(f.kind)
                await self._failover(d, f)

    def _job_prompt_tokens(self) -> int:
        """The prompt length the scheduler sizes the next job by. A CPU job: the CPU lane's
        model's prompt. A GPU job may still be routed to the CPU lane by admission, so with a
        fallback model it is sized by the longer of the two prompts (a GPU reservation a few
        tokens too large, never a CPU context too small)."""
        if self._next_lane == "cpu":
            return len(self._prompt("cpu"))
        return max(len(self.tokens), len(self.cpu_tokens or ()))

    def _prompt(self, route: str) -> list[int]:
        """The prompt in the tokens of the model that serves ``route``."""
        return self.cpu_tokens if route == "cpu" and self.cpu_tokens is not None else self.tokens

    def _msg(self, d: Dispatch) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "tokens": self._prompt(d.route),
            "prefix": list(self.delivered),
            "max_tokens": d.max_tokens,
            "kv_tokens": d.kv_tokens,
            "reserve_bytes": d.reserve_bytes,
            **self.params,
        }

    def _release(self, d: Dispatch, outcome: str) -> None:
        d.worker.release_slot(self.rid)
        self.scheduler.finished(self.rid, d, outcome)

    async def _next(
        self, it: AsyncIterator[dict[str, Any] | WorkerGone], d: Dispatch, *, prefill: bool = False
    ) -> dict[str, Any]:
        """The next worker event. On the GPU, waiting longer than the stall bound is a stall;
        before the first token the bound also covers the prefill (at a floor speed)."""
        bound = self.failover.stall_timeout_s
        if prefill:
            bound += (len(self._prompt(d.route)) + len(self.delivered)) / PREFILL_FLOOR_TPS
        if d.route != "gpu":
            bound *= CPU_STALL_FACTOR  # a hung CPU worker is killed too (no replica: a resumable error)
        try:
            async with asyncio.timeout(bound):  # no task per token, unlike wait_for
                item = await anext(it)
        except TimeoutError as exc:
            raise _Failure("stall", f"no token progress for {bound:.1f}s") from exc
        if isinstance(item, WorkerGone):
            kind = "driver_reset" if item.kind == "device_lost" else "crash"
            raise _Failure(kind, f"{item.kind}: {item.message}")
        if item.get("ev") == "error":
            raise _Failure(str(item.get("kind") or "engine"), str(item.get("message")))
        return item

    async def _run_attempt(self, d: Dispatch) -> AsyncIterator[Event]:
        it = d.worker.generate(self._msg(d))
        outcome = "failed"
        try:
            first = await self._next(it, d)
            if first.get("ev") != "started":
                raise _Failure("engine", f"unexpected worker event {first.get('ev')!r}")
            self.scheduler.confirmed(self.rid)
            await self._move(State.RUNNING, route=d.route, attempts=self.attempt)
            yield RouteInfo(
                route=d.route,
                reason=d.reason,
                attempt=self.attempt,
                worker_id=d.worker.spec.worker_id,
                max_tokens=d.max_tokens,
                kv_tokens=d.kv_tokens,
                shrunk=d.shrunk,
                queued_s=d.queued_s,
                queue_position=d.queue_position,
                estimated_delay_ms=d.estimated_delay_ms,
                restart=not self.incremental,
                failover=self._cause,
            )
            first_token = True
            while True:
                ev = await self._next(it, d, prefill=first_token)
                if ev["ev"] == "token":
                    first_token = False
                    if self.incremental and ev["id"] >= 0:
                        self.delivered.append(int(ev["id"]))
                    yield TokenOut(int(ev["id"]), str(ev["text"]))
                elif ev["ev"] == "done":
                    outcome = "ok"
                    timings = ev.get("timings") or {}
                    self.scheduler.record_timing(
                        d.route,
                        len(self._prompt(d.route)) + len(self.delivered),
                        int(ev["completion_tokens"]),
                        float(timings.get("prefill_s", 0.0)),
                        float(timings.get("total_s", 0.0)),
                    )
                    total = len(self.delivered) if self.incremental else int(ev["completion_tokens"])
                    yield Finished(str(ev["finish_reason"]), total)
                    return
        except _Failure as f:
            outcome = "severe" if f.kind in SEVERE else "failed"
            if f.kind == "stall":
                await self.kill_worker(d.worker)  # hung: the supervisor restarts it
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            with contextlib.suppress(Exception):
                await it.aclose()  # type: ignore[attr-defined]
            self._release(d, outcome)

    async def _failover(self, d: Dispatch, f: _Failure) -> None:
        """Decide what a failed attempt becomes: replay, continuation, or a typed error."""
        where = f"{f.kind} on the {d.route} worker ({f.message})"
        if self._cancelled:
            raise RequestCancelled(f"request {self.rid} was cancelled")
        if d.route != "gpu":
            raise WorkerFailed(f"request {self.rid} failed: {where}; no replica to fail over to", retry_after_s=1.0)
        if self.attempt >= self.failover.max_attempts:
            raise WorkerFailed(f"request {self.rid} failed after {self.attempt} attempts: {where}", retry_after_s=1.0)
        if self.delivered and not self._continuable(d):
            raise FailoverInterrupted(
                f"request {self.rid}: {where} after {len(self.delivered)} tokens were delivered, and the "
                "continuation on the CPU replica cannot be proven identical (needs greedy decoding and "
                "identical fingerprints); retrieve it with GET /v1/requests/{id} or retry",
                retry_after_s=1.0,
            )
        if not (self._has_replica(d) or self.cpu_fallback):
            raise WorkerFailed(
                f"request {self.rid}: {where}; no CPU worker has the same compatibility fingerprint "
                "(model, tokenizer, template, quantization), so it is not a replica, and no fallback "
                "model is configured",
                retry_after_s=1.0,
            )
        if not self.budget.take():
            raise WorkerFailed(f"request {self.rid}: {where}; the gateway's retry budget is spent", retry_after_s=5.0)
        self._cause = f.kind
        self._next_lane = "cpu"
        self.on_failover(f.kind)
        await self._move(State.QUEUED, route="cpu", attempts=self.attempt, reason=f"failover:{f.kind}")
        try:
            self.submit_nowait()
        except CapacityError as exc:
            raise WorkerFailed(
                f"request {self.rid}: {where}; the CPU lane cannot take it now ({exc.message})",
                retry_after_s=exc.retry_after_s,
            ) from exc

    def _continuable(self, d: Dispatch) -> bool:
        if not (self.failover.continue_mid_stream and self.incremental):
            return False
        if float(self.params.get("temperature", 1.0)) > 0 or self.params.get("json_schema"):
            return False
        return self._has_replica(d, parts=("compat", "numerics"))

    def _has_replica(self, d: Dispatch, parts: tuple[str, ...] = ("compat",)) -> bool:
        """Whether a CPU worker's fingerprint matches the failed worker's in ``parts``."""
        gpu_fp = (d.worker.info or {}).get("fingerprint") or {}
        return any(
            all(((w.info or {}).get("fingerprint") or {}).get(p) == gpu_fp.get(p) is not None for p in parts)
            for w in self.scheduler.cpu_workers
        )


def classify_error(exc: SpilloverError) -> State:
    """The journal state a request ends in after ``exc`` (once it was accepted)."""
    if isinstance(exc, RequestCancelled):
        return State.CANCELLED
    if isinstance(exc, WorkerFailed | AllocationFailed):
        return State.RESUMABLE_ERROR
    if isinstance(exc, CapacityError):
        return State.REJECTED
    return State.FAILED
