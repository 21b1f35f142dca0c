"""Gateway CPU per request: what the gateway process itself spends (HTTP, validation, template
and tokenization, journal, scheduling, the worker channel) on many small requests.

Sends ``--requests`` requests at ``--concurrency`` (httpx clients in threads) of each kind:
1-token chat completions, and single-input embeddings. The gateway's own CPU time (user +
system of its process, not its workers') over the run, divided by the requests, is printed
with the requests per second.

    .venv/bin/python -m benchmarks.request_cost [--requests 200] [--concurrency 4]

Issue 13's target is <= 1 ms of gateway CPU per request; this prints where it stands.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import httpx
import psutil

from spillover.testing import GatewayProcess

KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat, 1 token": (
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0},
    ),
    "embeddings, 1 input": ("/v1/embeddings", {"model": "bge-small-en", "input": "The cat sits on the mat."}),
}


def run(gw: GatewayProcess, path: str, body: dict[str, Any], n: int, concurrency: int) -> tuple[float, float]:
    """(gateway CPU ms per request, requests per second)."""
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for _ in range(10):  # warm-up
            assert c.post(path, json=body).status_code == 200
    assert gw.proc is not None
    proc = psutil.Process(gw.proc.pid)
    errors: list[int] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            for _ in range(n // concurrency):
                r = c.post(path, json=body)
                if r.status_code != 200:
                    errors.append(r.status_code)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    t0, w0 = proc.cpu_times(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1, w1 = proc.cpu_times(), time.perf_counter()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {sorted(set(errors))}")
    done = (n // concurrency) * concurrency
    cpu = (t1.user + t1.system) - (t0.user + t0.system)
    return 1000 * cpu / done, done / (w1 - w0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    with GatewayProcess(["--gpu", "sim:1024"], services=("chat", "embeddings")) as gw:
        print(f"{a.requests} requests at concurrency {a.concurrency}; gateway process CPU (user + system)")
        print(f"{'kind':<22} {'CPU ms/request':>15} {'requests/s':>11}")
        worst = 0.0
        for name, (path, body) in KINDS.items():
            ms, rps = run(gw, path, body, a.requests, a.concurrency)
            worst = max(worst, ms)
            print(f"{name:<22} {ms:>15.2f} {rps:>11.1f}")
    print("target: <= 1 ms of gateway CPU per request:", "MET" if worst <= 1.0 else "NOT MET")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
