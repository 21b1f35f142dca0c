"""A worker SIGKILLed idle or mid-request: gateway stays up, clean 503, worker returns."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e
BODY = {"prompt": "Count: 1, 2, 3, 4, 5, 6,", "max_tokens": 1500, "temperature": 0}


@pytest.fixture(scope="module")
def cpu_gateway() -> Iterator[GatewayProcess]:
    """A CPU-only gateway: a crash of its only worker has no replica to fail over to."""
    with GatewayProcess(["--gpu", "none", "--cpu-ctx", "2048"]) as gw:
        yield gw


def wait_worker(gw: GatewayProcess, pred, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = gw.worker("cpu")
        if pred(w):
            return w
        time.sleep(0.05)
    raise TimeoutError(gw.worker("cpu"))


def test_sigkill_idle_worker_is_restarted(cpu_gateway: GatewayProcess) -> None:
    """Killing an idle worker is an event: it is reported, restarted, and serves again."""
    gw = cpu_gateway
    w = wait_worker(gw, lambda w: w["state"] == "ready")
    os.kill(w["pid"], signal.SIGKILL)
    dead = wait_worker(gw, lambda x: x["exits"] >= w["exits"] + 1)
    assert "exited" in (dead["last_exit"] or "")
    assert httpx.get(gw.url + "/health").status_code == 200
    back = wait_worker(gw, lambda x: x["state"] == "ready" and x["pid"] != w["pid"])
    assert back["starts"] == w["starts"] + 1
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_sigkill_mid_request_gives_clean_503(cpu_gateway: GatewayProcess) -> None:
    """A request in flight on a killed worker ends in an OpenAI-shaped 503 with Retry-After."""
    gw = cpu_gateway
    w = wait_worker(gw, lambda w: w["state"] == "ready")
    result: dict = {}

    def call() -> None:
        result["r"] = httpx.post(gw.url + "/v1/completions", json=BODY, timeout=120)

    t = threading.Thread(target=call)
    t.start()
    busy = wait_worker(gw, lambda x: x["busy"] == 1 and x["progress_tokens"] > w["progress_tokens"], 30)
    os.kill(busy["pid"], signal.SIGKILL)
    t.join(60)
    r = result["r"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "worker_failed"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-spillover-request-id"]
    wait_worker(gw, lambda x: x["state"] == "ready" and x["pid"] != busy["pid"])
    ok = httpx.post(gw.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(gw.url + "/health").status_code == 200
