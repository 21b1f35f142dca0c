"""The worker channel's reading side (``worker_client._Channel``): JSON lines dispatched as
their bytes arrive, however the pipe cuts them; junk skipped; an endless line stopped."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from spillover.runtime import worker_client
from spillover.runtime.worker_client import _Channel


def feed(chunks: list[bytes], *, end: bool = True) -> tuple[list[dict[str, Any]], int, bool]:
    """Messages dispatched, overflows, and whether ``ended`` resolved."""
    loop = asyncio.new_event_loop()
    try:
        got: list[dict[str, Any]] = []
        overflows = [0]
        ch = _Channel(loop, got.append, lambda: overflows.__setitem__(0, overflows[0] + 1))
        for c in chunks:
            ch.pipe_data_received(1, c)
        if end:
            ch.pipe_connection_lost(1, None)
        return got, overflows[0], ch.ended.done()
    finally:
        loop.close()


messages = st.lists(
    st.dictionaries(st.sampled_from(["ev", "rid", "text", "id"]), st.one_of(st.text(), st.integers())),
    max_size=8,
)


@given(msgs=messages, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_every_message_arrives_once_in_order_however_the_bytes_are_cut(
    msgs: list[dict[str, Any]], cuts: list[int]
) -> None:
    wire = b"".join(json.dumps(m).encode() + b"\n" for m in msgs)
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    chunks = [wire[a:b] for a, b in itertools.pairwise(points) if b > a]
    got, overflows, ended = feed(chunks)
    assert got == msgs and overflows == 0 and ended


def test_junk_lines_are_skipped_and_a_last_line_without_newline_counts() -> None:
    wire = [b'{"ev":"a"}\nnot json\n\xff\xfe\n[1,2]\n', b"\n  \n", b'{"ev":"b"}']
    got, overflows, ended = feed(wire)
    assert got == [{"ev": "a"}, {"ev": "b"}] and overflows == 0 and ended


def test_a_line_longer_than_the_limit_is_stopped(monkeypatch: Any) -> None:
    monkeypatch.setattr(worker_client, "_LINE_LIMIT", 100)
    got, overflows, _ = feed([b'{"ev":"a"}\n' + b"x" * 60, b"y" * 60, b'\n{"ev":"b"}\n'], end=False)
    assert overflows == 1 and got[0] == {"ev": "a"}


def test_a_handler_error_does_not_stop_the_channel() -> None:
    loop = asyncio.new_event_loop()
    try:
        seen: list[Any] = []

        def handle(msg: dict[str, Any]) -> None:
            seen.append(msg)
            if msg["ev"] == "bad":
                raise RuntimeError("bug")

        ch = _Channel(loop, handle, lambda: None)
        ch.pipe_data_received(1, b'{"ev":"bad"}\n{"ev":"good"}\n')
        assert [m["ev"] for m in seen] == ["bad", "good"]
    finally:
        loop.close()
