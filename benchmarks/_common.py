"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import httpx
import psutil

__all__ = ["SseRun", "at_once", "cpu_s", "median", "p95", "sse_token_times", "thread_cpu_s"]


def cpu_s(p: psutil.Process) -> float:
    """The process's CPU seconds so far (user + system)."""
    t = p.cpu_times()
    return float(t.user + t.system)


def thread_cpu_s(pid: int | str, tid: int | str) -> float:
    """One thread's CPU seconds so far (user + system, in the kernel's clock ticks), from
    ``/proc``; ``pid`` may be ``"self"``. FileNotFoundError once the thread has ended."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


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


class SseRun(NamedTuple):
    """One streamed answer as its client saw it."""

    t0: float  # when the request was sent
    times: list[float]  # the arrival of each frame with text (one or more tokens each)
    tokens: int  # completion tokens, from the answer's usage frame
    headers: dict[str, str]

    def decode_tps(self) -> float:
        """Tokens after the first over the time from the first text to the last. The first
        frame carries the first token alone (the gateway never holds it); later frames may
        carry several (``[server].stream_coalesce_ms``), so frames are not tokens."""
        if len(self.times) < 2:
            return float("nan")
        return (self.tokens - 1) / (self.times[-1] - self.times[0])


def sse_token_times(client: httpx.Client, url: str, body: dict[str, Any]) -> SseRun:
    """POST a streaming request (with ``stream_options.include_usage``); what its client saw.

    The client is a measuring instrument sharing the engine's cores (the bare engine has none),
    so it reads the answer from the socket itself, on a connection of its own to
    ``client.base_url``: one ``recv`` and a prefix test per frame, no HTTP client stack per
    frame (httpx's cost about 0.3 ms of CPU per token here). It counts on the server sending
    each SSE frame as one chunk (uvicorn does: a frame is one ``send``), and waits at most the
    client's read timeout for each ``recv``. A non-200 answer raises ``httpx.HTTPStatusError``
    as httpx would.
    """
    host, port = client.base_url.host, client.base_url.port or 80
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (
        f"POST {url} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    times: list[float] = []
    tokens = -1
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
                if not line.startswith(b'data: {"id"'):
                    continue
                tail = line[-160:]
                has_text = b'"text":"' in tail or b'"content":"' in tail
                empty = b'"text":""' in line or b'"content":""' in line
                if has_text and not empty:
                    times.append(now)
                elif b'"usage":{' in line and b'"choices":[]' in line:
                    tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
    if status != 200:
        request = httpx.Request("POST", client.base_url.join(url))
        response = httpx.Response(status or 502, headers=headers, content=rest, request=request)
        raise httpx.HTTPStatusError(f"{status} from {url}", request=request, response=response)
    if tokens < 0:
        raise RuntimeError(f"{url}: the stream ended without its usage frame")
    return SseRun(t0, times, tokens, headers)
