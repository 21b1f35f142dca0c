"""``benchmarks.request_cost --breakdown``: how a profile of the gateway's event loop is put into
parts. A function of no part of its own (a built-in, the standard library's helpers) counts in
its callers' parts, as much in each as it spent called from there; nothing is lost or counted
twice."""

from __future__ import annotations

import cProfile
import json
import time
from pathlib import Path
from typing import Any

import pytest
from benchmarks.request_cost import OTHER, attribute, breakdown, part_of

HTTP = ("/venv/site-packages/spillover/http/app.py", 10, "generate")
JOURNAL = ("/venv/site-packages/spillover/runtime/journal.py", 20, "move")
ISINSTANCE = ("~", 0, "<built-in method builtins.isinstance>")
REPLACE = ("/usr/lib/python3.11/dataclasses.py", 1500, "replace")
ORPHAN = ("~", 0, "<method 'get' of 'dict' objects>")


def entry(own_s: float, callers: dict[Any, float]) -> tuple[int, int, float, float, dict[Any, Any]]:
    """A pstats row: its own time, and the own time spent called from each caller."""
    return (1, 1, own_s, own_s, {c: (1, 1, s, s) for c, s in callers.items()})


def test_a_built_in_counts_in_its_callers_parts_by_what_it_spent_there() -> None:
    stats = {
        HTTP: entry(1.0, {}),
        JOURNAL: entry(0.5, {}),
        ISINSTANCE: entry(0.4, {HTTP: 0.1, JOURNAL: 0.3}),
        REPLACE: entry(0.2, {ISINSTANCE: 0.2}),  # a helper called from a helper: up to the part
        ORPHAN: entry(0.05, {}),
    }
    spent: dict[str, float] = {}
    for key, row in stats.items():
        attribute(stats, key, row[2], spent)
    assert spent["validation, answers (spillover.http)"] == pytest.approx(1.0 + 0.1 + 0.05)
    assert spent["journal (SQLite)"] == pytest.approx(0.5 + 0.3 + 0.15)
    assert spent[OTHER] == pytest.approx(0.05)
    assert sum(spent.values()) == pytest.approx(sum(row[2] for row in stats.values()))


def test_parts_are_found_by_file_and_the_most_specific_comes_first() -> None:
    assert part_of(("/x/spillover/runtime/journal_bounds.py", 1, "f")) == "journal (SQLite)"
    assert part_of(("/x/spillover/http/server.py", 1, "f")) == "HTTP server (uvicorn, Starlette)"
    assert part_of(("/x/spillover/runtime/gateway.py", 1, "_observe_loop")) == "idle loops"
    assert part_of(("/x/spillover/runtime/gateway.py", 1, "store_outcome")) == "request lifecycle"
    assert part_of(("~", 0, "<method 'execute' of 'sqlite3.Connection' objects>")) == "journal (SQLite)"
    assert part_of(ISINSTANCE) is None


def test_a_real_profile_and_its_threads_file_are_read_whole(tmp_path: Path) -> None:
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(2000):
        json.loads(json.dumps({"a": [1, 2, 3]}))
    prof.disable()
    out = tmp_path / "loop.prof"
    prof.dump_stats(str(out))
    Path(f"{out}.threads.json").write_text(json.dumps({"event loop": 10.0, "journal_0": 2.0}))
    found = breakdown(out)
    assert sum(found.shares.values()) == pytest.approx(1.0)
    assert found.shares["JSON"] > 0.5  # what the loop above did, whoever called it
    assert 0 < found.seen < 1  # the profiler's Python time over the thread's 10 s
    assert found.threads == {"event loop": 10.0, "journal_0": 2.0}


def test_the_journal_alone_is_measured_against_the_same_tasks_without_it() -> None:
    """``journal_alone``: the journal's writes cost CPU and hand-offs beyond the tasks' own (an
    accept is fsynced on the journal's thread, so at least one wake-up a request), and its
    thread's share is part of the total."""
    from benchmarks.request_cost import journal_alone

    answer = json.dumps({"object": "list", "data": [{"embedding": [0.01] * 384}]}).encode()
    cost = journal_alone(200, 4, {"model": "bge-small-en", "input": "The cat sits on the mat."}, answer)
    assert cost.ms > 0 and 0 < cost.thread_ms <= cost.ms + 0.1, cost  # clock ticks: 10 ms over 200 requests
    assert cost.wakes >= 1, cost
