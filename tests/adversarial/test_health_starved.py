"""Supervisor rule 3 on a starved machine: a worker whose pings go unanswered is killed, but
a gateway whose own loop is held up (another process has the cores) does not kill a worker
whose pong is waiting unread in its pipe. Fast tier: a fake worker of a few lines."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass

from spillover.config import SupervisorConfig
from spillover.runtime.events import SupervisorEvent, SupervisorEventKind
from spillover.runtime.supervisor import Supervisor
from spillover.runtime.worker_client import WorkerClient, WorkerSpec

# Says it is ready, then answers every ping at once (``argv[1]`` "1"), or never ("0").
FAKE_WORKER = (
    "import json, os, sys\n"
    "answer = sys.argv[1] == '1'\n"
    "print(json.dumps({'ev': 'ready', 'info': {'pid': os.getpid()}}), flush=True)\n"
    "for line in sys.stdin:\n"
    "    msg = json.loads(line)\n"
    "    if answer and msg.get('op') == 'ping':\n"
    "        print(json.dumps({'ev': 'pong', 'seq': msg['seq'], 'progress': 0, 'contexts': 0}), flush=True)\n"
)
HEALTH = SupervisorConfig(
    restart_backoff_initial_s=5.0, health_interval_s=0.1, health_timeout_s=0.5, load_timeout_s=20.0, release_wait_s=0.1
)


@dataclass(frozen=True)
class PingWorkerSpec(WorkerSpec):
    answers: bool = True

    def argv(self) -> list[str]:
        return [sys.executable, "-c", FAKE_WORKER, "1" if self.answers else "0"]


def spec(answers: bool) -> PingWorkerSpec:
    return PingWorkerSpec(
        worker_id="cpu0", lane="cpu", device="cpu", model_path="", state_dir="", slots=1, n_ctx=64, n_threads=1,
        n_batch=8, answers=answers,
    )  # fmt: skip


def supervise(answers: bool, *, stall_loop_s: float, watch_s: float) -> list[str]:
    """Run a supervisor for ``watch_s`` after its worker is ready, blocking the event loop for
    ``stall_loop_s`` once (as a starved process would be) right after a ping went out; the
    supervisor's event texts."""

    async def go() -> list[str]:
        ready = asyncio.Event()

        def on_change(w: WorkerClient, ev: SupervisorEvent) -> None:
            if ev.kind is SupervisorEventKind.READY:
                ready.set()

        sup = Supervisor(spec(answers), HEALTH, on_change=on_change)
        task = asyncio.create_task(sup.run())
        try:
            await asyncio.wait_for(ready.wait(), 20)
            if stall_loop_s:
                await asyncio.sleep(0.05)  # a ping is out; its pong comes while the loop is blocked
                time.sleep(stall_loop_s)  # the point: the whole loop stops
            await asyncio.sleep(watch_s)
            return [what for _, what in sup.events]
        finally:
            await sup.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    return asyncio.run(go())


def unhealthy(events: list[str]) -> list[str]:
    return [e for e in events if e.startswith("unhealthy")]


def test_a_worker_that_never_answers_is_killed() -> None:
    events = supervise(False, stall_loop_s=0.0, watch_s=1.5)
    assert unhealthy(events), events
    assert "no pong for" in unhealthy(events)[0]


def test_a_blocked_gateway_loop_does_not_kill_a_worker_that_answered() -> None:
    """The loop stops for 1.5 s (three times the health timeout) while the worker's pongs pile
    up in the pipe: they are read before the verdict, and the worker lives on."""
    events = supervise(True, stall_loop_s=1.5, watch_s=1.0)
    assert not unhealthy(events), events


def test_a_worker_that_never_answers_is_still_killed_after_a_blocked_loop() -> None:
    """The gateway's lateness is excused once, not for ever: a silent worker is killed within
    the timeout of on-time loop turns after the loop is back."""
    events = supervise(False, stall_loop_s=1.5, watch_s=1.5)
    assert unhealthy(events), events
    assert "gateway's own lateness" in unhealthy(events)[0], unhealthy(events)
