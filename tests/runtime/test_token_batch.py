"""Tokens travel in fewer channel messages (and a stream's in fewer stream events).

Worker side (``engine.worker.TokenBatch``): with a window the first token goes at once, later
plain tokens are joined into one event (texts in order, the last id, every id in ``ids``),
tokens with logprobs stay events of their own, and what waits goes in one write, at the
window or at ``flush``. Gateway side (``Execution._msg``): a stream's window is its
``stream_coalesce_s`` (``[server].stream_coalesce_ms``; 0 holds nothing); a non-incremental
answer's is COALESCE_S; neither is ever more than a quarter of the attempt's stall bound,
``_next`` waits two windows past the stall bound, and a stream's delivered tokens are every
id an event carries. Fast tier: no model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.config import FailoverConfig
from spillover.engine.worker import Channel, TokenBatch
from spillover.runtime.events import Token
from spillover.runtime.executor import COALESCE_S, Execution, RetryBudget, _Failure


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


def tok(i: int, text: str, lp: bool = False, ids: list[int] | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {"ev": "token", "rid": "r", "id": i, "text": text}
    if lp:
        ev["lp"] = [-0.5, list(text.encode()), []]
    if ids is not None:
        ev["ids"] = ids
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
    assert out.messages(1) == [tok(4, "llo, world", ids=[2, 3, 4])]  # joined in order, the last id, every id
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
    assert out.messages(1) == [tok(2, "b", lp=True), tok(4, "cd", ids=[3, 4]), tok(5, "e", lp=True)]


def test_a_token_after_a_slow_gap_goes_at_once_with_what_waits(clock: list[float]) -> None:
    out = Writes()
    batch = TokenBatch(Channel(out), 0.1)  # type: ignore[arg-type]
    batch.add(tok(1, "a"))
    clock[0] += 0.3
    batch.add(tok(2, "b"))  # 0.3 s after the one before: nothing is gained by holding it
    assert out.messages(1) == [tok(2, "b")]
    clock[0] += 0.01
    batch.add(tok(3, "c"))  # fast again: held
    clock[0] += 0.5
    batch.add(tok(4, "d"))  # slow: sent at once, after the one that waited
    assert len(out.writes) == 3 and out.messages(2) == [tok(4, "cd", ids=[3, 4])]


def test_text_released_at_the_end_joins_without_a_token_of_its_own(clock: list[float]) -> None:
    """An event with id -1 (text the engine held back, released at the end) adds its text,
    not an id: the joined event's id stays the last real token's."""
    out = Writes()
    batch = TokenBatch(Channel(out), 0.1)  # type: ignore[arg-type]
    batch.add(tok(1, "a"))
    batch.add(tok(2, "b"))
    batch.add(tok(-1, "c"))
    batch.flush()
    assert out.messages(1) == [tok(2, "bc", ids=[2])]
    out2 = Writes()
    batch = TokenBatch(Channel(out2), 0.1)  # type: ignore[arg-type]
    batch.add(tok(1, "a"))
    batch.add(tok(-1, "x"))
    batch.add(tok(3, "y"))
    batch.flush()
    assert out2.messages(1) == [tok(3, "xy", ids=[3])]


def rtok(rid: str, i: int, text: str, ids: list[int] | None = None) -> dict[str, Any]:
    return {**tok(i, text, ids=ids), "rid": rid}


def test_a_write_takes_every_requests_waiting_tokens_along(clock: list[float]) -> None:
    """Two requests on one worker: a write for either (a token due, a first token, a request's
    last event) carries what waits in the other, written first, so the gateway wakes once for
    both; the other's next token then starts a window of its own."""
    out = Writes()
    chan = Channel(out)  # type: ignore[arg-type]
    a, b = TokenBatch(chan, 0.1), TokenBatch(chan, 0.1)
    a.add(rtok("a", 1, "x"))
    b.add(rtok("b", 1, "p"))
    assert len(out.writes) == 2  # each first token at once
    a.add(rtok("a", 2, "y"))
    clock[0] += 0.04
    b.add(rtok("b", 2, "q"))
    clock[0] += 0.07  # a's window is over, b's is not
    a.add(rtok("a", 3, "z"))
    assert out.messages(2) == [rtok("a", 3, "yz", ids=[2, 3]), rtok("b", 2, "q")]
    clock[0] += 0.01
    b.add(rtok("b", 3, "r"))  # a new window from here
    clock[0] += 0.09
    b.add(rtok("b", 4, "s"))
    assert len(out.writes) == 3  # 0.09 s: still held
    chan.send({"ev": "done", "rid": "a"})  # a's last event takes b's tokens along, before it
    assert out.messages(3) == [rtok("b", 4, "rs", ids=[3, 4]), {"ev": "done", "rid": "a"}]
    b.flush()  # nothing waits: no write
    assert len(out.writes) == 4


