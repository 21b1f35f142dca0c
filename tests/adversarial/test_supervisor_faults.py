"""The supervisor survives faults in its own loop: an unreadable device, a listener that
raises, a round that raises. Each would have ended the supervisor task silently (the GPU
worker then stays dead for good). Fast tier: a tiny fake worker process, no model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spillover.config import SupervisorConfig
from spillover.runtime.events import SupervisorEvent, SupervisorEventKind
from spillover.runtime.supervisor import Supervisor
from spillover.runtime.worker_client import WorkerClient, WorkerSpec

# Says it is ready, then lives ``argv[1]`` seconds: every start is followed by a death.
FAKE_WORKER = (
    "import json, os, sys, time\n"
    "print(json.dumps({'ev': 'ready', 'info': {'pid': os.getpid()}}), flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)
FAST = SupervisorConfig(
    restart_backoff_initial_s=0.01,
    restart_backoff_max_s=0.05,
    health_timeout_s=30.0,
    load_timeout_s=20.0,
    release_wait_s=0.2,
)


@dataclass(frozen=True)
class FakeWorkerSpec(WorkerSpec):
    """A worker that is a few lines of Python instead of a model server."""

    life_s: float = 0.05

    def argv(self) -> list[str]:
        return [sys.executable, "-c", FAKE_WORKER, str(self.life_s)]


def spec() -> FakeWorkerSpec:
    return FakeWorkerSpec(
        worker_id="gpu0", lane="gpu", device="sim:64", model_path="", state_dir="", slots=1, n_ctx=64, n_threads=1,
        n_batch=8,
    )  # fmt: skip


class UnreadableDevice:
    """A device whose every reading fails, as a vanished sim ledger or a lost NVML would."""

    def __init__(self) -> None:
        self.reads = 0

    def held_by(self, pid: int) -> int:
        self.reads += 1
        raise OSError(f"device ledger unreadable (asked about pid {pid})")


class ReleasedDevice:
    """A device that always shows the dead worker's memory released."""

    def held_by(self, pid: int) -> int:
        return 0


def supervise_until_ready(
    n: int,
    *,
    device: Any,
    listener: Callable[[str], None] = lambda e: None,
    patch: Callable[[Supervisor], None] = lambda s: None,
) -> Supervisor:
    """Run a supervisor until its worker has become ready ``n`` times; fail at once if its
    task ends first."""

    async def go() -> Supervisor:
        readies = asyncio.Event()
        seen: list[str] = []

        def on_change(w: WorkerClient, ev: SupervisorEvent) -> None:
            if ev.kind is SupervisorEventKind.READY:
                seen.append(str(ev))
                if len(seen) >= n:
                    readies.set()
            listener(str(ev))

        sup = Supervisor(spec(), FAST, device=device, on_change=on_change)
        patch(sup)
        task = asyncio.create_task(sup.run())
        waiter = asyncio.create_task(readies.wait())
        try:
            await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert not task.done(), f"the supervisor task ended: {task.exception() if task.done() else None}"
            assert readies.is_set(), f"only {len(seen)} starts: {sup.events}"
        finally:
            waiter.cancel()
            await sup.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return sup

    return asyncio.run(go())


def test_unreadable_device_while_waiting_for_release_does_not_end_supervision(caplog: pytest.LogCaptureFixture) -> None:
    """A device whose ``held_by`` raises is logged and treated as not released yet: after the
    bounded release wait the dead worker is restarted, again and again."""
    dev = UnreadableDevice()
    with caplog.at_level(logging.WARNING, logger="spillover.supervisor"):
        sup = supervise_until_ready(3, device=dev)
    assert dev.reads >= 2
    assert sup.restarts >= 2
    assert "cannot read the device" in caplog.text
    assert any("not released after 0.2s (device unreadable" in what for _, what in sup.events), sup.events


class SlowReleaseDevice:
    """A device that shows a dead worker's memory held for its first reads of each pid, and
    notes what the worker's row said it waits for at each read."""

    def __init__(self) -> None:
        self.sup: Supervisor | None = None
        self.reads: dict[int, int] = {}
        self.seen: list[str | None] = []

    def held_by(self, pid: int) -> int:
        assert self.sup is not None
        self.seen.append(self.sup.worker.statistics().waiting)
        self.reads[pid] = self.reads.get(pid, 0) + 1
        return 1024 if self.reads[pid] <= 3 else 0


