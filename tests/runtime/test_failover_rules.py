"""The executor's failover gate: which failed GPU attempts may go to the CPU lane, decided
from the workers' fingerprints, the fallback setting and what was already delivered."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.config import FailoverConfig
from spillover.core.routing import FailoverReason, Reason
from spillover.errors import FailoverInterrupted, QueueFull, WorkerFailed
from spillover.runtime.executor import Execution, RetryBudget, RouteInfo, _Failure

GPU_FP = {"compat": "c1", "numerics": "n1"}


@dataclass
class FakeScheduler:
    """Just what ``Execution._failover`` touches: the CPU workers, the queue and the CPU lane's cap."""

    cpu_workers: list[Any]
    submitted: list[tuple[Any, str | None]] = field(default_factory=list)

    def submit_nowait(self, job: Any, lane: str | None = None) -> None:
        self.submitted.append((job, lane))

    def cpu_ctx_cap_tokens(self) -> int:
        return 1024


def worker(fp: dict[str, str]) -> Any:
    return SimpleNamespace(info={"fingerprint": fp}, spec=SimpleNamespace(worker_id="w"))


def execution(sched: FakeScheduler, **kw: Any) -> Execution:
    """An Execution of a 3-token prompt on ``sched`` (no journal)."""
    base: dict[str, Any] = {"params": {}, "incremental": False, "max_tokens": 8}
    return Execution(
        rid="r1",
        tokens=[1, 2, 3],
        allow_shrink=False,
        scheduler=sched,  # type: ignore[arg-type]
        journal=None,
        failover=kw.pop("failover", FailoverConfig()),
        budget=RetryBudget(10),
        kill_worker=lambda w: None,
        **(base | kw),
    )


def failover(
    cpu_fp: dict[str, str],
    *,
    fallback: bool = False,
    delivered: int = 0,
    temperature: float = 0.0,
    shown: bool = True,
    max_tokens: int = 8,
) -> tuple[FakeScheduler, Execution]:
    """Fail a first GPU attempt (an allocation failure) and run the failover decision; a
    stream's ``delivered`` tokens were sent to the client unless ``shown`` is False (their
    text all held back)."""
    sched = FakeScheduler([worker(cpu_fp)])
    exe = execution(
        sched,
        params={"temperature": temperature},
        incremental=delivered > 0,
        attempt=1,
        delivered=list(range(delivered)),
        shown=shown and delivered > 0,
        max_tokens=max_tokens,
        cpu_tokens=[9, 9] if fallback else None,
        cpu_fallback=fallback,
    )
    d = SimpleNamespace(route="gpu", worker=worker(GPU_FP))

    async def go() -> None:
        await exe._failover(d, _Failure("alloc_failed", "injected"))  # type: ignore[arg-type]

    asyncio.run(go())
    return sched, exe


def test_a_replica_with_the_same_fingerprint_takes_the_replay() -> None:
    """Same compatibility fingerprint: the request is queued on the CPU lane, attempt 2, for the fault."""
    sched, exe = failover(GPU_FP)
    assert [lane for _, lane in sched.submitted] == ["cpu"] and exe.attempt == 2
    job = sched.submitted[0][0]
    assert job.last_reason == FailoverReason("alloc_failed") and str(job.last_reason) == "failover:alloc_failed"
    assert job.returns  # the device may take it back if the CPU lane does not start it (round 19)
    _fail_gpu_attempt(exe)  # it did go back, and failed there again: it waits for the CPU now
    assert [lane for _, lane in sched.submitted] == ["cpu", "cpu"] and not sched.submitted[1][0].returns


def _fail_gpu_attempt(exe: Execution) -> None:
    """One dispatch's count (``submit_nowait``'s), then that GPU attempt fails (an allocation failure)."""
    exe.attempt += 1
    d = SimpleNamespace(route="gpu", worker=worker(GPU_FP))

    async def go() -> None:
        await exe._failover(d, _Failure("alloc_failed", "injected"))  # type: ignore[arg-type]

    asyncio.run(go())


