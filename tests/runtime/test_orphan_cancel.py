"""A DELETE of an orphan (unfinished at start, replayed by start-up recovery), or of a keyed
request that ended resumable, and its replay or resume take one lock: the DELETE either ends
it before the replay or resume begins or cancels the run it became, never neither."""

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


def test_a_delete_that_races_a_resume_with_its_key_cancels_the_resumed_run(tmp_path: Path, monkeypatch: Any) -> None:
    """Round 54a: a keyed request that ended resumable; its resend with the key began (live,
    journaled QUEUED) while the DELETE read its record: the DELETE found it neither resumable
    nor live, answered 200, and the resumed run completed."""

    async def main() -> None:
        j = Journal(tmp_path / "j.sqlite3", retention_s=3600.0, max_requests=100)
        await j.open()
        body = json.dumps({"endpoint": "chat", "body": {}})
        await j.accept(rid="r1", idem_key="k1", body_hash="h", kind="chat", stream=False, body=body, model="m",
                       queued={"attempts": 1})  # fmt: skip
        await j.move("r1", State.RESUMABLE_ERROR, error="client_disconnected")
        svc = RequestService(SimpleNamespace(journal=j, keys=KeyLocks()))  # type: ignore[arg-type]
        run = FakeRun()
        read = j.get

        async def get_as_the_resume_begins(rid: str) -> Any:
            got = await read(rid)
            if not svc.live:  # the resend with its key, as RequestService.submit makes it live
                async with svc.gw.keys.hold("k1"):
                    svc.live["r1"] = run  # type: ignore[assignment]
                    await j.move("r1", State.QUEUED, attempts=2, **requests_mod.RESUMED)
                got = await read(rid)
            return got

        monkeypatch.setattr(j, "get", get_as_the_resume_begins)
        try:
            await asyncio.wait_for(svc.cancel("r1"), 5)
            assert run.cancelled, "the DELETE was answered while the resumed run ran on"
        finally:
            await j.close()

    asyncio.run(main())


@pytest.fixture(autouse=True)
def _quick_cancel_wait(monkeypatch: Any) -> None:
    monkeypatch.setattr(requests_mod, "CANCEL_WAIT_S", 1.0)