def test_a_restart_waiting_for_the_device_says_so_in_its_row() -> None:
    """While the device still holds the dead worker's memory, the worker's row (``waiting``)
    names the release it waits for; once the device released it and the worker is up, nothing."""
    dev = SlowReleaseDevice()

    def keep(sup: Supervisor) -> None:
        dev.sup = sup

    sup = supervise_until_ready(2, device=dev, patch=keep)
    assert dev.seen[0] is None  # the first read: nothing was held yet
    assert any(w is not None and w.startswith("the device to release the memory of its last process") for w in dev.seen)
    assert dev.seen[-1] is not None  # the last read still waited; then it released, and the row cleared
    assert sup.worker.statistics().waiting is None


def test_listener_that_raises_does_not_end_supervision(caplog: pytest.LogCaptureFixture) -> None:
    """A listener (the gateway's event hook) that raises on every event is logged, and the
    worker is still started and restarted."""

    def broken(what: str) -> None:
        raise RuntimeError(f"listener bug on {what!r}")

    with caplog.at_level(logging.ERROR, logger="spillover.supervisor"):
        sup = supervise_until_ready(2, device=ReleasedDevice(), listener=broken)
    assert sup.restarts >= 1
    assert "listener failed on starting" in caplog.text and "listener bug" in caplog.text


def test_round_that_raises_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    """An exception escaping a supervisor round (here: the release wait) is logged with its
    traceback, counted, and the loop goes on after a back-off."""
    failed: list[int] = []

    def patch(sup: Supervisor) -> None:
        original = sup._wait_released

        async def broken_once(pid: int) -> None:
            if not failed:
                failed.append(pid)
                raise RuntimeError("a bug in one round")
            await original(pid)

        sup._wait_released = broken_once  # type: ignore[method-assign]

    with caplog.at_level(logging.ERROR, logger="spillover.supervisor"):
        sup = supervise_until_ready(3, device=ReleasedDevice(), patch=patch)
    assert failed and sup.errors == 1
    assert "supervisor round failed" in caplog.text and "a bug in one round" in caplog.text
    assert any(what.startswith("supervisor_error: RuntimeError") for _, what in sup.events), sup.events


@dataclass(frozen=True)
class AbortingWorkerSpec(WorkerSpec):
    """A worker whose engine aborts while loading, as llama.cpp does on a file it cannot place."""

    def argv(self) -> list[str]:
        said = "print('ggml/src/ggml-backend.cpp:205: GGML_ASSERT(buffer) failed', file=sys.stderr, flush=True)"
        return [sys.executable, "-c", f"import os, sys; {said}; os.abort()"]


def test_a_start_that_aborts_is_kept_before_its_death_is_told_and_counts_as_a_restart() -> None:
    """Rule 8. The owner's pass on the worker's death (a chat model refusing its queued requests)
    must see the failed start: it was kept only after the death was told, so requests that came
    while the workers first started got "The GPU is full" (a helper's attack). The attempt after
    it counts as a restart (it stayed 0 however often the start failed), and the refusal's
    Retry-After is when that attempt comes."""

    async def go() -> tuple[Supervisor, list[str | None]]:
        at_death: list[str | None] = []
        sup: Supervisor | None = None
        ahead.clear()

        def on_change(w: WorkerClient, ev: SupervisorEvent) -> None:
            if sup is None:
                return
            now = time.monotonic()
            if ev.kind is SupervisorEventKind.DIED:
                at_death.append(sup.start_failure)
                ahead.append(sup.next_start_s - now)
            if ev.kind is SupervisorEventKind.STARTING and sup.start_failure is not None:  # a retry runs
                ahead.append(sup.next_start_s - now)

        aborting = AbortingWorkerSpec(
            worker_id="cpu0", lane="cpu", device="cpu", model_path="", state_dir="", slots=1, n_ctx=64, n_threads=1,
            n_batch=8,
        )  # fmt: skip
        sup = Supervisor(aborting, FAST, on_change=on_change)
        task = asyncio.create_task(sup.run())
        try:
            for _ in range(400):
                if sup.restarts >= 2:
                    break
                await asyncio.sleep(0.05)
        finally:
            await sup.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return sup, at_death

    ahead: list[float] = []  # when a refusal would say the next try is, from now
    sup, at_death = asyncio.run(go())
    assert sup.restarts >= 2, sup.events
    # Told at each death and while each retry loads: ahead by at least the back-off to come
    # (it said 1 s, or a time long past, while a retry loaded).
    assert ahead and min(ahead) >= FAST.restart_backoff_initial_s * 0.5, ahead
    assert at_death and all(
        f == "exited: worker exited with code -6 (SIGABRT): ggml-backend.cpp:205: GGML_ASSERT(buffer) failed"
        for f in at_death
    ), at_death
    assert sup.start_failure == at_death[0] and sup.next_start_s > 0
    assert sup.failed_starts == sup.restarts  # every start failed, in a row (the host guard stops counting it)


