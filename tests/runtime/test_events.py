"""Worker lines decode once into typed events, and a worker's life follows its table."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.runtime.events import Done, Failed, Progress, Started, Token, decode_request_event
from spillover.runtime.worker_client import WORKER_TRANSITIONS, WorkerClient, WorkerSpec, WorkerState


@pytest.mark.parametrize(
    ("line", "event"),
    [
        ({"ev": "started", "rid": "r"}, Started()),
        ({"ev": "token", "rid": "r", "id": 7, "text": "hi"}, Token(7, "hi")),
        ({"ev": "token", "rid": "r", "id": -1, "text": "tail"}, Token(-1, "tail")),
        (
            {"ev": "done", "rid": "r", "finish_reason": "stop", "completion_tokens": 3, "timings": {"prefill_s": 0.5}},
            Done("stop", 3, 0.5, 0.0),
        ),
        ({"ev": "progress", "rid": "r", "done": 32}, Progress(32)),
        ({"ev": "progress", "rid": "r"}, None),
        ({"ev": "error", "rid": "r", "kind": "oom", "message": "m"}, Failed("oom", "m")),
        ({"ev": "error", "rid": "r", "message": "m"}, Failed("engine", "m")),
        ({"ev": "token", "rid": "r", "text": "no id"}, None),
        ({"ev": "done", "rid": "r"}, None),
        ({"ev": "token", "rid": "r", "id": "x", "text": "t"}, None),
        ({"ev": "what", "rid": "r"}, None),
        ({}, None),
    ],
)
def test_decode_request_event(line: dict[str, Any], event: object) -> None:
    """Known lines become their event; malformed or unknown ones are None (ignored)."""
    assert decode_request_event(line) == event


W = WorkerState
LEGAL = {
    (W.STOPPED, W.STARTING),
    (W.DEAD, W.STARTING),
    (W.STARTING, W.READY),
    (W.STARTING, W.DEAD),
    (W.READY, W.DEAD),
    (W.STARTING, W.STOPPED),
    (W.READY, W.STOPPED),
    (W.DEAD, W.STOPPED),
    (W.STOPPED, W.STOPPED),
}


@pytest.mark.parametrize("current", list(W))
@pytest.mark.parametrize("target", list(W))
def test_worker_state_moves(current: WorkerState, target: WorkerState) -> None:
    """Each move is allowed exactly when the hand-written list says so; an illegal one raises
    and changes nothing."""
    assert ((current, target) in WORKER_TRANSITIONS) == ((current, target) in LEGAL)
    w = WorkerClient(WorkerSpec("w", "cpu", "cpu", "m.gguf", "/tmp", 1, 64, 1, 8), lambda _w, _g: None)
    w.state = current
    if (current, target) in LEGAL:
        w._advance(target)
        assert w.state is target
    else:
        with pytest.raises(RuntimeError):
            w._advance(target)
        assert w.state is current
