"""A DELETE of an orphan (unfinished at start, replayed by start-up recovery) and its replay
take one lock: the DELETE either ends it before the replay begins or cancels the replayed run,
never neither."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.core.lifecycle import State
from spillover.runtime import requests as requests_mod
from spillover.runtime.journal import Journal
from spillover.runtime.keylocks import KeyLocks
from spillover.runtime.requests import RequestService


class FakeRun:
    def __init__(self) -> None:
        self.cancelled = False
        self.ended = asyncio.Event()

    def cancel(self, *, by_user: bool = True) -> None:
        self.cancelled = by_user
        self.ended.set()

    async def reply(self) -> None:
        await self.ended.wait()


async def _service(tmp_path: Path) -> tuple[Journal, RequestService]:
    j = Journal(tmp_path / "j.sqlite3", retention_s=3600.0, max_requests=100)
    await j.open()
    body = json.dumps({"endpoint": "chat", "body": {}})
    await j.accept(rid="r1", idem_key=None, body_hash="h", kind="chat", stream=False, body=body, model="m",
                   queued={"attempts": 1})  # fmt: skip
    svc = RequestService(SimpleNamespace(journal=j, keys=KeyLocks()))  # type: ignore[arg-type]
    svc.endpoints["chat"] = SimpleNamespace(parse=lambda body: SimpleNamespace(seed=1))  # type: ignore[assignment]
    svc.orphans = {"r1"}
    return j, svc


def test_a_delete_while_the_replay_prepares_cancels_the_replayed_run(tmp_path: Path, monkeypatch: Any) -> None:
    """The DELETE came while the replay tokenized (``prepare``): it saw the orphan neither
    live nor waiting, answered 200 with the stale state, and the replay ran it after."""

    async def main() -> None:
        j, svc = await _service(tmp_path)
        gate, entered = asyncio.Event(), asyncio.Event()
        run = FakeRun()

        async def slow_prepare(gw: Any, req: Any, rid: str) -> Any:
            entered.set()
            await gate.wait()
            return SimpleNamespace(rid=rid)

        async def begin(ep: Any, prep: Any, **kw: Any) -> FakeRun:
            svc.live["r1"] = run  # type: ignore[assert-type,assignment]
            return run

        monkeypatch.setattr(requests_mod, "prepare", slow_prepare)
        monkeypatch.setattr(svc, "_begin", begin)
        try:
            replay = asyncio.create_task(svc.replay(await j.get("r1")))  # type: ignore[arg-type]
            await entered.wait()
            delete = asyncio.create_task(svc.cancel("r1"))
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.wait_for(delete, 5)
            await asyncio.wait_for(replay, 5)
            assert run.cancelled  # the DELETE reached the run it became
        finally:
            await j.close()

    asyncio.run(main())


def test_a_delete_before_the_replay_ends_the_orphan_and_nothing_runs(tmp_path: Path, monkeypatch: Any) -> None:
    async def main() -> None:
        j, svc = await _service(tmp_path)

        async def never(*a: Any, **kw: Any) -> Any:
            raise AssertionError("a cancelled orphan must not be prepared")

        monkeypatch.setattr(requests_mod, "prepare", never)
        try:
            await svc.cancel("r1")
            rec = await j.get("r1")
            assert rec is not None and rec.state is State.CANCELLED and "r1" not in svc.orphans
            await svc.replay(rec)  # its replay, spawned before the DELETE, runs nothing
            assert not svc.live
        finally:
            await j.close()

    asyncio.run(main())


@pytest.fixture(autouse=True)
def _quick_cancel_wait(monkeypatch: Any) -> None:
    monkeypatch.setattr(requests_mod, "CANCEL_WAIT_S", 1.0)