@settings(max_examples=60, deadline=None)
@given(
    windows=st.lists(st.sampled_from([0.0, 0.02, 0.1]), min_size=2, max_size=4),
    tokens=st.integers(min_value=1, max_value=40),
)
def test_requests_on_many_threads_keep_their_own_order_and_end_after_their_tokens(
    windows: list[float], tokens: int
) -> None:
    """Slot threads adding at once, each ending with its batch's flush and a last event: every
    request's tokens arrive whole, once, in order, and before its last event."""
    out = Writes()
    chan = Channel(out)  # type: ignore[arg-type]

    def slot(k: int, window: float) -> None:
        batch = TokenBatch(chan, window)
        for i in range(tokens):
            batch.add(rtok(f"r{k}", i, f"<{i}>"))
            if i % 7 == 0:
                time.sleep(0.001)
        batch.flush()
        chan.send({"ev": "done", "rid": f"r{k}"})

    threads = [threading.Thread(target=slot, args=(k, w)) for k, w in enumerate(windows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    messages = [m for i in range(len(out.writes)) for m in out.messages(i)]
    for k in range(len(windows)):
        mine = [m for m in messages if m["rid"] == f"r{k}"]
        assert mine[-1] == {"ev": "done", "rid": f"r{k}"}
        events = [Token(m["id"], m["text"], ids=tuple(m.get("ids", ()))) for m in mine[:-1]]
        assert "".join(e.text for e in events) == "".join(f"<{i}>" for i in range(tokens))
        assert [t for e in events for t in e.token_ids] == list(range(tokens))


@settings(max_examples=300, deadline=None)
@given(
    window=st.sampled_from([0.02, 0.1, 0.5]),
    gaps=st.lists(st.floats(min_value=0.0, max_value=1.5), min_size=1, max_size=60),
)
def test_the_gateway_never_waits_much_longer_than_the_engine(window: float, gaps: list[float]) -> None:
    """Whatever the engine's pace: the written texts, joined, are the tokens' texts in order;
    the first token is written as it comes; and between two writes the gateway waits at most
    the engine's own longest gap between the tokens they carry plus twice the window (the
    gateway's window is at most a quarter of its stall bound, so a stall is never made)."""
    now = [0.0]
    out = Writes()
    written_at: list[float] = []  # per write, when it happened
    real_write = out.write

    def write(text: str) -> None:
        written_at.append(now[0])
        real_write(text)

    out.write = write  # type: ignore[method-assign]
    arrivals = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "monotonic", lambda: now[0])
        batch = TokenBatch(Channel(out), window)  # type: ignore[arg-type]
        for i, gap in enumerate(gaps):
            now[0] += gap
            arrivals.append(now[0])
            batch.add(tok(i, f"<{i}>"))
        batch.flush()  # the generation ends right after its last token
    messages = [m for i in range(len(out.writes)) for m in out.messages(i)]
    events = [Token(m["id"], m["text"], ids=tuple(m.get("ids", ()))) for m in messages]
    assert "".join(e.text for e in events) == "".join(f"<{i}>" for i in range(len(gaps)))
    assert [t for e in events for t in e.token_ids] == list(range(len(gaps)))  # every id, once, in order
    assert written_at[0] == arrivals[0]
    for k in range(1, len(written_at)):
        carried = [i for i in range(1, len(gaps)) if written_at[k - 1] < arrivals[i] <= written_at[k]]
        longest = max((gaps[i] for i in carried), default=0.0)
        assert written_at[k] - written_at[k - 1] <= longest + 2 * window + 1e-9, (k, written_at, arrivals)


def execution(incremental: bool, stall_s: float, stream_window_s: float = 0.0) -> Execution:
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
        stream_coalesce_s=stream_window_s,
    )


def dispatch(route: str) -> Any:
    return SimpleNamespace(route=route, max_tokens=50, kv_tokens=64, reserve_bytes=0)


@pytest.mark.parametrize("route", ["gpu", "cpu"])
def test_a_stream_is_held_its_own_window_and_a_whole_answer_coalesce_s_within_the_stall_bound(route: str) -> None:
    assert execution(True, 15.0)._msg(dispatch(route))["coalesce_s"] == 0.0  # window 0: never held
    assert execution(True, 15.0, 0.02)._msg(dispatch(route))["coalesce_s"] == 0.02
    assert execution(False, 15.0, 0.02)._msg(dispatch(route))["coalesce_s"] == COALESCE_S
    for incremental in (True, False):
        short = execution(incremental, 0.2, 0.5)._msg(dispatch(route))["coalesce_s"]
        assert 0 < short <= (0.2 if route == "gpu" else 0.8) / 4


@pytest.mark.parametrize(("incremental", "stream_window_s"), [(True, 0.0), (True, 0.05), (False, 0.0)])
def test_a_held_token_is_not_a_stall_but_a_real_one_still_is(incremental: bool, stream_window_s: float) -> None:
    """A gap of the stall bound plus one window: a stall for a stream whose tokens are never
    held (window 0), not for a request whose tokens the worker may hold (it waits two windows
    more); a gap of the bound plus three windows is a stall for all."""
    stall_s = 0.4
    held = not incremental or stream_window_s > 0
    window = min(COALESCE_S if not incremental else stream_window_s or COALESCE_S, stall_s / 4)

    async def late_token(after_s: float) -> Any:
        await asyncio.sleep(after_s)
        yield Token(7, "x")

    async def next_after(after_s: float) -> Any:
        exe = execution(incremental, stall_s, stream_window_s)
        d = dispatch("gpu")
        return await exe._next(late_token(after_s), d, exe._stall_s(d, prefill=False))

    if held:
        # The token is due one window before the extended bound. A loaded machine that pauses
        # the loop past that bound fires both timers in one turn: the stall wins, late (not at
        # the unextended bound, as a held token taken for a stall is); it runs again then.
        for _ in range(3):
            t0 = time.monotonic()
            try:
                assert asyncio.run(next_after(stall_s + window)) == Token(7, "x")
                break
            except _Failure:
                if time.monotonic() - t0 < stall_s + 2 * window:
                    raise
        else:
            pytest.fail("the loop was late three times in a row")
    else:
        with pytest.raises(_Failure):
            asyncio.run(next_after(stall_s + window))
    with pytest.raises(_Failure):
        asyncio.run(next_after(stall_s + 3 * window))
