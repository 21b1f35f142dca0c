"""The worker channel (``worker_client``): on its reading side, JSON lines dispatched as their
bytes arrive, however the pipe cuts them; junk skipped; an endless line stopped. On its
writing side, a worker that does not read its channel is killed as hung."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from spillover.runtime import worker_client
from spillover.runtime.worker_client import WorkerClient, WorkerGone, WorkerSpec, _Channel


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


ABORT = b"/tmp/pip-x/vendor/llama.cpp/ggml/src/ggml-backend.cpp:205: GGML_ASSERT(buffer) failed"


def said(chunks: list[bytes], capfd: Any) -> str | None:
    """What ``_Channel.said`` makes of ``chunks`` on the worker's standard error; each byte
    passes through to the gateway's own standard error unchanged."""
    loop = asyncio.new_event_loop()
    try:
        ch = _Channel(loop, lambda _m: None, lambda: None)
        for c in chunks:
            ch.pipe_data_received(2, c)
        assert capfd.readouterr().err.encode() == b"".join(chunks)
        return ch.said
    finally:
        loop.close()


@given(cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_the_engines_abort_line_names_the_failure_however_the_bytes_are_cut(cuts: list[int]) -> None:
    # llama.cpp's abort: an error before it, its line, then gdb's backtrace (errors of its own)
    wire = (
        b"llama_kv_cache: padding V cache\nload error: nothing\n" + ABORT + b"\n#0 0x7f in ggml_abort\nptrace: error\n"
    )
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    loop = asyncio.new_event_loop()
    try:
        ch = _Channel(loop, lambda _m: None, lambda: None)
        for a, b in itertools.pairwise(points):
            if b > a:
                ch.pipe_data_received(2, wire[a:b])
        assert ch.said == "ggml-backend.cpp:205: GGML_ASSERT(buffer) failed"  # its source path cut
    finally:
        loop.close()


def test_without_an_abort_the_last_error_line_names_it_and_nothing_else_does(capfd: Any) -> None:
    tb = b"Traceback (most recent call last):\n  File \"w.py\", line 1\nValueError: no such tensor 'x'\n"
    assert said([b"loading\n", tb[:30], tb[30:], b"bye\n"], capfd) == "ValueError: no such tensor 'x'"
    assert said([b"llama_context: n_ctx = 512\n", b"all fine"], capfd) is None
    assert said([b"x" * 10_000 + b" error\n"], capfd) is None  # past the kept bytes: not read
    assert said([b"a fatal " + b"y" * 5000 + b"\n"], capfd) == "a fatal " + "y" * 292  # 300 characters


def test_exit_words_name_the_signal_and_what_a_worker_said_only_when_it_failed_of_itself() -> None:
    why = "ggml-backend.cpp:205: GGML_ASSERT(buffer) failed"
    assert worker_client.exit_words(-6, why) == f"worker exited with code -6 (SIGABRT): {why}"
    assert worker_client.exit_words(1, why) == f"worker exited with code 1: {why}"
    assert worker_client.exit_words(-9, why) == "worker exited with code -9 (SIGKILL)"  # killed from outside
    assert worker_client.exit_words(-15, why) == "worker exited with code -15 (SIGTERM)"
    assert worker_client.exit_words(0, why) == "worker exited with code 0"
    assert worker_client.exit_words(-11, None) == "worker exited with code -11 (SIGSEGV)"
    assert worker_client.exit_words(-99, None) == "worker exited with code -99"  # no such signal


class _DeafSpec(WorkerSpec):
    """A worker that says it is ready and then never reads its channel (a hang)."""

    def argv(self) -> list[str]:
        ready = json.dumps({"ev": "ready", "info": {}})
        return [sys.executable, "-c", f"import sys, time; print({ready!r}, flush=True); time.sleep(60)"]


def test_a_request_the_worker_does_not_read_kills_it_as_hung_and_ends_with_its_exit(monkeypatch: Any) -> None:
    """A request op that cannot be written within ``DRAIN_TIMEOUT_S`` (the worker does not
    read its channel): it may still be in the pipe and run later, so the worker has not let go
    of it. The worker is killed as hung, and the request ends with its exit (``WorkerGone``
    "hung"); it is not taken as stopped while the process lives."""
    monkeypatch.setattr(worker_client, "DRAIN_TIMEOUT_S", 0.3)

    async def main() -> None:
        w = WorkerClient(_DeafSpec("deaf", "cpu", "cpu", "", "", 1, 512, 1, 8), lambda _w, _g: None)
        await w.start(10.0)
        assert w._proc is not None
        events = w.request("embed", {"rid": "r1", "inputs": "x" * (1 << 20)})  # past the pipe's room
        ev = await asyncio.wait_for(anext(events), 10.0)
        assert isinstance(ev, WorkerGone) and ev.kind == "hung", ev
        assert w._proc.returncode == -signal.SIGKILL  # exited: killed, not left running with the op
        assert w.when_stopped("r1") is None
        await events.aclose()
        await w.stop()

    asyncio.run(main())
