"""A GPU worker's weights in the device ledger across its life (``Gateway.worker_event``):
reserved from its start, released when it dies with its room kept from other loads for its
restart, given up when it is parked, unloaded or a start fails."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from spillover.core.ledger import DeviceLedger
from spillover.runtime.events import SupervisorEvent, SupervisorEventKind
from spillover.runtime.gateway import Gateway
from spillover.runtime.supervisor import COMING_BACK_FAILED_STARTS
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024
K = SupervisorEventKind


def test_a_dead_workers_room_waits_for_its_restarts_and_a_park_gives_it_up() -> None:
    ledger = DeviceLedger("sim", 200 * MIB, 16 * MIB, freshness_s=1e9)
    gw = SimpleNamespace(ledger=ledger, note_event=lambda *a: None, kick_scheduler=lambda: None)
    gw.ran, gw.failed_starts = set(), {}
    w = ready_worker("split0", "split")
    w.spec = dataclasses.replace(w.spec, weights_bytes=66 * MIB)
    holder = w.spec.weights_holder

    def event(kind: SupervisorEventKind) -> None:
        Gateway.worker_event(gw, w, SupervisorEvent(kind))  # type: ignore[arg-type]

    event(K.STARTING)
    event(K.READY)
    ledger.observe(66 * MIB, 1e9)
    assert ledger.held_bytes(holder) == 66 * MIB
    event(K.DIED)  # a crash: released (its memory is coming back), its room kept for the restart
    assert not ledger.holds(holder) and ledger.kept_bytes() == 66 * MIB
    assert ledger.recently_released(1e9) == 66 * MIB
    ledger.observe(0, 1e9 + 1)
    assert ledger.reserve_nowait("whisper-gpu/weights", 120 * MIB, 1e9 + 1, kind="weights") is None
    event(K.STARTING)  # the restart takes its room back
    assert ledger.held_bytes(holder) == 66 * MIB and ledger.kept_bytes() == 0
    event(K.DIED)
    event(K.START_FAILED)  # killed again while it restarted: a worker that ran keeps its room
    assert not ledger.holds(holder) and ledger.kept_bytes() == 66 * MIB
    assert ledger.reserve_nowait("whisper-gpu/weights", 120 * MIB, 1e9 + 1, kind="weights") is None
    for _ in range(COMING_BACK_FAILED_STARTS - 1):  # ... until its model seems not to load any more
        assert ledger.kept_bytes() == 66 * MIB
        event(K.STARTING)
        event(K.DIED)  # its process dies as it loads
        event(K.START_FAILED)
    assert ledger.kept_bytes() == 0  # given up after COMING_BACK_FAILED_STARTS in a row
    event(K.STARTING)
    event(K.READY)  # it came back: the count starts again
    event(K.DIED)
    event(K.START_FAILED)
    assert ledger.kept_bytes() == 66 * MIB
    never = ready_worker("deci0", "gpu")
    never.spec = dataclasses.replace(never.spec, weights_bytes=30 * MIB)
    for kind in (K.STARTING, K.DIED, K.START_FAILED):  # a model that cannot load never ran: no room held
        Gateway.worker_event(gw, never, SupervisorEvent(kind))  # type: ignore[arg-type]
    assert ledger.kept_bytes() == 66 * MIB and not ledger.holds(never.spec.weights_holder)
    event(K.STARTING)
    event(K.READY)
    event(K.DIED)
    event(K.PARKED)  # parked as it died (a demotion's race): it will not restart
    assert not ledger.holds(holder) and ledger.kept_bytes() == 0
    event(K.STARTING)
    event(K.UNLOADED)  # unloaded: given back, nothing kept
    assert not ledger.holds(holder) and ledger.kept_bytes() == 0
