"""The request's lease (its worker slot) comes back exactly once, and only when the worker
has stopped working on the request: after a cancel, after the consumer goes away, after the
task is cancelled, and, for a worker that ignores the stop, when it has been killed.

The worker here is a few lines of Python speaking the real channel protocol: it streams a
token every 20 ms and answers a cancel only ``STOP_DELAY_S`` later (as a worker in the middle
of a prefill would), or never (``--deaf``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from spillover.config import FailoverConfig, LaneConfig
from spillover.errors import RequestCancelled
from spillover.runtime.executor import Execution, RetryBudget, TokenOut
from spillover.runtime.scheduler import Scheduler
from spillover.runtime.worker_client import WorkerClient, WorkerSpec

STOP_DELAY_S = 0.4
FAKE_WORKER = r"""
import json, os, select, sys, time
deaf = "--deaf" in sys.argv
print(json.dumps({"ev": "ready", "info": {"pid": os.getpid()}}), flush=True)
rid, left, stop_at = None, 0, None
while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.02)
    if ready:
        line = sys.stdin.readline()
        if not line:
            break
        msg = json.loads(line)
        if msg["op"] == "generate":
            rid, left, stop_at = msg["rid"], msg["max_tokens"], None
            print(json.dumps({"ev": "started", "rid": rid}), flush=True)
        elif msg["op"] == "cancel" and msg["rid"] == rid and not deaf:
            stop_at = time.monotonic() + STOP_DELAY_S
    if rid is None:
        continue
    if stop_at is not None and time.monotonic() >= stop_at:
        print(json.dumps({"ev": "done", "rid": rid, "finish_reason": "cancelled", "completion_tokens": 0}), flush=True)
        rid = None
    elif left > 0:
        print(json.dumps({"ev": "token", "rid": rid, "id": 5, "text": "x"}), flush=True)
        left -= 1
    elif stop_at is None:
        print(json.dumps({"ev": "done", "rid": rid, "finish_reason": "length", "completion_tokens": 0}), flush=True)
        rid = None
""".replace("STOP_DELAY_S", str(STOP_DELAY_S))


@dataclass(frozen=True)
class FakeSpec(WorkerSpec):
    """A worker that is a short script instead of a model server."""

    deaf: bool = False

    def argv(self) -> list[str]:
        return [sys.executable, "-c", FAKE_WORKER, *(["--deaf"] if self.deaf else [])]


@contextlib.asynccontextmanager
async def lane(deaf: bool = False) -> AsyncIterator[tuple[Scheduler, WorkerClient, list[WorkerClient]]]:
    """A CPU lane (no GPU) with one one-slot fake worker, started."""
    spec = FakeSpec("cpu0", "cpu", "cpu", "", "", 1, 4096, 1, 8, deaf=deaf)
    worker = WorkerClient(spec, lambda _w, _g: None)
    sched = Scheduler(gpu_lane=None, cpu_lane=LaneConfig(slots=1), ledger=None, policy=None)
    sched.cpu_workers.append(worker)
    await worker.start(20)
    killed: list[WorkerClient] = []
    try:
        yield sched, worker, killed
    finally:
        await worker.stop()


def execution(sched: Scheduler, killed: list[WorkerClient], stall_s: float = 30.0) -> Execution:
    async def kill(w: WorkerClient) -> None:
        killed.append(w)
        await w.kill()

    return Execution(
        rid="r1",
        tokens=[1, 2, 3],
        max_tokens=500,
        params={},
        incremental=True,
        allow_shrink=False,
        scheduler=sched,
        journal=None,
        failover=FailoverConfig(stall_timeout_s=stall_s),
        budget=RetryBudget(10),
        kill_worker=kill,
    )


async def first_tokens(events: Any, n: int) -> None:
    seen = 0
    async for ev in events:
        seen += isinstance(ev, TokenOut)
        if seen >= n:
            return


def test_a_cancelled_request_keeps_its_slot_until_the_worker_has_stopped() -> None:
    """DELETE of a running request: the client's events end at once with RequestCancelled,
    but the slot comes back only with the worker's last event, STOP_DELAY_S later."""

    async def main() -> None:
        async with lane() as (sched, worker, killed):
            exe = execution(sched, killed)
            events = exe.events()
            await first_tokens(events, 3)
            assert worker.busy == 1
            exe.cancel()
            with pytest.raises(RequestCancelled):
                async for _ in events:
                    pass
            stopped = worker.when_stopped("r1")
            assert stopped is not None and worker.busy == 1  # the worker is still on it
            await asyncio.wait_for(stopped, 5)
            await asyncio.sleep(0)  # the release runs as the future's callback
            assert worker.busy == 0 and not killed

    asyncio.run(main())


