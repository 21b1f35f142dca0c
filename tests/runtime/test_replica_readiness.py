"""ReplicaReadiness.tick on a worker that is only its reports (no process): what it asks the
replica for, when it asks again, and when it leaves it alone."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.runtime import readiness as readiness_mod
from spillover.runtime.events import AudioInfo, Segment
from spillover.runtime.readiness import ReplicaReadiness
from spillover.runtime.service import _Recovery
from spillover.runtime.worker_client import STEP_SAMPLES, WorkerClient, WorkerSpec, WorkerState

W, C = 100, 30
TIMINGS = {"load_ms": 300.0, "ctx_ms": 40.0, "first_ms": 60.0}


def worker(mode: str, model: bool, contexts: int) -> WorkerClient:
    w = WorkerClient(WorkerSpec("cpu0", "cpu", "cpu", "", "", 2, 4096, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    report(w, mode, model, contexts)
    return w


def report(w: WorkerClient, mode: str, model: bool, contexts: int) -> None:
    w._held({"mode": mode, "model": model, "contexts": contexts, "timings": TIMINGS})


def replica(w: WorkerClient, configured: str = "auto", budget_ms: float = 1000.0, **kw: Any) -> ReplicaReadiness:
    return ReplicaReadiness(configured, budget_ms, lambda: w, weights_bytes=W, context_bytes=C, **kw)


def test_a_replica_in_the_mode_asked_and_within_room_is_left_alone() -> None:
    w = worker("on_demand", False, 0)
    r = replica(w)
    assert r.tick(10_000) is None
    assert (r.choice.mode, str(r.choice.why)) == ("on_demand", "cheapest_within_budget")


def test_a_tight_budget_asks_for_warm_once_per_report() -> None:
    w = worker("on_demand", False, 0)
    r = replica(w, budget_ms=70)
    assert r.tick(10_000) == "warm"
    assert r.tick(10_000) is None  # asked already; no new report
    report(w, "warm", True, 2)
    assert r.tick(10_000) is None  # there now


def test_on_demand_holding_its_first_requests_model_sheds_it_when_host_is_short() -> None:
    w = worker("on_demand", True, 2)  # a failover loaded the model and opened two contexts
    r = replica(w)
    assert r.held_bytes(w) == W + 2 * C
    assert r.tick(10_000) is None  # room enough: it keeps them (on_demand keeps what it loaded)
    assert r.tick(W) == "on_demand"  # short: asked again, which sheds what the mode does not keep
    report(w, "on_demand", False, 0)
    assert r.tick(W) is None


def test_a_move_the_replica_did_not_make_is_asked_again_only_after_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(readiness_mod.time, "monotonic", lambda: now[0])
    w = worker("on_demand", False, 0)
    r = replica(w, budget_ms=70)
    assert r.tick(10_000) == "warm"
    report(w, "on_demand", False, 0)  # its load failed: it reports the old mode
    assert r.tick(10_000) is None
    now[0] += readiness_mod.ASK_AGAIN_S
    assert r.tick(10_000) == "warm"


def test_a_mode_whose_load_failed_in_the_worker_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker took the mode but could not load the model (it reports warm without it): the
    mode is asked again after the pause, not left looking met."""
    now = [1000.0]
    monkeypatch.setattr(readiness_mod.time, "monotonic", lambda: now[0])
    w = worker("on_demand", False, 0)
    r = replica(w, budget_ms=70)
    assert r.tick(10_000) == "warm"
    report(w, "warm", False, 0)  # the move was taken, the load failed
    assert r.tick(10_000) is None  # within the pause
    now[0] += readiness_mod.ASK_AGAIN_S
    assert r.tick(10_000) == "warm"
    report(w, "warm", True, 2)
    now[0] += readiness_mod.ASK_AGAIN_S
    assert r.tick(10_000) is None  # loaded: left alone


def test_a_restarted_replica_is_asked_at_once() -> None:
    w = worker("on_demand", False, 0)
    r = replica(w, budget_ms=70)
    assert r.tick(10_000) == "warm"
    w.starts += 1
    report(w, "on_demand", False, 0)
    assert r.tick(10_000) == "warm"


