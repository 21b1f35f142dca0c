"""One accepted request across its attempts: dispatch, watch, fail over, never lose it.

Rules (DESIGN.md, "Failover rules"):

1. Only the gateway retries, at most ``max_attempts`` per run of a request and within a
   gateway-wide ``retry_budget_per_min``. A run is one execution in this gateway: a client's
   resume (a retry with its Idempotency-Key) or a replay after a restart starts a new one,
   with the attempts before it still numbered on (the journal's ``attempts``), so a request
   resumed twice may still fail over.
2. Failures of a GPU attempt are classified: ``alloc_failed`` (before generation), ``oom``
   (during generation), ``crash`` / ``driver_reset`` (the process died), ``stall`` (no
   token for ``stall_timeout_s``; slow but progressing is not a stall), ``engine``.
   Each feeds the breaker; a stalled worker is killed so the supervisor restarts it.
3. Nothing delivered yet (non-stream, or a stream before its first token): the request
   is replayed on the CPU replica with the same id and the next attempt number. Delivered
   means sent to the client (``shown``, which the run sets): a stream whose tokens all had
   their text held back (a partial UTF-8 character, a stop string's prefix, a tool call
   being buffered) delivered nothing, and is replayed from its start (``RouteInfo.restart``:
   the run drops what it held).
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
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spillover.config import FailoverConfig
from spillover.core.lifecycle import State
from spillover.core.routing import (
    Fail,
    FailKind,
    FailoverFacts,
    FailoverReason,
    Reason,
    fault_outcome,
    fits_lane,
    lane_max_tokens,
    plan_failover,
)
from spillover.errors import (
    CapacityError,
    ContextLengthExceeded,
    RequestCancelled,
    RequestTimedOut,
    SpilloverError,
    WorkerFailed,
)
from spillover.runtime.events import (
    AudioInfo,
    Done,
    Failed,
    Interrupted,
    Progress,
    RequestEvent,
    Segment,
    Started,
    Token,
    Vectors,
    WorkerGone,
)
from spillover.runtime.lanes import fingerprint_of
from spillover.runtime.outcomes import Event, Finished, RetryBudget, RouteInfo, TokenOut, classify_error, final_error
from spillover.runtime.scheduler import Dispatch, Job, Scheduler
from spillover.runtime.watchdog import Watchdog
from spillover.runtime.worker_client import WorkerClient

if TYPE_CHECKING:
    from spillover.runtime.journal import Journal

__all__ = ["Execution", "Finished", "RetryBudget", "RouteInfo", "TokenOut", "classify_error"]

PREFILL_FLOOR_TPS = 50.0  # slowest prompt evaluation still counted as progress (tokens/s)
CPU_STALL_FACTOR = 4.0  # the CPU lane is slower and shared: its stall bound is this much longer
COALESCE_S = 0.1  # a token the client does not see one by one waits at most this long in the worker


class _Failure(Exception):
    def __init__(self, kind: str, message: str, *, gone: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.gone = gone  # the worker is gone already: nothing to kill


class _Stopped(Exception):
    """The attempt was interrupted on purpose (cancel or the request's time limit)."""


@dataclass
class Execution:
    """Drives one request; ``events()`` yields RouteInfo / TokenOut / Finished.

    The Execution is the owner of the request's lease (a worker slot plus, on the GPU, its
    device reservation): whatever ends an attempt (done, error, cancel, a journal failure,
    the client going away), the lease is released exactly once (``_release``), and only
    after the worker has stopped working on the request."""

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
    on_recovered: Callable[[float], None] = lambda ms: None  # a failover's fault -> first CPU token (ms)
    attempt: int = 0  # attempts so far, earlier runs' included (rule 1): each dispatch adds one
    delivered: list[int] = field(default_factory=list)  # this answer's tokens so far (a stream's)
    shown: bool = False  # something of this answer was sent to the client (set by the run: rule 3)
    failures: list[str] = field(default_factory=list)
    dispatched: RouteInfo | None = None  # where the latest attempt was sent or queued (it may end before its start)
    _job: Job | None = None
    _next_lane: str | None = None
    _cause: str | None = None
    _fault_at: float | None = None  # monotonic time of the fault the CPU attempt recovers from
    _cancelled: bool = False
    _timed_out: bool = False
    _unstopped: bool = False  # a worker did not stop a request in time and was killed
    _kill_task: asyncio.Future[Any] | None = None
    _cpu_reason: Reason = Reason.CLIENT_PREFERS_CPU
    _restart: bool = False  # the next attempt starts the answer again (rule 3: nothing was shown)
    _device_faults: int = 0  # this run's failed attempts on a device worker (gpu, split)
    _failed_fp: tuple[str, str] | None = None  # the last failed worker's (compat, numerics) fingerprint
    deadline_s: float | None = None  # the client's deadline (monotonic), for the CPU lane's ETA check
    timeout_at_s: float | None = None  # the request's end-to-end limit (monotonic): request_timeout_s
    cpu_tokens: list[int] | None = None  # the prompt for the CPU lane's fallback model, when it differs
    cpu_fallback: bool = False  # the CPU lane serves a configured fallback model, not a replica
    open_ended: bool = False  # no max_tokens asked: up to the serving lane's context limit
    cut: bool = False  # its max_tokens was cut to its context's room before it queued: shrunk wherever it runs
    stream_coalesce_s: float = 0.0  # how long a streamed token may wait to go with the next ones
    _watchdog: Watchdog = field(default_factory=Watchdog)  # ``_next``'s bound: one timer for many tokens
    _returning: set[asyncio.Future[None]] = field(default_factory=set)  # leases whose worker has not stopped yet

    def __post_init__(self) -> None:
        self._earlier_attempts = self.attempt  # earlier runs' (a resume's, a replay's): not this run's budget

    def __repr__(self) -> str:
        return f"<Execution {self.rid} attempt={self.attempt} delivered={len(self.delivered)}>"

    # -- queueing ------------------------------------------------------------------
    def submit_nowait(self) -> Job:
        """Queue the next attempt; raises QueueFull at once when the lane is full, and the
        stopped error when the request was cancelled (or timed out) meanwhile."""
        if self._cancelled or self._timed_out:
            raise self._stopped_error()
        self.attempt += 1
        # A spilled request (``Scheduler.spills_over``) may still run on the GPU (late binding):
        # sized for it, as admission's own moves to the CPU lane are (the CPU lane cuts at dispatch);
        # not one served by a fallback model, whose prompt and vocabulary are another model's.
        spilled = (
            self._next_lane == "cpu"
            and not self._cause
            and self._cpu_reason is Reason.GPU_QUEUE_FULL
            and not self.cpu_fallback
        )
        job = Job(
            rid=self.rid,
            prompt_tokens=self._job_prompt_tokens(),
            max_tokens=self._cpu_max_tokens() if self._next_lane == "cpu" and not spilled else self.max_tokens,
            arrived_s=time.monotonic(),
            allow_shrink=self._shrinkable(),
            deadline_s=self.deadline_s,
        )
        if self._next_lane == "cpu":
            job.last_reason = FailoverReason(self._cause) if self._cause else self._cpu_reason
            job.movable = spilled  # not pinned there
            # A failover may go back to the device after a wait (``Scheduler._may_move``): once a
            # run (one that failed there again may be what fails there); not after a stall, which
            # may be the request's own doing (a hang kill is no severe fault, so the breaker stays
            # closed and it would go back beside live traffic); not on its run's last attempt,
            # which a failure there would spend; not with a fallback model (the CPU lane serves
            # another model); a continuation only to a worker of the failed one's fingerprint.
            job.fingerprint = self._failed_fp if self.delivered else None
            job.returns = (
                self._cause is not None
                and self._cause != "stall"
                and self._device_faults == 1
                and self.attempt - self._earlier_attempts < self.failover.max_attempts
                and not self.cpu_fallback
                and (job.fingerprint is not None or not self.delivered)
            )
        self._job = job
        self.scheduler.submit_nowait(job, lane=self._next_lane)
        return job

    def check_queue_nowait(self) -> None:
        """Raise QueueFull at once when the lane the next attempt asks for is full."""
        self.scheduler.check_room_nowait(self._next_lane)

    @property
    def next_lane(self) -> str | None:
        """The lane the next attempt asks for (None: the scheduler's entry lane)."""
        return self._next_lane

    def fits_cpu(self) -> bool:
        """Whether the CPU lane's context cap takes this request (routing rule 1): all of its
        ``max_tokens``, or, when it may be shrunk, at least ``MIN_SHRUNK_TOKENS`` of them. A
        continuation's delivered tokens are part of its ``max_tokens`` (the worker counts its
        prefix in them), not more prompt."""
        prompt = len(self._prompt("cpu"))
        return fits_lane(prompt, self.max_tokens, self.scheduler.cpu_ctx_cap_tokens(), shrinkable=self._shrinkable())

    def _shrinkable(self) -> bool:
        """An open-ended request always (it asked for no length); an allowed shrink only
        before anything was delivered."""
        return self.open_ended or (self.allow_shrink and not self.delivered)

    def _cpu_max_tokens(self) -> int:
        """``max_tokens`` on the CPU lane (a continuation's delivered tokens counted in it, as in
        ``fits_cpu``): shrunk to its context cap when allowed."""
        prompt = len(self._prompt("cpu"))
        return lane_max_tokens(
            prompt, self.max_tokens, self.scheduler.cpu_ctx_cap_tokens(), shrinkable=self._shrinkable()
        )

    def prefer_cpu(self, reason: Reason = Reason.CLIENT_PREFERS_CPU) -> None:
        """Start on the CPU lane: the client asked (``"spillover": {"prefer": "cpu"}``), this
        request is the CPU canary, or the GPU lane had no place left (``gpu_queue_full``). The
        client's request must fit the CPU lane (400 otherwise); the others are only taken by a
        request that fits."""
        if not self.fits_cpu():
            if reason is not Reason.CLIENT_PREFERS_CPU:
                return
            cap = self.scheduler.cpu_ctx_cap_tokens()
            raise ContextLengthExceeded(
                f"this request needs {len(self._prompt('cpu')) + self.max_tokens} tokens, but the CPU lane "
                f"it asked for ('spillover': {{'prefer': 'cpu'}}) serves at most {cap}",
                param="max_tokens",
            )
        self._next_lane = "cpu"
        self._cpu_reason = reason

    def cancel(self) -> None:
        """Cancel (DELETE, the client went away, shutdown). A queued attempt is withdrawn; a
        dispatched one that has not started gives its lease back now; a running one is told
        to stop, and its lease comes back when the worker has stopped. The consumer of
        ``events()`` sees RequestCancelled."""
        self._cancelled = True
        self._stop_job()

    def _stop_job(self) -> None:
        job = self._job
        if job is None:
            return
        self.scheduler.withdraw(job)
        if not job.future.done():
            job.future.set_exception(RequestCancelled(f"request {self.rid} was cancelled"))
            job.future.exception()
        elif job.running and job.dispatch is not None:
            job.dispatch.worker.interrupt(self.rid)
        else:
            self._release(job, "cancelled")

    async def _move(self, target: State, **fields: Any) -> None:
        if self.journal is not None:
            await self.journal.move(self.rid, target, **fields)

    def _note_move(self, target: State, **fields: Any) -> None:
        """An intermediate step (ADMITTED, RUNNING), journaled without waiting (journal rule 7)."""
        if self.journal is not None:
            self.journal.note_move(self.rid, target, **fields)

    def _stopped_error(self) -> SpilloverError:
        if self._timed_out and not self._cancelled:
            return RequestTimedOut(f"request {self.rid} ran longer than the gateway's request_timeout_s")
        return RequestCancelled(f"request {self.rid} was cancelled")

    # -- the attempt loop ----------------------------------------------------------
    async def events(self) -> AsyncGenerator[Event, None]:
        """Run attempts until the request finishes or cannot go on (raises SpilloverError).
        Whatever happens, the lease of the current attempt is released on the way out."""
        try:
            if self._job is None:
                self.submit_nowait()
            while True:
                assert self._job is not None
                job = self._job
                try:
                    d = await self._await_dispatch(job)
                except asyncio.CancelledError:
                    self.cancel()
                    raise
                if self._cancelled or self._timed_out:
                    raise self._stopped_error()
                self._note_move(State.ADMITTED, route=d.route, attempts=self.attempt, reason=str(d.reason))
                self.dispatched = self._route_info(d)  # an attempt that fails before its start is still where it ended
                try:
                    async with contextlib.aclosing(self._run_attempt(job, d)) as attempt:
                        async for ev in attempt:
                            yield ev
                    return
                except _Failure as f:
                    self.failures.append(f.kind)
                    await self._failover(d, f)
        finally:
            if self._job is not None:
                self._release(self._job, "cancelled")  # a no-op when the attempt released it

    async def _await_dispatch(self, job: Job) -> Dispatch:
        """The job's dispatch, waiting at most until the request's time limit."""
        left = None if self.timeout_at_s is None else self.timeout_at_s - time.monotonic()
        try:
            async with asyncio.timeout(left):
                return await job.future
        except TimeoutError:
            self._timed_out = True
            self._stop_job()
            raise self._stopped_error() from None

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
            "coalesce_s": self._coalesce_s(d),
            **self.params,
        }

    def _coalesce_s(self, d: Dispatch) -> float:
        """How long the worker may hold a token to send several in one message (a wake-up of
        the gateway each, and of a stream's client): a stream's ``stream_coalesce_s``
        (``[server].stream_coalesce_ms``), COALESCE_S for tokens the client does not see one
        by one; at most a quarter of the attempt's stall bound. ``_next`` waits two windows
        longer (``engine.worker.TokenBatch``: a gap between its writes is the engine's own
        plus at most two windows), so held tokens never make a stall."""
        window = self.stream_coalesce_s if self.incremental else COALESCE_S
        return min(window, self._bound(d, prefill=False) / 4)

    def _recovered(self, d: Dispatch) -> None:
        """The attempt's first result came (a token, or the end when the answer has none): after
        a fault, the replica's recovery time (fault to first CPU result), when it recovered."""
        if self._fault_at is not None:
            if d.route == "cpu":
                self.on_recovered((time.monotonic() - self._fault_at) * 1000)
            self._fault_at = None

    def _release(self, job: Job, outcome: str) -> None:
        """Give the job's lease back: exactly once, only if it was dispatched, and only once
        its worker has stopped working on the request (its last event, or its exit). No
        await, so it also holds while the task is being cancelled. A worker that has not
        stopped within the stall bound is killed (``kill_worker``): its exit gives it back."""
        d = job.dispatch
        if job.released or d is None:
            return
        job.released = True
        pending = d.worker.when_stopped(self.rid)
        if pending is None:
            self._give_back(d, outcome)
            return
        deadline = asyncio.get_running_loop().call_later(self._bound(d, prefill=True), self._kill_unstopped, d, pending)
        self._returning.add(pending)

        def stopped(_: asyncio.Future[None]) -> None:
            deadline.cancel()
            self._returning.discard(pending)
            self._give_back(d, "failed" if self._unstopped else outcome)  # a kill is the device's fault

        pending.add_done_callback(stopped)

    def when_released(self, then: Callable[[], None]) -> None:
        """Call ``then`` once every lease this request took is back: now, or when the last
        worker still working on it stops (``_release``). Until then the request id is in use:
        a worker may still send its events under it, and its device reservation is still out."""
        if not self._returning:
            then()
            return
        left = set(self._returning)

        def one_back(fut: asyncio.Future[None]) -> None:
            left.discard(fut)
            if not left:
                then()

        for fut in left.copy():
            fut.add_done_callback(one_back)

    def _give_back(self, d: Dispatch, outcome: str) -> None:
        d.worker.release_slot(self.rid)
        self.scheduler.finished(self.rid, d, outcome)

    def _kill_unstopped(self, d: Dispatch, pending: asyncio.Future[None]) -> None:
        if not pending.done():
            self._unstopped = True
            self._kill_task = asyncio.ensure_future(self.kill_worker(d.worker))

    def _bound(self, d: Dispatch, prefill: bool) -> float:
        """How long the next worker event may take before the attempt counts as stalled:
        on the GPU the stall bound; before the first token it also covers the prefill (at
        a floor speed); the CPU lane is slower and shared."""
        bound = self.failover.stall_timeout_s
        if prefill:
            bound += (len(self._prompt(d.route)) + len(self.delivered)) / PREFILL_FLOOR_TPS
        if d.route != "gpu":
            bound *= CPU_STALL_FACTOR  # a hung CPU worker is killed too (no replica: a resumable error)
        return bound

    def _stall_s(self, d: Dispatch, prefill: bool) -> float:
        """How long ``_next`` waits for an event: the stall bound, and two coalescing windows
        past it (held tokens: a gap between the worker's writes is the engine's own plus at
        most two windows)."""
        return self._bound(d, prefill) + 2 * self._coalesce_s(d)

    async def _next(
        self, it: AsyncIterator[RequestEvent], d: Dispatch, bound: float, pending: Callable[[], bool] | None = None
    ) -> Started | Token | Done:
        """The next worker event within ``bound`` seconds (``_stall_s``: an attempt computes
        its steady bound once, not per token); a stall, a worker's death or error raise
        ``_Failure``, an interruption (cancel, time limit) raises ``_Stopped``. ``pending``
        says whether the event has come (``Watchdog`` rule 4: one that came in the bound's
        last loop turn is no stall)."""
        if self._cancelled or self._timed_out:
            raise _Stopped
        left = None if self.timeout_at_s is None else self.timeout_at_s - time.monotonic()
        try:
            delay = bound if left is None else max(0.0, min(bound, left))
            async with self._watchdog.guard(delay, pending):
                item = await anext(it)
        except TimeoutError as exc:
            if left is not None and left <= bound:
                self._timed_out = True
                d.worker.interrupt(self.rid)
                raise _Stopped from exc
            raise _Failure("stall", f"no token progress for {bound:.1f}s") from exc
        if isinstance(item, WorkerGone):  # killed for a hang (its health pings): a stall, not a crash
            kind = {"device_lost": "driver_reset", "hung": "stall"}.get(item.kind, "crash")
            raise _Failure(kind, f"{item.kind}: {item.message}", gone=True)
        if isinstance(item, Interrupted):
            raise _Stopped
        if isinstance(item, Failed):
            raise _Failure(item.kind, item.message)
        if isinstance(item, (Progress, Vectors, AudioInfo, Segment)):  # another kind's events, never a chat worker's
            raise _Failure("engine", f"a chat worker sent {type(item).__name__}")
        return item

    def _route_info(self, d: Dispatch) -> RouteInfo:
        """Where attempt ``d`` runs, as the run reports it."""
        return RouteInfo(
            route=d.route,
            reason=str(d.reason),
            attempt=self.attempt,
            worker_id=d.worker.spec.worker_id,
            max_tokens=d.max_tokens,
            kv_tokens=d.kv_tokens,
            shrunk=(d.shrunk or d.max_tokens < self.max_tokens or self.cut) and not self.open_ended,
            queued_s=d.queued_s,
            queue_position=d.queue_position,
            estimated_delay_ms=d.estimated_delay_ms,
            restart=not self.incremental or self._restart,
            failover=self._cause,
        )

    async def _run_attempt(self, job: Job, d: Dispatch) -> AsyncGenerator[Event, None]:
        if self._cancelled or self._timed_out:
            raise self._stopped_error()
        job.running = True
        prefix = len(self.delivered)  # a continuation's tokens, prefilled after its prompt
        it = d.worker.generate(self._msg(d))
        pending = functools.partial(d.worker.has_event, self.rid)
        steady_s = self._stall_s(d, prefill=False)
        outcome = "failed"
        try:
            first = await self._next(it, d, steady_s, pending)
            if not isinstance(first, Started):
                raise _Failure("engine", f"unexpected worker event {first!r} before the start")
            self.scheduler.confirmed(self.rid)
            self._note_move(State.RUNNING, route=d.route, attempts=self.attempt)
            yield self._route_info(d)
            self._restart = False
            first_token = True
            while True:
                ev = await self._next(it, d, self._stall_s(d, prefill=True) if first_token else steady_s, pending)
                if first_token and isinstance(ev, Token | Done):  # the attempt's first result
                    self._recovered(d)
                if isinstance(ev, Token):
                    first_token = False
                    if self.incremental:
                        self.delivered.extend(ev.token_ids)
                    yield ev
                elif isinstance(ev, Done):
                    outcome = "ok"
                    total = len(self.delivered) if self.incremental else ev.completion_tokens
                    self.scheduler.record_timing(  # the attempt's prefill and tokens; the answer's length
                        d.route,
                        len(self._prompt(d.route)) + prefix,
                        ev.completion_tokens,
                        ev.prefill_s,
                        ev.total_s,
                        answer_tokens=total,
                    )
                    yield Finished(ev.finish_reason, total)
                    return
        except _Stopped:
            outcome = "cancelled"
            raise self._stopped_error() from None
        except _Failure as f:
            outcome = fault_outcome(f.kind)
            if f.kind == "stall" and not f.gone:
                await self.kill_worker(d.worker)  # hung: the supervisor restarts it
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the consumer went away, or the gateway stops
            outcome = "cancelled"
            d.worker.interrupt(self.rid)
            raise
        except BaseException:
            outcome = "cancelled"  # e.g. the journal failed: the request ends, the device is not at fault
            d.worker.interrupt(self.rid)
            raise
        finally:
            self._release(job, outcome)  # first: no await before it (a cancelled task may not get past one)
            self._watchdog.close()
            with contextlib.suppress(Exception):
                await it.aclose()

    def _facts(self, d: Dispatch, f: _Failure) -> FailoverFacts:
        return FailoverFacts(
            route=d.route,
            fault=f.kind,
            cancelled=self._cancelled,
            attempt=self.attempt - self._earlier_attempts,  # this run's (rule 1)
            max_attempts=self.failover.max_attempts,
            delivered_tokens=self.sent_tokens(),
            incremental=self.incremental,
            continue_mid_stream=self.failover.continue_mid_stream,
            greedy=float(self.params.get("temperature", 1.0)) <= 0,
            constrained=self._constrained(),
            replica_compat=self._has_replica(d),
            replica_numerics=self._has_replica(d, parts=("compat", "numerics")),
            cpu_fallback=self.cpu_fallback,
            cpu_fits=self.fits_cpu(),
        )

    async def _failover(self, d: Dispatch, f: _Failure) -> None:
        """Execute ``core.routing.plan_failover``: replay, continuation, or a typed error."""
        if self.delivered and not self.shown:  # held back, never sent (rule 3): wherever it goes, it starts again
            self.delivered.clear()
            self._restart = True
        plan = plan_failover(self._facts(d, f))
        where = f"{f.kind} on the {d.route} worker ({f.message})"
        if isinstance(plan, Fail):
            raise self._fail_error(plan.kind, where, f)
        if not self.budget.take():
            raise WorkerFailed(f"request {self.rid}: {where}; the gateway's retry budget is spent", retry_after_s=5.0)
        self._cause = f.kind
        self._device_faults += d.route != "cpu"
        self._failed_fp = fingerprint_of(d.worker)
        self._fault_at = time.monotonic()
        self._next_lane = "cpu"
        self.on_failover(f.kind)
        await self._move(State.QUEUED, route="cpu", attempts=self.attempt, reason=str(FailoverReason(f.kind)))
        if self.dispatched is not None:  # where it is now, should it end before its CPU attempt starts
            self.dispatched = dataclasses.replace(  # no worker, no place yet: only the lane and why
                self.dispatched,
                route="cpu",
                reason=str(FailoverReason(f.kind)),
                attempt=self.attempt + 1,
                worker_id="",
                queue_position=0,
                estimated_delay_ms=0,
            )
        try:
            self.submit_nowait()
        except CapacityError as exc:
            raise WorkerFailed(
                f"request {self.rid}: {where}; the CPU lane cannot take it now ({exc.message})",
                retry_after_s=exc.retry_after_s,
            ) from exc

    def sent_tokens(self) -> int:
        """Tokens of this answer the client was sent (rule 3): none while every token's text
        was held back. What an error and the journal report as ``tokens_delivered``."""
        return len(self.delivered) if self.shown else 0

    def _fail_error(self, kind: FailKind, where: str, f: _Failure) -> SpilloverError:
        """The one error each kind of final failure becomes (``outcomes.final_error``)."""
        return final_error(
            kind,
            rid=self.rid,
            where=where,
            fault=f.kind,
            message=f.message,
            attempts=self.attempt,
            delivered=self.sent_tokens(),
            needs_tokens=len(self._prompt("cpu")) + self.max_tokens,  # a continuation's prefix is in max_tokens
            cpu_cap_tokens=self.scheduler.cpu_ctx_cap_tokens(),
        )

    def _constrained(self) -> bool:
        """Whether anything but the model's own greedy choice picks tokens (a grammar, a
        penalty, a logit bias): then no continuation is provably identical (rule 4)."""
        p = self.params
        return bool(
            p.get("grammar")
            or p.get("logit_bias")
            or p.get("frequency_penalty", 0.0)
            or p.get("presence_penalty", 0.0)
            or p.get("repeat_penalty", 1.0) != 1.0
        )

    def _has_replica(self, d: Dispatch, parts: tuple[str, ...] = ("compat",)) -> bool:
        """Whether a CPU worker's fingerprint matches the failed worker's in ``parts``."""
        gpu_fp = (d.worker.info or {}).get("fingerprint") or {}
        return any(
            all(((w.info or {}).get("fingerprint") or {}).get(p) == gpu_fp.get(p) is not None for p in parts)
            for w in self.scheduler.cpu_workers
        )
