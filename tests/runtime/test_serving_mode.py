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
        host_held=None,
        cannot_start=lambda: cannot_start,
    )
    chat = SimpleNamespace(profile=plan, split=None if resident else object(), scheduler=scheduler)
    return SimpleNamespace(
        chat=chat,
        chats=[chat],
        device=object(),
        degraded=DegradedAnswers(),
        loops=SimpleNamespace(fatal=None),
        device_hang=False,
        journal=SimpleNamespace(failing=False),
        pending_outcomes={},
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


def test_a_journal_that_cannot_write_makes_the_gateway_unavailable_and_says_why() -> None:
    """Round 18: with the journal's disk full every new request got 503, and the mode said
    normal with no reason; answers held back (not durable yet) were not named either."""
    gw = _gateway(resident=True)
    workers = [{"lane": "gpu", "state": "ready"}, {"lane": "cpu", "state": "ready"}]
    gw.journal.failing = True
    mode, reasons = serving_mode(gw, workers, "closed")
    assert mode == "unavailable" and reasons == ["the journal cannot write (a full disk?): new requests are refused"]
    gw.journal.failing, gw.pending_outcomes = False, {"r1": None, "r2": None}  # a write went through; two wait
    mode, reasons = serving_mode(gw, workers, "closed")
    assert mode == "degraded" and "2 answers held until it can" in reasons[0]
    gw.pending_outcomes = {}
    assert serving_mode(gw, workers, "closed") == ("normal", [])


def test_a_hung_device_makes_the_mode_degraded() -> None:
    """Round 18: ``device.hang`` was true in the same document whose mode said normal, while
    every GPU request stalled (16 s) before it went to the CPU."""
    gw = _gateway(resident=True)
    gw.device_hang = True
    workers = [{"lane": "gpu", "state": "ready"}, {"lane": "cpu", "state": "ready"}]
    mode, reasons = serving_mode(gw, workers, "closed")
    assert mode == "degraded" and "hung" in reasons[0]