def test_the_attempt_budget_is_a_runs_so_a_resumed_request_still_fails_over() -> None:
    """A request resumed twice with its key (two earlier runs: built with ``attempt=2``, as
    ``RequestService`` builds a resume) whose GPU attempt fails replays on the CPU (attempt 4
    in all): ``max_attempts`` (3) bounds a run's attempts, not the request's. A fresh run's
    third failed attempt is refused, as before."""
    sched = FakeScheduler([worker(GPU_FP)])
    exe = execution(sched, attempt=2)
    _fail_gpu_attempt(exe)
    assert [lane for _, lane in sched.submitted] == ["cpu"] and exe.attempt == 4

    sched = FakeScheduler([worker(GPU_FP)])
    exe = execution(sched)
    exe.attempt = 2  # two attempts of this run already (a GPU one replayed, say)
    with pytest.raises(WorkerFailed):
        _fail_gpu_attempt(exe)
    assert sched.submitted == []


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (None, Reason.CLIENT_PREFERS_CPU),
        (Reason.CANARY, Reason.CANARY),
    ],
)
def test_a_cpu_start_carries_its_reason(reason: Reason | None, expected: Reason) -> None:
    """prefer_cpu queues the first attempt on the CPU lane with the client's or the canary's reason."""
    sched = FakeScheduler([])
    exe = execution(sched)
    if reason is None:
        exe.prefer_cpu()
    else:
        exe.prefer_cpu(reason)

    async def go() -> None:
        exe.submit_nowait()

    asyncio.run(go())
    job, lane = sched.submitted[0]
    assert lane == "cpu" and job.last_reason is expected and not job.returns  # pinned there


def test_a_cpu_worker_with_another_fingerprint_is_not_a_replica() -> None:
    """A different model on the CPU lane without a configured fallback: a resumable error, no replay."""
    with pytest.raises(WorkerFailed, match="not a replica"):
        failover({"compat": "other", "numerics": "n1"})


def test_a_configured_fallback_takes_the_replay_in_its_own_tokens() -> None:
    """With a fallback configured the replay goes to the CPU lane, sized by the fallback's
    tokens, and stays there (round 21: a fallback whose prompt tokens are the model's, so
    ``cpu_tokens`` is None, went back to the GPU)."""
    sched, _ = failover({"compat": "other", "numerics": "n1"}, fallback=True)
    assert len(sched.submitted) == 1
    job, lane = sched.submitted[0]
    assert lane == "cpu" and job.prompt_tokens == 2 and not job.returns  # sized in the fallback's tokens
    sched = FakeScheduler([worker({"compat": "other", "numerics": "n1"})])
    exe = execution(sched, attempt=1, cpu_fallback=True)  # the same tokens: no cpu_tokens of its own
    _fail_gpu_attempt(exe)
    assert not sched.submitted[0][0].returns


def test_a_continuation_carries_the_failed_workers_fingerprint() -> None:
    """A greedy stream that sent tokens continues on a worker of the failed one's fingerprint
    only (round 21): its job carries it; one whose worker gave none does not go back at all."""
    sched, _ = failover(GPU_FP, delivered=3)
    job = sched.submitted[0][0]
    assert job.returns and job.fingerprint == ("c1", "n1")
    sched, _ = failover(GPU_FP)  # a replay from the start: any device worker may take it
    assert sched.submitted[0][0].returns and sched.submitted[0][0].fingerprint is None


def test_a_gpu_job_is_sized_for_either_lane_with_a_fallback() -> None:
    """Admission may still route a GPU job to the fallback: it is sized by the longer prompt."""
    sched = FakeScheduler([])
    exe = execution(sched, cpu_tokens=[7, 7, 7, 7, 7], cpu_fallback=True)

    async def go() -> None:
        exe.submit_nowait()

    asyncio.run(go())
    assert sched.submitted[0][0].prompt_tokens == 5 and sched.submitted[0][1] is None


