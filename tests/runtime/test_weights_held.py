"""A GPU worker's weights in the device ledger across its life (``Gateway.worker_event``):
reserved from its start, kept for its restart when it dies, given back when it is unloaded
or a start fails."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from spillover.core.ledger import DeviceLedger
from spillover.runtime.events import SupervisorEvent, SupervisorEventKind
from spillover.runtime.gateway import Gateway
from tests.runtime.fakes import ready_worker

MIB = 1024 * 1024
K = SupervisorEventKind


def test_a_dead_workers_weights_wait_for_its_restart_and_a_failed_start_gives_them_back() -> None:
    ledger = DeviceLedger("sim", 200 * MIB, 16 * MIB, freshness_s=1e9)
    gw = SimpleNamespace(ledger=ledger, note_event=lambda *a: None, kick_scheduler=lambda: None)
    w = ready_worker("split0", "split")
    w.spec = dataclasses.replace(w.spec, weights_bytes=66 * MIB)
    holder = w.spec.weights_holder

    def event(kind: SupervisorEventKind) -> None:
        Gateway.worker_event(gw, w, SupervisorEvent(kind))  # type: ignore[arg-type]

    event(K.STARTING)
    event(K.READY)
    ledger.observe(66 * MIB, 1e9)
    assert ledger.held_bytes(holder) == 66 * MIB and ledger.unconfirmed_bytes() == 0
    event(K.DIED)  # a crash: its supervisor restarts it into the same room
    ledger.observe(0, 1e9 + 1)
    assert ledger.held_bytes(holder) == 66 * MIB and ledger.unconfirmed_bytes() == 66 * MIB
    assert ledger.reserve_nowait("whisper-gpu/weights", 120 * MIB, 1e9 + 1) is None  # the room stays its own
    event(K.STARTING)  # the restart: the kept grant is its reservation
    assert ledger.held_bytes(holder) == 66 * MIB
    event(K.START_FAILED)  # a start that fails gives the room back
    assert not ledger.holds(holder)
    event(K.STARTING)
    event(K.READY)
    event(K.UNLOADED)  # parked (a demoted service): given back
    assert not ledger.holds(holder)
