"""``Gateway.reserve_weights`` (a GPU worker's ``before_start``): while its load waits for room
on the device the worker says so (``waiting``, and ``waits_for_room``, which tells the host
guard not to count the worker's memory as coming back: round 43), and neither once it loads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from spillover.runtime.gateway import Gateway
from spillover.runtime.worker_client import WorkerClient, WorkerSpec


class _Ledger:
    """Room for the weights from the third try on."""

    def __init__(self) -> None:
        self.tries = 0
        self.held = False

    def holds(self, holder: str) -> bool:
        return self.held

    def reserve_nowait(self, holder: str, nbytes: int, now: float, *, kind: str) -> object | None:
        self.tries += 1
        self.held = self.tries >= 3
        return object() if self.held else None


def test_a_load_waiting_for_room_says_so_until_it_loads(monkeypatch: Any) -> None:
    import spillover.runtime.gateway as gateway_mod

    monkeypatch.setattr(gateway_mod, "LOAD_RECHECK_S", 0.0)
    w = WorkerClient(WorkerSpec("gpu0", "gpu", "sim:64", "", "", 1, 64, 1, 8), lambda _w, _g: None)
    seen: list[tuple[str | None, bool]] = []
    waits: list[bool] = []
    gw: Any = SimpleNamespace(ledger=_Ledger(), note_event=lambda wid, what: seen.append((w.waiting, w.waits_for_room)))
    asyncio.run(Gateway.reserve_weights(gw, w, nbytes=1024, on_wait=waits.append))
    assert seen == [("room on the device for its 1024 bytes of weights", True)]
    assert (w.waiting, w.waits_for_room) == (None, False) and waits == [True, False]