def test_a_stream_is_continued_only_on_an_identical_replica() -> None:
    """Tokens delivered, greedy: continued on an identical replica, never on a fallback or
    across numerics, and never when sampling."""
    sched, _ = failover(GPU_FP, delivered=5)
    assert len(sched.submitted) == 1
    for fp, fb, temp in (
        ({"compat": "other", "numerics": "n1"}, True, 0.0),
        ({"compat": "c1", "numerics": "other"}, False, 0.0),
        (GPU_FP, False, 0.7),
    ):
        with pytest.raises(FailoverInterrupted):
            failover(fp, fallback=fb, delivered=5, temperature=temp)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_stream_whose_tokens_were_all_held_back_is_replayed_from_its_start(temperature: float) -> None:
    """Tokens came, but their text was held back (a partial UTF-8 character, a stop string's
    prefix, a tool call being buffered): nothing reached the client, so even a sampled stream
    is replayed on the CPU from its start (no prefix, ``restart`` for the run to drop what it
    held), where it was ended ``failover_interrupted``. Once something was shown, a sampled
    stream is not continued."""
    sched, exe = failover(GPU_FP, delivered=3, temperature=temperature, shown=False)
    assert [lane for _, lane in sched.submitted] == ["cpu"] and exe.attempt == 2
    assert exe.delivered == [] and exe._restart  # the CPU attempt's prefix is empty (``_msg``)
    with pytest.raises(FailoverInterrupted):
        failover(GPU_FP, delivered=3, temperature=0.8, shown=True)


def test_a_continuations_delivered_tokens_are_in_its_max_tokens_not_more_prompt() -> None:
    """The worker counts a continuation's prefix in ``max_tokens``, so the CPU lane (cap 1024)
    takes a 3-token prompt with ``max_tokens`` 1020 however many tokens were delivered: a
    greedy stream 30 tokens in is continued (it was refused as needing 1053), and one whose
    30 tokens were all held back is replayed from its start (sampled too), reported as
    having sent none."""
    sched, exe = failover(GPU_FP, delivered=30, max_tokens=1020)
    assert [lane for _, lane in sched.submitted] == ["cpu"] and exe.delivered == list(range(30))
    assert exe.sent_tokens() == 30
    sched, exe = failover(GPU_FP, delivered=30, max_tokens=1020, temperature=0.8, shown=False)
    assert [lane for _, lane in sched.submitted] == ["cpu"] and exe.delivered == [] and exe.sent_tokens() == 0
    with pytest.raises(WorkerFailed, match="needs 1025 tokens"):  # one more than the cap: still refused
        failover(GPU_FP, delivered=30, max_tokens=1022)


@pytest.mark.parametrize(("gone", "kind"), [("hung", "stall"), ("exited", "crash"), ("device_lost", "driver_reset")])
def test_a_worker_killed_for_a_hang_fails_its_attempt_as_a_stall(gone: str, kind: str) -> None:
    """Round 19: a split worker hung (SIGSTOP) and killed by its health pings failed over as
    ``failover:crash``; its attempt is a stall (not a severe fault), and the worker is not
    killed a second time (``gone``)."""
    from spillover.runtime.worker_client import WorkerGone

    exe = execution(FakeScheduler([]))

    async def events() -> Any:
        yield WorkerGone(gone, "killed by SIGKILL")

    async def go() -> _Failure:
        d = SimpleNamespace(route="split", worker=worker(GPU_FP))
        with pytest.raises(_Failure) as err:
            await exe._next(events(), d, 5.0)  # type: ignore[arg-type]
        return err.value

    f = asyncio.run(go())
    assert (f.kind, f.gone) == (kind, True)


def test_a_failover_does_not_return_after_a_stall_or_with_its_runs_last_attempt() -> None:
    """Round 22: a stall may be the request's own doing, and a hang kill leaves the breaker
    closed, so it would go back beside live traffic; with ``max_attempts`` 2 the return spent
    the run's last attempt, so the CPU replica never ran. Neither returns."""
    sched = FakeScheduler([worker(GPU_FP)])
    exe = execution(sched)
    exe.attempt += 1  # the first attempt's dispatch
    d = SimpleNamespace(route="gpu", worker=worker(GPU_FP))

    async def stall() -> None:
        await exe._failover(d, _Failure("stall", "no token progress"))  # type: ignore[arg-type]

    asyncio.run(stall())
    assert not sched.submitted[0][0].returns
    sched = FakeScheduler([worker(GPU_FP)])
    exe = execution(sched, failover=FailoverConfig(max_attempts=2))
    _fail_gpu_attempt(exe)
    assert [lane for _, lane in sched.submitted] == ["cpu"] and not sched.submitted[0][0].returns
    sched = FakeScheduler([worker(GPU_FP)])
    exe = execution(sched)  # max_attempts 3: attempt 2 may return, a failure there leaves the third
    _fail_gpu_attempt(exe)
    assert sched.submitted[0][0].returns


