"""Start-up recovery's end is known (``Gateway.recovery_ended``) however it ends: what it
could not handle is not shown as still ``recovering`` (round 40a: after a journal error the
orphans stayed ``recovering: true`` until the next start, with nothing pending)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.runtime import gateway as gateway_mod
from spillover.runtime.gateway import Gateway


def _gw() -> Any:
    return SimpleNamespace(
        cfg=SimpleNamespace(supervisor=SimpleNamespace(load_timeout_s=1.0)),
        _ready_to_replay=lambda: True,
        loops=SimpleNamespace(spawn=lambda name, coro: None),
        recovered={},
        recovery_ended=False,
    )


@pytest.mark.parametrize("fails", [False, True])
def test_recovery_ends_whether_it_handled_every_orphan_or_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fails: bool
) -> None:
    seen: list[bool] = []

    async def recover(gw: Any, orphans: list[Any], spawn: Any) -> dict[str, int]:
        seen.append(gw.recovery_ended)  # not ended while it runs
        if fails:
            raise OSError("disk I/O error")
        return {"replayed": 1, "ended": 0, "failed": 0}

    monkeypatch.setattr(gateway_mod, "recover", recover)
    gw = _gw()
    with caplog.at_level(logging.ERROR):
        asyncio.run(Gateway._recover(gw, []))
    assert seen == [False] and gw.recovery_ended is True
    assert gw.recovered == ({} if fails else {"replayed": 1, "ended": 0, "failed": 0})
    assert ("start-up recovery failed" in caplog.text) is fails
