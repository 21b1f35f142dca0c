"""Tokens the client does not see one by one travel in fewer channel messages.

Worker side (``engine.worker.TokenBatch``): with a window the first token goes at once, later
plain tokens are joined into one event (texts in order, the last id), tokens with logprobs
stay events of their own, and what waits goes in one write, at the window or at ``flush``.
Gateway side (``Execution._msg``): a stream's tokens are never held (window 0); a
non-incremental answer's window is COALESCE_S, and never more than a quarter of the
attempt's stall bound. Fast tier: no model."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.config import FailoverConfig
from spillover.engine.worker import Channel, TokenBatch
from spillover.runtime.executor import COALESCE_S, Execution, RetryBudget


class Writes:
    """A text stream that records each write (a flush is a no-op)."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass

    def messages(self, i: int) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.writes[i].splitlines()]


def tok(i: int, text: str, lp: bool = False) -> dict[str, Any]:
    ev: dict[str, Any] = {"ev": "token", "rid": "r", "id": i, "text": text}
    if lp:
        ev["lp"] = [-0.5, list(text.encode()), []]
    return ev


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the worker module's clock
    return now


def test_without_a_window_every_token_is_its_own_write(clock: list[float]) -> None:
    out = Writes()
    batch = TokenBatch(Channel(out), 0.0)  # type: ignore[arg-type]
    for i, t in enumerate(["a", "b", "c"]):
        batch.add(tok(i, t))
    batch.flush()
    assert [out.messages(i) for i in range(3)] == [[tok(0, "a")], [tok(1, "b")], [tok(2, "c")]]


def test_the_first_token_goes_at_once_and_the_rest_wait_for_the_window(clock: list[float]) -> None:
    out = Writes()
    batch = TokenBatch(Channel(out), 0.1)  # type: ignore[arg-type]
    batch.add(tok(1, "He"))
    assert out.messages(0) == [tok(1, "He")]  # the first token: its time is the first-token time
    batch.add(tok(2, "llo"))
    clock[0] += 0.05
    batch.add(tok(3, ","))
    assert len(out.writes) == 1  # within the window: held
    clock[0] += 0.06  # 0.11 s since the oldest held one
    batch.add(tok(4, " world"))
    assert out.messages(1) == [tok(4, "llo, world")]  # joined in order, the last id
    batch.add(tok(5, "!"))
    batch.flush()
    assert out.messages(2) == [tok(5, "!")]
    batch.flush()  # nothing waits: no write
    assert len(out.writes) == 3


def test_tokens_with_logprobs_keep_their_own_events_in_one_write(clock: list[float]) -> None:
    out = Writes()
    batch = TokenBatch(Channel(out), 10.0)  # type: ignore[arg-type]
    batch.add(tok(1, "a", lp=True))
    batch.add(tok(2, "b", lp=True))
    batch.add(tok(3, "c"))
    batch.add(tok(4, "d"))
    batch.add(tok(5, "e", lp=True))
    batch.flush()
    assert len(out.writes) == 2
    assert out.messages(1) == [tok(2, "b", lp=True), tok(4, "cd"), tok(5, "e", lp=True)]


def execution(incremental: bool, stall_s: float) -> Execution:
    return Execution(
        rid="r1",
        tokens=[1, 2, 3],
        max_tokens=50,
        params={"temperature": 0.0},
        incremental=incremental,
        allow_shrink=False,
        scheduler=None,  # type: ignore[arg-type]
        journal=None,
        failover=FailoverConfig(stall_timeout_s=stall_s),
        budget=RetryBudget(10),
        kill_worker=lambda w: None,
    )


def dispatch(route: str) -> Any:
    return SimpleNamespace(route=route, max_tokens=50, kv_tokens=64, reserve_bytes=0)


@pytest.mark.parametrize("route", ["gpu", "cpu"])
def test_a_stream_is_never_held_and_a_whole_answer_is_held_within_the_stall_bound(route: str) -> None:
    assert execution(True, 15.0)._msg(dispatch(route))["coalesce_s"] == 0.0
    assert execution(False, 15.0)._msg(dispatch(route))["coalesce_s"] == COALESCE_S
    short = execution(False, 0.2)._msg(dispatch(route))["coalesce_s"]
    assert 0 < short <= (0.2 if route == "gpu" else 0.8) / 4
