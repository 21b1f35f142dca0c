"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

__all__ = ["at_once", "median", "p95", "sse_token_times"]


def at_once(calls: list[Callable[[], None]]) -> None:
    """Run the calls concurrently, one thread each, and wait for all of them."""
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p95(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


def sse_events(r: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def sse_token_times(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, list[float], dict]:
    """POST a streaming request; return (t_sent, arrival time of each content chunk, headers).

    Parsing is kept minimal (a prefix test per line) so the client steals little CPU from
    the engine on a small machine.
    """
    t0 = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            tail = line[-160:]
            has_text = '"text":"' in tail or '"content":"' in tail
            empty = '"text":""' in line or '"content":""' in line
            if line.startswith('data: {"id"') and has_text and not empty:
                times.append(time.perf_counter())
        return t0, times, dict(r.headers)