def test_restarting_is_true_from_a_death_until_the_next_ready_and_false_once_stopped() -> None:
    """``Supervisor.restarting`` (the host guard counts a restarting worker's memory as taken):
    true from its worker's death through its back-off and load, false while it is up, and
    false once the supervisor stopped it for good (that memory is not taken again)."""
    box: list[Supervisor] = []
    seen: list[tuple[str, bool]] = []

    def note(what: str) -> None:
        seen.append((what.split(":")[0].split(" ")[0], box[0].restarting))

    sup = supervise_until_ready(2, device=ReleasedDevice(), listener=note, patch=box.append)
    died = next(i for i, (kind, _) in enumerate(seen) if kind == "died")
    after = seen[died:]
    ready = next(i for i, (kind, _) in enumerate(after) if kind == "ready")
    assert all(restarting for _, restarting in after[:ready]), seen  # died, restarting, starting: true
    assert [k for k, _ in after[:ready]] == ["died", "restarting", "starting"], seen
    assert after[ready] == ("ready", False), seen
    assert sup.restarting is False  # stopped for good


class FailsOnceWorkerSpec(FakeWorkerSpec):
    """Aborts its first start (a marker file notes it), then is ready."""

    def argv(self) -> list[str]:
        marker = f"{self.state_dir}/failed-once"
        code = (
            f"import json, os, sys, time\nif not os.path.exists({marker!r}):\n"
            f"    open({marker!r}, 'w').close(); os.abort()\n"
            "print(json.dumps({'ev': 'ready', 'info': {'pid': os.getpid()}}), flush=True)\ntime.sleep(60)\n"
        )
        return [sys.executable, "-c", code]


def test_failed_starts_count_in_a_row_and_end_at_a_ready_and_a_parked_worker_is_not_restarting(
    tmp_path: Path,
) -> None:
    """``Supervisor.failed_starts`` (after three in a row the host guard stops counting the
    worker's memory as coming back) is 1 after a start that failed, 0 once a start comes up;
    a parked worker (rule 7: unloaded on purpose) is not ``restarting``."""

    async def go() -> tuple[int, int, bool, bool]:
        failed_at_retry: list[int] = []
        sup: Supervisor | None = None
        ready = asyncio.Event()

        def on_change(w: WorkerClient, ev: SupervisorEvent) -> None:
            if sup is not None and ev.kind is SupervisorEventKind.STARTING:
                failed_at_retry.append(sup.failed_starts)
            if ev.kind is SupervisorEventKind.READY:
                ready.set()

        spec = FailsOnceWorkerSpec(
            worker_id="gpu0", lane="gpu", device="sim:64", model_path="", state_dir=str(tmp_path), slots=1, n_ctx=64,
            n_threads=1, n_batch=8,
        )  # fmt: skip
        sup = Supervisor(spec, FAST, on_change=on_change)
        task = asyncio.create_task(sup.run())
        try:
            await asyncio.wait_for(ready.wait(), 30)
            after_ready = sup.failed_starts
            await sup.park("room for interactive work")
            parked_restarting = sup.restarting
            parked = sup.parked
        finally:
            await sup.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return failed_at_retry[-1], after_ready, parked_restarting, parked

    at_retry, after_ready, parked_restarting, parked = asyncio.run(go())
    assert (at_retry, after_ready) == (1, 0)
    assert parked and parked_restarting is False