def test_a_model_without_a_gpu_lane_keeps_its_replica_loaded() -> None:
    w = worker("on_demand", False, 0)
    r = replica(w, alone=True)
    assert r.tick(10_000) == "mmap" and str(r.choice.why) == "no_gpu_lane"


def test_a_failover_is_shown_but_does_not_move_the_prediction() -> None:
    w = worker("on_demand", False, 0)
    r = replica(w)
    before = r.recovery()
    r.observe(7000.0)  # a long prompt's prefill is in this figure
    assert r.recovery() == before
    assert r.status()["last_failover"]["recovery_ms"] == 7000.0
    assert r.tick(10_000) is None  # still on_demand


def measured(w: WorkerClient, load_ms: float) -> None:
    """A report after the replica loaded its model again, in ``load_ms``."""
    w._held({"mode": "on_demand", "model": False, "contexts": 0, "timings": TIMINGS | {"load_ms": load_ms}})


def test_the_prediction_takes_each_steps_slowest_recent_measurement() -> None:
    """One load's time varies by a third between loads: the prediction is the slowest of the
    step's last STEP_SAMPLES after the first, so the next recovery does not overrun what was promised."""
    w = worker("on_demand", False, 0)  # the start-up measurement: load 300
    r = replica(w)
    assert r.recovery()["on_demand"] == 300.0 + 40.0 + 60.0  # the first counts while it is alone
    measured(w, 450.0)
    measured(w, 320.0)  # the latest is faster than the one before
    assert r.recovery()["on_demand"] == 450.0 + 40.0 + 60.0
    assert r.status()["predicted_steps_ms"] == {"load_ms": 450.0, "ctx_ms": 40.0, "first_ms": 60.0}
    assert r.status()["recovery_ms"]["on_demand"] == 550.0 and r.status()["timings_ms"]["load_ms"] == 320.0
    for _ in range(3):
        measured(w, 320.0)  # the same figure reported again is not a new measurement
    assert list(w.step_samples["load_ms"]) == [450.0, 320.0]
    for ms in (311.0, 312.0, 313.0):  # three new ones: 450 is the oldest of the last five
        measured(w, ms)
    assert len(w.step_samples["load_ms"]) == STEP_SAMPLES == 5 and r.recovery()["on_demand"] == 550.0
    measured(w, 314.0)  # the next pushes it out
    assert r.recovery()["on_demand"] == 320.0 + 40.0 + 60.0


