"""``HostMemory`` with an embeddings or transcription service's CPU replica (``add_replica``):
the guard counts its model only while the replica reports holding it, and a request may make
an unloaded replica load its model only when the room the guard leaves holds it. A chat
replica's weights mapped from its file take none of the machine's available memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from spillover.runtime import readiness as readiness_mod
from spillover.runtime.hostmem import CpuLaneHost, HostMemory
from spillover.runtime.readiness import ReplicaReadiness
from spillover.runtime.supervisor import Supervisor
from spillover.runtime.worker_client import WorkerClient, WorkerSpec, WorkerState

W = 100  # the replica's model, bytes


def replica(model: bool, state: WorkerState = WorkerState.READY) -> WorkerClient:
    w = WorkerClient(WorkerSpec("emb-cpu", "cpu", "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
    w.state = state
    w._held({"mode": "on_demand", "model": model, "contexts": 0, "timings": {}})
    return w


def host(
    w: WorkerClient, *, observed: int, budget: int = 1000, available: int = 10**9
) -> tuple[HostMemory, CpuLaneHost]:
    h = HostMemory(lambda: [], budget_bytes=budget, min_free_bytes=0)
    h._proc.available = lambda: available  # type: ignore[method-assign]
    h.observed_bytes = h.base_bytes = observed
    r = ReplicaReadiness("on_demand", 1000.0, lambda: w, weights_bytes=W, context_bytes=0)
    return h, h.add_replica(lambda: w, weights_bytes=W, readiness=r)


@pytest.mark.parametrize(("observed", "allowed"), [(900, True), (901, False)])
def test_an_unloaded_replica_may_load_only_when_the_room_holds_its_model(observed: int, allowed: bool) -> None:
    w = replica(model=False)
    h, lane = host(w, observed=observed)
    assert h.replicas_bytes() == 0  # nothing held, nothing counted
    assert h.load_allowed(lane) is allowed


def test_the_machines_available_memory_bounds_the_load_too() -> None:
    w = replica(model=False)
    h, lane = host(w, observed=0, available=W - 1)
    assert h.load_allowed(lane) is False


def test_a_loaded_replica_is_counted_and_never_refused() -> None:
    w = replica(model=True)
    h, lane = host(w, observed=990)
    assert h.replicas_bytes() == W
    assert h.load_allowed(lane) is True


def test_a_replica_that_is_not_ready_is_left_to_placement() -> None:
    w = replica(model=False, state=WorkerState.STARTING)
    h, lane = host(w, observed=999)
    assert h.load_allowed(lane) is True


def test_the_primary_chat_lane_not_a_service_replica_gives_the_slot_bytes() -> None:
    w = replica(model=False)
    h, _ = host(w, observed=0)
    assert h.slot_bytes == 0  # only a service replica registered: no chat lane
    h.lane_view(lambda: None, weights_bytes=50, context_bytes=7)
    assert h.slot_bytes == 57


def _auto_replicas(room: int, models: dict[str, int]) -> tuple[HostMemory, dict[str, WorkerClient], list]:
    """Auto replicas (measured: on_demand misses a 1 ms budget, so each wants warm) on a host
    with ``room`` bytes left under its budget; ``asked`` collects the moves asked of them."""
    asked: list[tuple[str, str]] = []
    h = HostMemory(lambda: [], budget_bytes=1000, min_free_bytes=0)
    h._proc.available = lambda: 10**9  # type: ignore[method-assign]
    h.observed_bytes = h.base_bytes = 1000 - room
    workers = {}
    for name, size in models.items():
        w = WorkerClient(WorkerSpec(name, "cpu", "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
        w.state = WorkerState.READY
        w._held({"mode": "on_demand", "model": False, "contexts": 0, "timings": {"load_ms": 100, "first_ms": 50}})

        async def set_readiness(mode: str, name: str = name) -> None:
            asked.append((name, mode))

        w.set_readiness = set_readiness  # type: ignore[method-assign]
        r = ReplicaReadiness("auto", 1.0, lambda w=w: w, weights_bytes=size, context_bytes=0)
        h.add_replica(lambda w=w: w, weights_bytes=size, readiness=r)
        workers[name] = w
    return h, workers, asked


def test_two_replicas_never_spend_the_same_room() -> None:
    """Room for either model but not both: one tick asks one replica to load, and until it
    reports (and after), the other sees the room that load takes. Before, both were asked in
    the same tick, the guard then counted 150 bytes in 100, and both stepped down and up
    again on every reading."""
    h, workers, asked = _auto_replicas(100, {"emb-cpu": 60, "whisper-cpu": 80})
    asyncio.run(h.tick_readiness())
    assert asked == [("emb-cpu", "warm")]
    asyncio.run(h.tick_readiness())  # the load is under way: nothing more
    assert asked == [("emb-cpu", "warm")]
    workers["emb-cpu"]._held({"mode": "warm", "model": True, "contexts": 0, "timings": {"load_ms": 100}})
    h.observed_bytes += 60
    for _ in range(3):  # it loaded: no step down, and the other still does not fit
        asyncio.run(h.tick_readiness())
    assert asked == [("emb-cpu", "warm")]
    assert h.replicas_bytes() == 60


def test_a_replica_without_contexts_moves_up_with_a_tenth_of_its_model_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hysteresis for a replica whose contexts cost nothing: exactly its model's room is not
    enough to load (the next reading's noise would unload it again); a tenth more is, once it
    has lasted ``UP_HOLD_S`` (a room that came back a moment ago may go again)."""
    now = [1000.0]
    monkeypatch.setattr(readiness_mod.time, "monotonic", lambda: now[0])
    h, _, asked = _auto_replicas(100, {"emb-cpu": 100})
    asyncio.run(h.tick_readiness())
    assert asked == []
    h.observed_bytes = h.base_bytes = 890
    asyncio.run(h.tick_readiness())
    assert asked == []  # the room is there, but only just came back
    now[0] += readiness_mod.UP_HOLD_S
    asyncio.run(h.tick_readiness())
    assert asked == [("emb-cpu", "warm")]


