"""Small helpers for the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess

COUNT_PROMPT = "Count from 1 to 500, separated by commas: 1, 2, 3,"


def wait_for(pred: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


def ready_worker(gw: GatewayProcess, lane: str, not_pid: int | None = None) -> dict[str, Any]:
    """Wait until the lane's worker is ready (and, optionally, a new process)."""
    return wait_for(
        lambda: (w := gw.worker(lane))["state"] == "ready" and w["pid"] != not_pid and w,
        90,
        f"{lane} worker ready",
    )


def kill_worker(gw: GatewayProcess, lane: str) -> int:
    """SIGKILL a lane's worker; returns its pid."""
    pid = int(gw.worker(lane)["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def sim(gw: GatewayProcess) -> SimDevice:
    return SimDevice(gw.state_dir)


def while_hung(gw: GatewayProcess, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    """``send()``'s answer, and the seconds it took, while the sim GPU hangs (cleared after)."""
    dev = sim(gw)
    dev.set_hang(True)
    try:
        time.sleep(0.5)  # each worker's sim watch sees it (it reads the ledger 20 times a second)
        t0 = time.monotonic()
        return send(), time.monotonic() - t0
    finally:
        dev.set_hang(False)


def stream(
    client: httpx.Client,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run a streaming request; collect text, spillover objects, errors and headers.
    ``on_token(n)`` is called with the count of frames with text so far: a frame may carry
    several tokens (``[server].stream_coalesce_ms``)."""
    out: dict[str, Any] = {"text": "", "spillover": [], "error": None, "done": False, "finish": None}
    n = 0
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as r:
        out["status"] = r.status_code
        out["headers"] = dict(r.headers)
        if r.status_code != 200:
            r.read()
            out["body"] = r.json()
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out["error"] = ev["error"]
                continue
            if "spillover" in ev:
                out["spillover"].append(ev["spillover"])
            for ch in ev.get("choices", []):
                piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if piece:
                    out["text"] += piece
                    n += 1
                    if on_token is not None:
                        on_token(n)
                if ch.get("finish_reason"):
                    out["finish"] = ch["finish_reason"]
    return out


def stream_killing_gpu(gw: GatewayProcess, client: httpx.Client, body: dict[str, Any], at: int) -> dict[str, Any]:
    """Stream ``body`` from a ready GPU worker and SIGKILL that worker when the ``at``-th
    frame with text arrives (at least ``at`` tokens, more with a coalescing window: keep
    ``at`` well under the frames a window of 50 ms leaves); the stream must still end
    (``[DONE]``)."""
    ready_worker(gw, "gpu")
    killed: list[int] = []

    def on_token(n: int) -> None:
        if n == at and not killed:
            killed.append(kill_worker(gw, "gpu"))

    got = stream(client, "/v1/completions", body, on_token=on_token)
    assert killed, "the kill happened"
    assert got["done"], got
    return got


def post_then_hang_up(url: str, path: str, body: dict[str, Any], after_s: float) -> None:
    """Send a POST over a raw socket and close the connection after ``after_s`` seconds
    without reading the answer: a client that goes away."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    data = json.dumps(body).encode()
    with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=10) as s:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        s.sendall(head + data)
        time.sleep(after_s)


@contextlib.contextmanager
def healthy_client(gw: GatewayProcess) -> Iterator[httpx.Client]:
    """A client once both workers are ready and the GPU breaker is closed again (an earlier
    test may have opened it: probes are sent while it is half-open)."""
    ready_worker(gw, "gpu")
    ready_worker(gw, "cpu")
    with httpx.Client(base_url=gw.url, timeout=120) as c:

        def closed() -> bool:
            if gw.status()["breaker"]["circuit"] == "half_open":
                c.post("/v1/completions", json={"prompt": "probe", "max_tokens": 2})
            return bool(gw.status()["breaker"]["circuit"] == "closed")

        wait_for(closed, 60, "breaker closed")
        yield c


def replay_after_sigkill(g: GatewayProcess, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    """Send ``body`` with Idempotency-Key ``key``; SIGKILL the gateway while it runs; restart
    it; return the answer its key gives once the replayed request has finished."""
    import threading

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the gateway dies under it
            httpx.post(g.url + path, json=body, headers={"Idempotency-Key": key}, timeout=60)

    threading.Thread(target=send, daemon=True).start()
    wait_for(lambda: g.status()["running"], 30, "running")
    g.kill9()
    g.restart()
    with httpx.Client(base_url=g.url, timeout=120) as c:

        def finished() -> httpx.Response | None:
            r = c.post(path, json=body, headers={"Idempotency-Key": key})
            return r if r.status_code == 200 else None

        result: httpx.Response = wait_for(finished, 120, "replayed")
        return result
