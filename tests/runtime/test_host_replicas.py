"""``HostMemory`` with an embeddings or transcription service's CPU replica (``add_replica``):
the guard counts its model only while the replica reports holding it, and a request may make
an unloaded replica load its model only when the room the guard leaves holds it."""

from __future__ import annotations

import pytest

from spillover.runtime.hostmem import CpuLaneHost, HostMemory
from spillover.runtime.readiness import ReplicaReadiness
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