def test_the_start_up_measurement_counts_only_until_a_step_has_another() -> None:
    """Round 67: the gateway's start-up load (every worker at once, a cold page cache) took 2-4
    times what later loads did; kept among the five, it held auto in a dearer mode for five loads."""
    w = WorkerClient(WorkerSpec("cpu0", "cpu", "cpu", "", "", 2, 4096, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    w._held({"mode": "on_demand", "model": False, "contexts": 0, "timings": TIMINGS | {"load_ms": 783.0}})
    r = replica(w, budget_ms=500.0)
    assert r.recovery()["on_demand"] == 883.0 and r.tick(10_000) == "mmap"  # over the budget on it alone
    measured(w, 250.0)  # a failover's load
    assert r.status()["predicted_steps_ms"]["load_ms"] == 250.0 and r.recovery()["on_demand"] == 350.0
    assert w.step_first == {"load_ms": 783.0, "ctx_ms": 40.0, "first_ms": 60.0}
    report(w, "mmap", True, 0)  # its move (the load's figure back at the start-up one: a new measurement)
    assert r.recovery()["on_demand"] == 300.0 + 40.0 + 60.0


def test_a_restarted_replicas_measurements_join_the_ones_before() -> None:
    w = worker("on_demand", False, 0)
    r = replica(w)
    measured(w, 500.0)
    assert r.recovery()["on_demand"] == 600.0
    w.held, w.contexts = {}, 0  # the process exits (what the worker client does then)
    assert r.recovery() == {} and r.status()["predicted_steps_ms"] == {}  # it holds nothing
    measured(w, 500.0)  # the new process reports the same figure: its own measurement
    measured(w, 200.0)
    assert r.recovery()["on_demand"] == 600.0  # the slow loads are still among the last five
    assert list(w.step_samples["load_ms"]) == [500.0, 500.0, 200.0] and w.step_first["load_ms"] == 300.0


def test_status_of_a_dead_replica_holds_nothing() -> None:
    w = worker("warm", True, 2)
    w.held, w.contexts = {}, 0  # what the worker client does when the process exits
    st = replica(w).status()
    assert (st["holding"], st["model_loaded"], st["contexts"], st["recovery_ms"]) == ("", False, 0, {})


def test_the_worker_row_shows_what_the_replica_holds_now_not_at_ready() -> None:
    """/v1/status ``workers[].info.held`` follows the replica's ``held`` reports (an on_demand
    replica that loaded its model at a failover), as ``cpu_readiness`` does."""
    from tests.runtime.fakes import ready_worker

    w = ready_worker("cpu0", "cpu", slots=2)
    w.info = {"held": {"mode": "on_demand", "model": False, "contexts": 0}, "pid": 1, "weights_bytes": 0}
    assert w.statistics().info == w.info  # no report since ready
    w._dispatch({"ev": "held", "mode": "on_demand", "model": True, "contexts": 2})
    info = w.statistics().info
    assert info is not None and info["held"] == {"mode": "on_demand", "model": True, "contexts": 2}
    assert info["pid"] == 1 and w.info["held"]["model"] is False  # the ready report is kept as it came


def test_a_transcriptions_recovery_ends_at_its_first_segment_not_at_its_audio_info() -> None:
    """A transcription replayed on the CPU tells its ``AudioInfo`` once the audio is decoded,
    before any segment: the recovery (fault to first CPU result) ends at the first segment (a
    helper measured 943 ms to the first text while ``last_failover`` said 50 ms)."""
    seen: list[float] = []
    r = SimpleNamespace(observe=seen.append)
    rec = _Recovery(fault_at=time.monotonic() - 2.0, readiness=r)  # type: ignore[arg-type]
    parts: list[Any] = []
    part = rec.wrap(parts.append)
    part(AudioInfo("en", 40.0))
    assert seen == [] and not rec.told
    part(Segment({"id": 0, "text": " hi"}))
    part(Segment({"id": 1, "text": " there"}))
    assert len(seen) == 1 and seen[0] >= 2000.0  # once, at the first segment
    assert [type(p) for p in parts] == [AudioInfo, Segment, Segment]  # every event still passed on


def test_after_a_step_down_for_room_a_move_up_waits_until_the_room_has_lasted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 35: a reading over the host budget for a moment (another worker's load) stepped the
    replica down, the next one up, and so on every 0.2 s while it lasted, a model load each
    time. After a step down for room, a move up waits until the room has held ``UP_HOLD_S``."""
    now = [1000.0]
    monkeypatch.setattr(readiness_mod.time, "monotonic", lambda: now[0])
    w = worker("warm", True, 2)
    r = replica(w, budget_ms=70)  # only warm meets it
    assert r.tick(10_000) is None  # warm, and room for it
    assert r.tick(W - 1) == "on_demand" and str(r.choice.why) == "host_short"  # the reading is short
    now[0] += 0.2
    assert r.tick(10_000) is None and r.choice.mode == "on_demand"  # asked, not reported yet: not warm again
    report(w, "on_demand", False, 0)
    for _ in range(5):  # the room is back at once: held, and it says why
        now[0] += 0.2
        assert r.tick(10_000) is None
        assert (r.choice.mode, str(r.choice.why), r.choice.wanted) == ("on_demand", "host_short", "warm")
    assert r.tick(W - 1) is None  # short again within the hold: it starts again
    now[0] += readiness_mod.UP_HOLD_S - 0.01
    assert r.tick(10_000) is None
    now[0] += 0.01  # the room has lasted
    assert r.tick(10_000) == "warm" and str(r.choice.why) == "cheapest_within_budget"
