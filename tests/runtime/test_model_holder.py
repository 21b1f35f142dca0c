"""``engine.holder.ModelHolder``: what an embeddings or transcription worker keeps loaded
between requests (its readiness), with a fake model so the rules are checked exactly."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from spillover.engine.holder import ModelHolder


class Fake:
    """Counts loads and probes; each load is a new model object."""

    def __init__(self) -> None:
        self.loads = 0
        self.probes: list[Any] = []
        self.reports: list[dict[str, Any]] = []
        self.holder: ModelHolder | None = None

    def load(self) -> Any:
        self.loads += 1
        return object()

    def probe(self, model: Any) -> None:
        self.probes.append(model)

    def changed(self) -> None:
        assert self.holder is not None
        self.reports.append(self.holder.held())

    def make(self, readiness: str) -> ModelHolder:
        self.holder = ModelHolder(self.load, self.probe, readiness=readiness, on_change=self.changed)
        return self.holder


@pytest.mark.parametrize(("mode", "loaded"), [("warm", True), ("mmap", True), ("on_demand", False)])
def test_measure_loads_and_probes_once_then_holds_what_the_mode_keeps(mode: str, loaded: bool) -> None:
    f = Fake()
    h = f.make(mode)
    h.measure()
    assert f.loads == 1 and len(f.probes) == 1
    assert h.loaded is loaded
    held = h.held()
    assert held["mode"] == mode and held["model"] is loaded and held["contexts"] == 0
    assert set(held["timings"]) == {"load_ms", "ctx_ms", "first_ms"} and held["timings"]["ctx_ms"] == 0
    assert f.reports == [held]  # one report, after the settling


def test_start_without_a_probe_loads_unless_on_demand() -> None:
    f = Fake()
    assert f.make("mmap").loaded is False  # nothing before start
    f.holder.start()  # type: ignore[union-attr]
    assert f.loads == 1 and f.probes == [] and f.holder.loaded  # type: ignore[union-attr]
    g = Fake()
    g.make("on_demand").start()
    assert g.loads == 0 and not g.holder.loaded  # type: ignore[union-attr]
    assert "first_ms" not in g.holder.held()["timings"]  # type: ignore[union-attr]


def test_on_demand_loads_at_the_first_request_and_keeps_the_model() -> None:
    f = Fake()
    h = f.make("on_demand")
    h.measure()
    assert f.loads == 1 and not h.loaded
    with h.use() as m1:
        assert h.loaded and f.loads == 2
    assert h.loaded  # kept after the request, as a chat engine keeps it
    with h.use() as m2:
        assert m2 is m1 and f.loads == 2  # no second load
    assert [r["model"] for r in f.reports] == [False, True]  # measured (dropped), then loaded by the request


def test_moving_to_on_demand_waits_for_the_requests_using_the_model() -> None:
    f = Fake()
    h = f.make("warm")
    h.start()
    entered, release = threading.Event(), threading.Event()

    def request() -> None:
        with h.use():
            entered.set()
            release.wait(5)

    t = threading.Thread(target=request)
    t.start()
    assert entered.wait(5)
    h.set_readiness("on_demand")
    assert h.loaded  # the request keeps its model
    release.set()
    t.join(5)
    assert not h.loaded  # dropped once the last request ended
    assert [(r["mode"], r["model"]) for r in f.reports] == [("warm", True), ("on_demand", True), ("on_demand", False)]
    # the next request loads it again (timed anew), and it stays
    with h.use():
        pass
    assert h.loaded and f.loads == 2


def test_moving_back_up_loads_now_and_a_pending_shed_is_forgotten() -> None:
    f = Fake()
    h = f.make("warm")
    h.start()
    with h.use():
        h.set_readiness("on_demand")  # asked while in use: would drop after it
        h.set_readiness("mmap")  # asked again before the request ended: keep it
    assert h.loaded and f.loads == 1
    h.set_readiness("on_demand")
    assert not h.loaded
    h.set_readiness("warm")
    assert h.loaded and f.loads == 2


def fails_once(message: str) -> tuple[Callable[[], Any], dict[str, int]]:
    """A load that raises ``message`` the first time and then loads; and its call count."""
    calls = {"n": 0}

    def load() -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(message)
        return object()

    return load, calls


def test_a_failed_load_leaves_nothing_held_and_the_next_use_tries_again() -> None:
    f = Fake()
    flaky, _ = fails_once("out of memory")
    h = ModelHolder(flaky, f.probe, readiness="on_demand")
    with pytest.raises(RuntimeError), h.use():
        pass
    assert not h.loaded and h.held()["model"] is False
    with h.use():
        assert h.loaded
    assert h._users == 0


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="readiness must be one of"):
        ModelHolder(object, lambda m: None, readiness="auto")
    h = ModelHolder(object, lambda m: None)
    with pytest.raises(ValueError, match="readiness must be one of"):
        h.set_readiness("hot")
    assert h.readiness == "warm"


def test_load_soon_is_one_load_for_every_caller_and_done_at_once_when_loaded() -> None:
    gate = threading.Event()
    f = Fake()

    def slow() -> Any:
        gate.wait(5)
        return f.load()

    h = ModelHolder(slow, f.probe, readiness="on_demand", on_change=f.changed)
    f.holder = h
    a, b = h.load_soon(), h.load_soon()
    assert a is b and not a.done()
    gate.set()
    a.result(5)
    assert h.loaded and f.loads == 1 and f.reports[-1]["model"] is True
    assert h.load_soon().done()  # loaded: nothing to wait for


def test_a_failed_load_soon_fails_its_waiters_and_the_next_one_tries_again() -> None:
    flaky, calls = fails_once("no memory")
    h = ModelHolder(flaky, lambda m: None, readiness="on_demand")
    with pytest.raises(RuntimeError, match="no memory"):
        h.load_soon().result(5)
    h.load_soon().result(5)
    assert h.loaded and calls["n"] == 2


def test_a_dropped_model_gives_its_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from spillover.engine import holder as holder_mod

    trims: list[int] = []
    monkeypatch.setattr(holder_mod, "release_memory", lambda: trims.append(1))
    f = Fake()
    h = f.make("warm")
    h.start()
    assert trims == []
    h.set_readiness("on_demand")
    assert not h.loaded and trims == [1]
    h.set_readiness("on_demand")  # nothing loaded: nothing to give back
    assert trims == [1]


def test_a_request_waiting_for_a_slow_load_answers_its_cancel_at_once() -> None:
    """The worker's wait for the model sees the cancel (the gateway kills a worker that does
    not end a cancelled request soon); the load goes on and the model is kept."""
    from spillover.engine.worker import UnaryWorker

    gate = threading.Event()
    h = ModelHolder(lambda: gate.wait(10) and object(), lambda m: None, readiness="on_demand")

    class Kind(UnaryWorker):  # only its wait for the model runs (no process, no channel)
        def load_model(self) -> Any: ...
        def probe(self, model: Any) -> None: ...
        def model_fingerprint(self) -> dict[str, str]:
            return {}

        def compute(self, model: Any, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
            raise AssertionError("a cancelled request must not run")

    w = object.__new__(Kind)
    w.keeper, w.cancelled = h, {"r1"}
    out = w._compute("r1", {})
    assert out["ev"] == "error" and out["kind"] == "cancelled"
    assert not h.loaded  # still loading
    gate.set()
    h.load_soon().result(5)
    assert h.loaded
