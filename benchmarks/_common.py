"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil

__all__ = ["at_once", "cpu_s", "median", "p95", "sse_token_times"]


def cpu_s(p: psutil.Process) -> float:
    """The process's CPU seconds so far (user + system)."""
    t = p.cpu_times()
    return float(t.user + t.system)


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

    The client is a measuring instrument sharing the engine's cores (the bare engine has none),
    so it reads the answer from the socket itself, on a connection of its own to
    ``client.base_url``: one ``recv`` and a prefix test per frame, no HTTP client stack per
    chunk (httpx's cost about 0.3 ms of CPU per token here). It counts on the server sending
    each SSE frame as one chunk (uvicorn does: a frame is one ``send``), and waits at most the
    client's read timeout for each ``recv``. A non-200 answer raises ``httpx.HTTPStatusError``
    as httpx would.
    """
    host, port = client.base_url.host, client.base_url.port or 80
    payload = json.dumps({**body, "stream": True}).encode()
    head = (
        f"POST {url} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    times: list[float] = []
    rest = b""  # the start of a line whose end has not arrived
    status, headers = 0, {}
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=client.timeout.read or 300) as sock:
        sock.sendall(head + payload)
        while True:
            data = sock.recv(65536)
            if not data:
                break
            now = time.perf_counter()
            data = rest + data
            if not status:
                if b"\r\n\r\n" not in data:
                    rest = data
                    continue
                raw, _, data = data.partition(b"\r\n\r\n")
                first, *fields = raw.decode("latin-1").split("\r\n")
                status = int(first.split()[1])
                headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
            *lines, rest = data.split(b"\n")
            if status != 200:
                rest = b"\n".join([*lines, rest])
                continue
            for line in lines:
                tail = line[-160:]
                has_text = b'"text":"' in tail or b'"content":"' in tail
                empty = b'"text":""' in line or b'"content":""' in line
                if line.startswith(b'data: {"id"') and has_text and not empty:
                    times.append(now)
    if status != 200:
        request = httpx.Request("POST", client.base_url.join(url))
        response = httpx.Response(status or 502, headers=headers, content=rest, request=request)
        raise httpx.HTTPStatusError(f"{status} from {url}", request=request, response=response)
    return t0, times, headers
