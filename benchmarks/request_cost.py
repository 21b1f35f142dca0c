"""Gateway CPU per request: what the gateway process itself spends (HTTP, validation, template
and tokenization, journal, scheduling, the worker channel) on many small requests.

Sends ``--requests`` requests at ``--concurrency`` (httpx clients in threads) of each kind:
1-token chat completions, and single-input embeddings. The gateway's own CPU time (user +
system of its process, not its workers') over the run, divided by the requests, is printed
with the requests per second.

    .venv/bin/python -m benchmarks.request_cost [--requests 200] [--concurrency 4]

Issue 13's target is <= 1 ms of gateway CPU per request; this prints where it stands, and how
much of it the gateway's idle loops (device and host-memory readings, health pings, the
HTTP server's tick: measured first, with no request) spend over the run's wall time. It then
streams ``--streams`` chat completions one after another and prints the gateway's CPU per
streamed token (what item 4's ratio at threads = cores pays for each token), idle loops included.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import httpx
import psutil

from benchmarks._common import sse_token_times
from spillover.testing import GatewayProcess

KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat, 1 token": (
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0},
    ),
    "embeddings, 1 input": ("/v1/embeddings", {"model": "bge-small-en", "input": "The cat sits on the mat."}),
}


def cpu_s(gw: GatewayProcess) -> float:
    assert gw.proc is not None
    t = psutil.Process(gw.proc.pid).cpu_times()
    return float(t.user + t.system)


def idle_cpu(gw: GatewayProcess, seconds: float = 5.0) -> float:
    """The gateway's CPU seconds per second with no request (its loops)."""
    c0, w0 = cpu_s(gw), time.perf_counter()
    time.sleep(seconds)
    return (cpu_s(gw) - c0) / (time.perf_counter() - w0)


def run(gw: GatewayProcess, path: str, body: dict[str, Any], n: int, concurrency: int) -> tuple[float, float]:
    """(gateway CPU ms per request, requests per second)."""
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for _ in range(10):  # warm-up
            assert c.post(path, json=body).status_code == 200
    errors: list[int] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            for _ in range(n // concurrency):
                r = c.post(path, json=body)
                if r.status_code != 200:
                    errors.append(r.status_code)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    c0, w0 = cpu_s(gw), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c1, w1 = cpu_s(gw), time.perf_counter()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {sorted(set(errors))}")
    done = (n // concurrency) * concurrency
    return 1000 * (c1 - c0) / done, done / (w1 - w0)


STREAM = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
    "max_tokens": 200,
    "temperature": 0,
}


def stream_cost(gw: GatewayProcess, streams: int) -> tuple[float, float]:
    """(gateway CPU us per streamed token, tokens per second) over ``streams`` streams in a row."""
    with httpx.Client(base_url=gw.url, timeout=300) as c:
        sse_token_times(c, "/v1/chat/completions", STREAM)  # warm-up
        c0, w0, tokens = cpu_s(gw), time.perf_counter(), 0
        for _ in range(streams):
            tokens += len(sse_token_times(c, "/v1/chat/completions", STREAM)[1])
        c1, w1 = cpu_s(gw), time.perf_counter()
    return 1e6 * (c1 - c0) / max(1, tokens), tokens / (w1 - w0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--streams", type=int, default=6, help="streamed completions for the per-token figure")
    a = ap.parse_args()
    with GatewayProcess(["--gpu", "sim:1024"], services=("chat", "embeddings")) as gw:
        time.sleep(2)  # start-up work (readiness measurements) settles
        idle = idle_cpu(gw)
        print(f"{a.requests} requests at concurrency {a.concurrency}; gateway process CPU (user + system)")
        print(f"idle gateway: {1000 * idle:.1f} ms of CPU a second")
        print(f"{'kind':<22} {'CPU ms/request':>15} {'of it idle loops':>17} {'requests/s':>11}")
        worst = 0.0
        for name, (path, body) in KINDS.items():
            ms, rps = run(gw, path, body, a.requests, a.concurrency)
            worst = max(worst, ms)
            print(f"{name:<22} {ms:>15.2f} {1000 * idle / rps:>17.2f} {rps:>11.1f}")
        if a.streams > 0:
            us, tps = stream_cost(gw, a.streams)
            print(f"streamed chat tokens (one stream at a time): {us:.0f} us of gateway CPU a token at {tps:.1f} tok/s")
    print("target: <= 1 ms of gateway CPU per request:", "MET" if worst <= 1.0 else "NOT MET")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