def _run_cpu_attempt(exe: Execution, tokens: int, done: Any) -> None:
    """Run one attempt of ``exe`` on a stand-in CPU worker that starts, writes ``tokens``
    tokens and ends with ``done``."""
    from spillover.core.routing import Reason as R
    from spillover.runtime.events import Started, Token
    from spillover.runtime.lanes import Dispatch

    async def generate(_msg: dict[str, Any]) -> Any:
        yield Started()
        for i in range(tokens):
            yield Token(i, "x")
        yield done

    w = SimpleNamespace(
        generate=generate,
        has_event=lambda rid: False,
        interrupt=lambda rid: None,
        when_stopped=lambda rid: None,
        release_slot=lambda rid: None,
        spec=SimpleNamespace(worker_id="cpu0"),
    )
    d = Dispatch(w, "cpu", R.CPU_LANE, 8, 11, 0, False, 0.0)  # type: ignore[arg-type]
    job = SimpleNamespace(running=False, released=False, dispatch=d)

    async def go() -> list[Any]:
        return [ev async for ev in exe._run_attempt(job, d)]  # type: ignore[arg-type]

    asyncio.run(go())


@pytest.mark.parametrize("tokens", [0, 2])
def test_a_replicas_recovery_is_timed_to_its_first_result_even_an_answer_without_a_token(tokens: int) -> None:
    """Round 27: after a fault, the CPU replica's recovery (fault to first CPU result) is told
    at its first token; when its answer has none (the first token it samples ends it), at its
    end. Before, such an answer left ``last_failover`` at the failover before."""
    from spillover.runtime.events import Done

    recovered: list[float] = []
    sched = SimpleNamespace(confirmed=lambda rid: None, record_timing=lambda *a, **k: None, finished=lambda *a: None)
    exe = execution(sched, on_recovered=recovered.append)  # type: ignore[arg-type]
    exe._fault_at = time.monotonic() - 0.5  # the GPU attempt failed half a second ago
    _run_cpu_attempt(exe, tokens, Done("stop", tokens, 0.01, 0.02))
    assert len(recovered) == 1 and 500 <= recovered[0] < 5000, recovered
    assert exe._fault_at is None


def test_a_continuation_feeds_its_prefill_and_its_answers_length() -> None:
    """A streamed answer resumed after 3 delivered tokens writes 5 more: its lane's speed is fed
    the tokens the attempt prefilled (the 3-token prompt and the 3 delivered) and the 5 it
    wrote, its typical answer length the 8 the client got (round 63: the prefill counted the
    new tokens too, the length only the attempt's)."""
    from spillover.runtime.events import Done

    fed: list[tuple[Any, ...]] = []
    sched = SimpleNamespace(
        confirmed=lambda rid: None,
        record_timing=lambda *a, **k: fed.append((*a, k)),
        finished=lambda *a: None,
    )
    exe = execution(sched, incremental=True)  # type: ignore[arg-type]
    exe.delivered.extend([7, 8, 9])
    _run_cpu_attempt(exe, 5, Done("stop", 5, 0.01, 0.2))
    assert fed == [("cpu", 6, 5, 0.01, 0.2, {"answer_tokens": 8})]


def test_a_failover_the_cpu_lane_refuses_is_reported_on_the_cpu_lane() -> None:
    """Round 50: a failover journaled QUEUED on the CPU lane and then refused there (a full
    queue, a deadline, an expiry) ended reported as the failed GPU attempt (``gpu``, ``fits``):
    where the run is, for its error, is the queued attempt."""

    class FullCpuLane(FakeScheduler):
        def submit_nowait(self, job: Any, lane: str | None = None) -> None:
            raise QueueFull("the cpu queue is full (1 waiting)", retry_after_s=2.0)

    sched = FullCpuLane([worker(GPU_FP)])
    exe = execution(sched, attempt=1)
    exe.dispatched = RouteInfo("gpu", "fits", 1, "gpu0", 8, 256, False, 0.0, 0, 0, False)
    d = SimpleNamespace(route="gpu", worker=worker(GPU_FP))

    async def go() -> None:
        await exe._failover(d, _Failure("crash", "killed"))  # type: ignore[arg-type]

    with pytest.raises(WorkerFailed):
        asyncio.run(go())
    assert exe.dispatched is not None
    assert (exe.dispatched.route, exe.dispatched.reason, exe.dispatched.attempt) == ("cpu", "failover:crash", 2)