@pytest.mark.parametrize("how", ["aclose", "task_cancel"])
def test_a_consumer_that_goes_away_stops_the_worker_and_then_frees_the_slot(how: str) -> None:
    """The consumer closes the events (a stream's client hung up) or its task is cancelled:
    the worker is told to stop, and the slot is free once it has."""

    async def main() -> None:
        async with lane() as (sched, worker, killed):
            exe = execution(sched, killed)
            events = exe.events()
            if how == "aclose":
                await first_tokens(events, 3)
                await events.aclose()
            else:
                task = asyncio.ensure_future(first_tokens(events, 10_000))
                while worker.busy == 0 or worker.when_stopped("r1") is None:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            stopped = worker.when_stopped("r1")
            assert stopped is not None and worker.busy == 1
            await asyncio.wait_for(stopped, 5)
            await asyncio.sleep(0)
            assert worker.busy == 0 and not killed

    asyncio.run(main())


def test_a_worker_that_ignores_the_stop_is_killed_and_its_exit_frees_the_slot() -> None:
    """A worker deaf to the cancel is killed after the stall bound; its exit frees the slot."""

    async def main() -> None:
        async with lane(deaf=True) as (sched, worker, killed):
            exe = execution(sched, killed, stall_s=0.3)
            events = exe.events()
            await first_tokens(events, 2)
            exe.cancel()
            with pytest.raises(RequestCancelled):
                async for _ in events:
                    pass
            stopped = worker.when_stopped("r1")
            assert stopped is not None
            await asyncio.wait_for(stopped, 10)
            await asyncio.sleep(0)
            assert killed == [worker] and worker.busy == 0

    asyncio.run(main())


def test_a_request_cancelled_before_it_reaches_the_worker_frees_the_slot_at_once() -> None:
    """Cancelled between dispatch and the generate op: nothing is sent, the slot is back now."""

    async def main() -> None:
        async with lane() as (sched, worker, killed):
            exe = execution(sched, killed)
            exe.submit_nowait()  # a free slot: dispatched at once
            assert worker.busy == 1
            exe.cancel()
            assert worker.busy == 0 and worker.when_stopped("r1") is None
            with pytest.raises(RequestCancelled):
                async for _ in exe.events():
                    pass
            assert worker.busy == 0

    asyncio.run(main())


def test_a_request_whose_time_runs_out_in_the_queue_leaves_it() -> None:
    """request_timeout_s passing while the request waits for a slot: RequestTimedOut, out of
    the queue, and the running request's slot untouched."""
    from spillover.errors import RequestTimedOut

    async def main() -> None:
        async with lane() as (sched, worker, killed):
            first = execution(sched, killed)
            first_events = first.events()
            await first_tokens(first_events, 1)
            waiting = execution(sched, killed)
            waiting.rid = "r2"
            waiting.timeout_at_s = asyncio.get_running_loop().time() + 0.2
            with pytest.raises(RequestTimedOut):
                async for _ in waiting.events():
                    pass
            assert not sched.cpu.queue and worker.busy == 1
            await first_events.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_tokens_that_came_in_time_while_the_loop_was_busy_are_no_stall(loop_name: str) -> None:
    """The gateway's loop is busy past a stream's stall bound while its worker goes on writing
    tokens (every 20 ms). Those lines came in time: the next turn reads them, and the attempt
    goes on on the same worker. Before ``Watchdog`` rule 4 the expired timer ran first in that
    turn: a stall, the healthy worker killed (and, on a CPU lane, the request ended)."""
    import time

    import uvloop

    async def main() -> tuple[int, list[WorkerClient]]:
        async with lane() as (sched, _worker, killed):
            exe = execution(sched, killed, stall_s=0.1)  # the CPU lane's steady bound: 0.4 s
            events = exe.events()
            await first_tokens(events, 3)
            # While the attempt waits for its next token, the loop is busy past the bound (as a
            # loop under load can be: here one long callback).
            asyncio.get_running_loop().call_later(0.05, time.sleep, 1.0)
            seen = 0
            async for ev in events:
                seen += isinstance(ev, TokenOut)
                if seen >= 20:
                    break
            await events.aclose()
            return seen, killed

    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        seen, killed = runner.run(main())
    assert seen >= 20 and not killed