def test_a_chat_replicas_mapped_weights_leave_its_room_on_the_machine_as_it_was() -> None:
    """A chat replica of 100 bytes of weights, 80 of them mapped from the file, and two 30-byte
    contexts, held warm. Dropping it all frees the contexts and the 20 repacked bytes to the
    machine, not the mapped 80 (page cache the machine counts as available already): with the
    machine's available memory as it was, its room falls by what it dropped less the mapped
    part, not by all of it (it fell by all 160 before, so a step down left it short of room
    for memory that was never taken)."""
    w = WorkerClient(WorkerSpec("chat-cpu", "cpu", "cpu", "", "", 2, 512, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    w._held({"mode": "warm", "model": True, "contexts": 2, "timings": {}})
    h = HostMemory(lambda: [], budget_bytes=10**6, min_free_bytes=1000)
    h._proc.available = lambda: 1200  # type: ignore[method-assign]
    h.observed_bytes = h.base_bytes = 0
    lane = CpuLaneHost(lambda: None, W, 30, None, replica=lambda: w, mapped_bytes=80)  # its worker, as its scheduler's
    h.lanes.append(lane)
    assert h.room_bytes(lane) == 1200 + 160 - 1000  # it holds 160, none of it counted twice
    w._held({"mode": "on_demand", "model": False, "contexts": 0, "timings": {}})
    assert h.room_bytes(lane) == 1200 + 80 - 1000  # the mapped 80 still never taken from the machine
    view = h._view(lane, 0)
    assert (view.slot_bytes, view.mapped_bytes) == (W + 30, 80)  # a first context: 50 of it from available


def test_the_status_and_ollama_show_a_replica_as_the_guard_counts_it() -> None:
    """A failover claims a slot of an ``on_demand`` chat replica: until the worker's next
    report (after the whole model load) the guard counts its model and the context the request
    opens, and so do ``/v1/status``'s ``host_bytes`` and ``/api/ps`` (a reviewer's case: they
    said 0 from the reports alone while the guard counted 130)."""
    w = WorkerClient(WorkerSpec("chat-cpu", "cpu", "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
    w.state = WorkerState.READY
    w._held({"mode": "on_demand", "model": False, "contexts": 0, "timings": {}})
    sched = SimpleNamespace(cpu_workers=[w], running=0)
    sched.peak_running = lambda worker: sched.running
    h = HostMemory(lambda: [], budget_bytes=10**6, min_free_bytes=0)
    r = ReplicaReadiness("on_demand", 1000.0, lambda: w, weights_bytes=W, context_bytes=30)
    h.lane_view(lambda: sched, weights_bytes=W, context_bytes=30, readiness=r)  # type: ignore[arg-type,return-value]
    assert r.status()["host_bytes"] == 0 == h.replicas_bytes()  # nothing held
    sched.running = 1  # the failover's request runs: its load and its context
    assert r.status()["host_bytes"] == W + 30 == h.replicas_bytes()
    assert r.host_bytes(w) == W + 30


def _whisper_at_the_edge(
    monkeypatch: pytest.MonkeyPatch, now: list[float]
) -> tuple[HostMemory, WorkerClient, CpuLaneHost, list[tuple[str, str]]]:
    """An auto replica (pid 7) of a ``W``-byte model with 150 bytes of room, on a clock at ``now``."""
    monkeypatch.setattr(readiness_mod.time, "monotonic", lambda: now[0])
    h, workers, asked = _auto_replicas(150, {"whisper-cpu": W})
    w = workers["whisper-cpu"]
    w._proc = SimpleNamespace(pid=7)  # type: ignore[assignment]
    return h, w, h.lanes[0], asked


def test_a_replica_holding_more_than_its_count_does_not_flap_at_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 35: whisper's CPU replica (auto, a budget no mode meets: it wants warm) on a host
    with room for its model but not for what its process really holds loaded (the model and
    its decoding buffers, past the count): it loaded, the next reading found it short, it
    dropped the model, the room came back and it loaded again, four moves in 0.8 s. The
    reading shows what it held past its count; a move up needs that much more room: one drop,
    then it stays, and it loads again only where that room is (and has lasted ``UP_HOLD_S``),
    and keeps it."""
    now = [1000.0]
    h, w, lane, asked = _whisper_at_the_edge(monkeypatch, now)

    def reading(observed: int, own: int, *, model: bool | None = None) -> None:
        if model is not None:
            w._held({"mode": "warm" if model else "on_demand", "model": model, "contexts": 0, "timings": {}})
        h.observed_bytes = observed
        h.base_bytes = min(h.base_bytes, observed)  # the rest of the host as read with nothing held
        h.measure({7: own})
        asyncio.run(h.tick_readiness())
        now[0] += readiness_mod.UP_HOLD_S  # each reading the room as it lasted

    reading(850, 20)  # holding nothing: its process alone
    assert asked == [("whisper-cpu", "warm")]  # 150 of room: the model's 100 and a tenth to spare
    reading(850 + 160, 180, model=True)  # loaded: 60 more than its model, which the reading shows
    assert asked[-1] == ("whisper-cpu", "on_demand") and h.extra_bytes(lane) == 0  # it holds all of it now
    for _ in range(3):  # dropped: the room is back, but not the 165 a move up now needs
        reading(850, 25, model=False)
    assert asked == [("whisper-cpu", "warm"), ("whisper-cpu", "on_demand")]
    # 60 past its count, 5 of which it still holds (its allocators kept them: in the reading)
    assert h.extra_bytes(lane) == 55
    assert lane.readiness is not None and lane.readiness.status()["extra_bytes"] == 55
    reading(800, 20)  # 200 of room: it loads, and with all it holds it stays
    assert asked[-1] == ("whisper-cpu", "warm")
    for _ in range(3):
        reading(800 + 160, 180, model=True)
    assert asked[-1] == ("whisper-cpu", "warm") and len(asked) == 3


def test_a_move_up_under_way_is_not_undone_by_the_room_its_own_load_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 35's review: while a replica loads the model it was asked to hold, the host reading
    already shows the part loaded, and its report (what the guard counts as its own) has not
    come: the room looked short by the load itself, a step down was asked half way, and the
    replica loaded, dropped and loaded again every few seconds. Its asked mode counts as its
    own until it reports; then as it holds. Its process alone is not read while it loads."""
    now = [1000.0]
    h, w, lane, asked = _whisper_at_the_edge(monkeypatch, now)
    h.measure({7: 20})
    asyncio.run(h.tick_readiness())
    assert asked == [("whisper-cpu", "warm")]
    for part in (30, 70, 100):  # the load under way, not reported yet
        h.observed_bytes = 850 + part
        h.measure({7: 20 + part})
        now[0] += 0.2
        asyncio.run(h.tick_readiness())
    assert asked == [("whisper-cpu", "warm")]  # not undone
    assert h._measured[id(lane)].bare_bytes == 20  # the loading process was not taken for bare
    w._held({"mode": "warm", "model": True, "contexts": 0, "timings": {}})
    h.measure({7: 120})
    asyncio.run(h.tick_readiness())
    assert asked == [("whisper-cpu", "warm")] and h.room_bytes(lane) == 150


class _StandIn(SimpleNamespace):
    """A supervisor as the host guard reads it: its ``restarting`` and ``failed_starts`` set by
    the test, its ``coming_back`` the supervisor's own rule."""

    coming_back = Supervisor.coming_back


def _gpu_worker_beside_an_auto_replica(
    monkeypatch: pytest.MonkeyPatch, available: list[int]
) -> tuple[HostMemory, WorkerClient, CpuLaneHost, _StandIn, list[tuple[str, str]], Callable[..., None]]:
    """An auto replica of a 60-byte model (it wants warm: 66 with its step) on a machine with
    ``available[0]`` bytes available (the budget is no limit), beside a GPU worker (pid 9, a
    stand-in supervisor); and ``reading(rss, anon)``, one host reading and tick, each lasting
    ``UP_HOLD_S`` (a slow restart)."""
    now = [1000.0]
    monkeypatch.setattr(readiness_mod.time, "monotonic", lambda: now[0])
    h, workers, asked = _auto_replicas(1000, {"emb-cpu": 60})
    h._proc.available = lambda: available[0]  # type: ignore[method-assign]
    gpu = _StandIn(
        worker=SimpleNamespace(state=WorkerState.READY, pid=9, waits_for_room=False), restarting=False, failed_starts=0
    )
    h.supervisors = lambda: [gpu]  # type: ignore[assignment,return-value]

    def reading(rss: dict[int, int], anon: dict[int, int] | None = None) -> None:
        h.observe(sum(rss.values()), rss, [gpu], anon)  # type: ignore[list-item]
        asyncio.run(h.tick_readiness())
        now[0] += readiness_mod.UP_HOLD_S

    return h, workers["emb-cpu"], h.lanes[0], gpu, asked, reading


@pytest.mark.parametrize("failed_starts", [0, 1, 2, 3])
def test_a_restarting_workers_memory_is_not_room_for_an_idle_move_up(
    monkeypatch: pytest.MonkeyPatch, failed_starts: int
) -> None:
    """Round 38: a GPU worker's death frees its memory in the host reading until its restart
    loads again; the chat replica at ``host_short`` took that room, loaded its model and
    dropped it once the worker was back, once a crash. What the worker held when last up is a
    move up's margin while it restarts (the part its new process has not taken yet), unless
    its last three starts failed (it may never take it again; round 42: one start killed
    mid-load turned the margin off). A request's own load (``load_allowed``)
    is not held back by it, and a model so loaded is kept: a step down is judged on the room
    as read (round 40a: it was shed at the next reading)."""
    available = [50]  # short of the model's 60 and its step
    h, w, lane, gpu, asked, reading = _gpu_worker_beside_an_auto_replica(monkeypatch, available)
    reading({9: 100})
    reading({9: 0})  # killed: its memory is gone before its pipe closes and it leaves READY (round 44)
    gpu.worker.state, gpu.restarting = WorkerState.DEAD, True  # its 100 are free
    gpu.failed_starts = failed_starts
    start_failed = failed_starts >= 3
    available[0] = 150
    reading({})
    assert h.returning_bytes(lane) == ((0, 0) if start_failed else (100, 100))
    gpu.worker.state, gpu.worker.pid = WorkerState.STARTING, 10
    available[0] = 110
    reading({10: 40})  # loading again: 40 of its 100 taken
    assert h.returning_bytes(lane) == ((0, 0) if start_failed else (60, 60))
    gpu.worker.waits_for_room = True  # its start waits for room on the device: for how long, nobody knows
    assert h.returning_bytes(lane) == (0, 0)
    gpu.worker.waits_for_room = False
    if start_failed:
        assert asked == [("emb-cpu", "warm")]
        return
    assert asked == []  # no idle load on memory the worker takes again
    assert h.load_allowed(lane) is True  # a failover's request may load it meanwhile
    w._held({"mode": "on_demand", "model": True, "contexts": 0, "timings": {}})
    available[0] = 50
    reading({10: 40, 11: 60})
    assert asked == []  # and it is kept, not shed for the room the worker takes again
    gpu.worker.state, gpu.restarting = WorkerState.READY, False
    reading({10: 100, 11: 60})
    assert h.returning_bytes(lane) == (0, 0)


def test_a_restarting_workers_mapped_pages_are_not_counted_on_the_machines_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of a restarting worker's RSS, only the anonymous part is taken from the machine's
    available memory again (its pages mapped from the model file stay in the page cache,
    which ``MemAvailable`` counted all along; round 40a: the whole RSS was, so a move up that
    fits with the worker back was held off). Here the worker held 100, 80 of it mapped; while
    it restarts, something else frees 30: the replica may move up (110 available, 20 of them
    the worker's: 90 left for its 66)."""
    available = [60]
    h, _, lane, gpu, asked, reading = _gpu_worker_beside_an_auto_replica(monkeypatch, available)
    reading({9: 100}, {9: 20})
    gpu.worker.state, gpu.restarting = WorkerState.DEAD, True
    available[0] = 60 + 20 + 30
    reading({}, {})
    assert h.returning_bytes(lane) == (100, 20)
    assert asked == [("emb-cpu", "warm")]
