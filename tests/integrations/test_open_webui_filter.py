"""The Open WebUI filter, fed stream events recorded from a real spillover gateway
(``data/stream_*.jsonl``: a GPU answer, a CPU answer, and a GPU answer that failed over to
the CPU replica after its fifth token)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DATA = Path(__file__).parent / "data"
FILTER = Path(__file__).parents[2] / "integrations" / "open_webui" / "spillover_status.py"


def load_filter() -> ModuleType:
    """The filter module as Open WebUI loads it: a standalone file, not part of the package."""
    spec = importlib.util.spec_from_file_location("spillover_status", FILTER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def recorded(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"stream_{name}.jsonl").read_text().splitlines()]


def run(events: list[dict[str, Any]], **valves: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Feed events through Filter.stream; return (the events it passed on, what it emitted)."""
    mod = load_filter()
    f = mod.Filter()
    f.valves = f.Valves(**valves)
    emitted: list[dict[str, Any]] = []

    async def emit(ev: dict[str, Any]) -> None:
        emitted.append(ev)

    async def go() -> list[dict[str, Any]]:
        return [await f.stream(json.loads(json.dumps(e)), __event_emitter__=emit) for e in events]

    return asyncio.run(go()), emitted


def test_a_cpu_answer_shows_its_notice_once_and_passes_every_chunk_unchanged() -> None:
    """The CPU answer's first chunk carries the notice: one status event with it; the
    chunks themselves reach the UI unchanged."""
    events = recorded("cpu")
    passed, emitted = run(events)
    assert passed == events
    assert emitted == [
        {
            "type": "status",
            "data": {
                "description": "answered on CPU: CPU asked for — slower, context 1,024",
                "done": True,
                "hidden": False,
            },
        }
    ]


def test_a_gpu_answer_shows_nothing_unless_asked() -> None:
    """Nothing degraded, nothing shown; with show_normal, 'answered on GPU'."""
    assert run(recorded("gpu"))[1] == []
    assert [e["data"]["description"] for e in run(recorded("gpu"), show_normal=True)[1]] == ["answered on GPU"]


def test_a_failover_mid_stream_updates_the_status_when_the_route_changes() -> None:
    """The stream starts on the GPU (nothing shown) and its route-change chunk, after the
    GPU worker was killed, turns the status line into the failover notice."""
    events = recorded("failover")
    routes = [e["spillover"]["route"] for e in events if "spillover" in e]
    assert routes == ["gpu", "cpu"]  # the recording is what it claims to be
    _, emitted = run(events, show_normal=True)
    assert [e["data"]["description"] for e in emitted] == [
        "answered on GPU",
        "answered on CPU: the GPU failed during this answer — slower, context 1,024",
    ]


@pytest.mark.parametrize("name", ["cpu", "gpu", "failover"])
def test_without_an_emitter_the_filter_is_a_pass_through(name: str) -> None:
    """Open WebUI's API path gives no emitter: every chunk still passes unchanged."""
    mod = load_filter()
    f = mod.Filter()
    events = recorded(name)
    assert [asyncio.run(f.stream(e)) for e in events] == events
