"""``runtime.status.serving_mode``: the mode's reasons name the device worker that is down,
the resident or (when only it runs, the split profile) the split worker, and why none can
start when every one failed its last start."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from spillover.errors import NoWorkerReady
from spillover.runtime.status import DegradedAnswers, serving_mode


def _gateway(*, resident: bool, cannot_start: NoWorkerReady | None = None) -> Any:
    plan = SimpleNamespace(profile="gpu" if resident else "split", why="all layers need 243 MiB")
    scheduler = SimpleNamespace(
        gpu_workers=["gpu0"] if resident else [],
        split_workers=[] if resident else ["split0"],
        split_breaker=SimpleNamespace(circuit=SimpleNamespace(value="closed")),
        cpu=SimpleNamespace(queue=deque()),
        cpu_blocked=None,
        cannot_start=lambda: cannot_start,
    )
    chat = SimpleNamespace(profile=plan, split=None if resident else object(), scheduler=scheduler)
    return SimpleNamespace(
        chat=chat, chats=[chat], device=object(), degraded=DegradedAnswers(), loops=SimpleNamespace(fatal=None)
    )


def test_a_dead_split_worker_is_named_when_only_it_runs_on_the_device() -> None:
    workers = [{"lane": "split", "state": "restarting"}, {"lane": "cpu", "state": "ready"}]
    mode, reasons = serving_mode(_gateway(resident=False), workers, "closed")
    assert mode == "degraded" and "split worker not ready" in reasons and "gpu worker not ready" not in reasons


def test_a_dead_resident_worker_is_named_as_the_gpu_worker() -> None:
    workers = [{"lane": "gpu", "state": "restarting"}, {"lane": "cpu", "state": "ready"}]
    mode, reasons = serving_mode(_gateway(resident=True), workers, "closed")
    assert (mode, reasons) == ("degraded", ["gpu worker not ready"])


def test_workers_that_cannot_start_are_named_with_why() -> None:
    why = NoWorkerReady("chat model 'm' has no worker that can start (gpu worker: GGML_ASSERT(buffer) failed)")
    workers = [{"lane": "gpu", "state": "dead"}, {"lane": "cpu", "state": "dead"}]
    mode, reasons = serving_mode(_gateway(resident=True, cannot_start=why), workers, "closed")
    assert (mode, reasons) == ("unavailable", ["gpu worker not ready", why.message])


def test_a_second_chat_model_that_cannot_start_is_named_while_the_primary_serves() -> None:
    """Only the primary's was looked at: a [[services]] chat model whose workers all failed left
    the mode normal while each of its requests was refused (a helper's attack)."""
    gw = _gateway(resident=True)
    why = NoWorkerReady("chat model 'deci2' has no worker that can start (gpu worker: GGML_ASSERT(buffer) failed)")
    second = SimpleNamespace(scheduler=SimpleNamespace(cannot_start=lambda: why))
    gw.chats = [gw.chat, second]
    workers = [{"lane": "gpu", "state": "ready"}, {"lane": "cpu", "state": "ready"}]
    assert serving_mode(gw, workers, "closed") == ("degraded", [why.message])
