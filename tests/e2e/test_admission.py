"""Admission on the sim device: a long request is routed to CPU *before* the GPU fails."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from spillover.engine.sim import MIB, SimDevice
from spillover.testing import GatewayProcess
from tests.e2e.helpers import COUNT_PROMPT, wait_for

pytestmark = pytest.mark.e2e


def _tenant(gw: GatewayProcess, hold: int) -> subprocess.Popen[bytes]:
    """Another program holding ``hold`` bytes of the gateway's sim device."""
    cmd = [sys.executable, "-m", "spillover.cli", "tenant", "--state-dir", gw.state_dir, "--mib", str(hold // MIB)]
    return subprocess.Popen([*cmd, "--name", "other-service"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_tenant_pressure_routes_long_requests_to_cpu_before_any_gpu_failure() -> None:
    """With a tenant holding most of the device, long requests go to CPU (reason
    observed_pressure) while short ones still run on GPU, no GPU allocation fails, and
    /v1/status turns from normal to degraded, naming the reason."""
    with GatewayProcess(["--gpu", "sim:1024", "--cpu-ctx", "2048"]) as gw:
        dev = SimDevice(gw.state_dir)
        snap = dev.snapshot()
        # Leave ~75 MiB of headroom: a short request (~50 MiB) fits, a long one (~116 MiB) does not.
        hold = snap.capacity_bytes - 32 * MIB - snap.used_bytes - 75 * MIB
        tenant = _tenant(gw, hold)
        try:
            deadline = time.monotonic() + 20
            while gw.status()["device"]["ledger"]["observed_bytes"] < snap.used_bytes + hold - MIB:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with httpx.Client(base_url=gw.url, timeout=120) as c:
                short = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16})
                assert short.status_code == 200
                assert short.headers["x-spillover-route"] == "gpu", short.headers
                assert gw.status()["mode"] == "normal", gw.status()["reasons"]
                long_prompt = "The quick brown fox jumps over the lazy dog. " * 60
                long = c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 200})
                assert long.status_code == 200, long.text
                assert long.headers["x-spillover-route"] == "cpu"
                assert long.headers["x-spillover-reason"] == "observed_pressure"
                assert long.headers["x-spillover-degraded"] == "1"
                assert long.json()["spillover"]["route"] == "cpu"
            st = gw.status()
            # Every worker is up and the breaker closed, yet answers are served on the CPU: the
            # mode says so, with the reason.
            assert st["mode"] == "degraded" and any("observed_pressure" in r for r in st["reasons"]), st["reasons"]
            assert st["device"]["alloc_failures"] == 0
            assert gw.worker("gpu")["alloc_failures"] == 0
            assert st["decision_counts"].get("route:observed_pressure", 0) >= 1
        finally:
            tenant.terminate()
            tenant.wait(10)


def test_allow_shrink_is_reported() -> None:
    """With the client's opt-in, a request too big for the GPU lane is shrunk and says so."""
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-ctx", "256", "--cpu-ctx", "2048"]) as gw:
        body = {"prompt": "Tell me a story.", "max_tokens": 600, "spillover": {"allow_shrink": True}}
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200
        sp = r.json()["spillover"]
        assert r.headers["x-spillover-route"] == "gpu" and sp["shrunk"] is True
        assert sp["limits"]["max_tokens"] < 600
        assert f"max_tokens={sp['limits']['max_tokens']}" in r.headers["x-spillover-limits"]
        assert r.json()["usage"]["completion_tokens"] <= sp["limits"]["max_tokens"]
        plain = httpx.post(gw.url + "/v1/completions", json={**body, "spillover": {}}, timeout=120)
        assert plain.headers["x-spillover-route"] == "cpu"
        assert plain.headers["x-spillover-reason"] == "too_long_for_gpu"


def test_a_request_refused_after_acceptance_is_counted_and_journaled_with_its_reason() -> None:
    """Under a tenant's pressure a request the GPU cannot hold goes to the CPU lane, whose
    1024-token cap it is past: 503 ``too_long_for_cpu``. It was accepted, so it is journaled
    rejected, and /metrics and the journal say why as its header does (they said "none")."""
    with GatewayProcess(["--gpu", "sim:1024", "--chat-only"]) as gw:
        tenant = _tenant(gw, 850 * MIB)
        try:
            wait_for(lambda: gw.status()["device"]["ledger"]["observed_bytes"] >= 850 * MIB, 20, "the tenant's hold")
            body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 503 and r.headers["x-spillover-reason"] == "too_long_for_cpu", r.text
            stored = httpx.get(f"{gw.url}/v1/requests/{r.headers['x-spillover-request-id']}").json()
            assert stored["state"] == "rejected" and stored["reason"] == "too_long_for_cpu", stored
            metrics = httpx.get(gw.url + "/metrics").text
            assert 'spillover_requests_total{outcome="rejected",reason="too_long_for_cpu",route="none"} 1.0' in metrics
            assert 'reason="none"' not in metrics
        finally:
            tenant.terminate()
            tenant.wait(10)


def test_a_full_gpu_queue_spills_over_to_the_cpu_lane_instead_of_refusing() -> None:
    """Round 45b: 22 of 40 requests got 503 queue_full at once while the CPU lane stood idle.
    With one GPU slot and a GPU queue of one, a burst of 8 is served: what finds the GPU queue
    full starts on the CPU lane (reason gpu_queue_full, degraded), none is refused."""
    cfg = {"gpu_lane": {"slots": 1, "queue_depth": 1}, "cpu_lane": {"slots": 2, "queue_depth": 8, "canary_ratio": 0.0}}
    with GatewayProcess(["--gpu", "sim:1024"], config=cfg) as gw:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 24, "temperature": 0}
        results: list[httpx.Response] = []

        def one() -> None:
            results.append(httpx.post(f"{gw.url}/v1/completions", json=body, timeout=300))

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [r.status_code for r in results] == [200] * 8, [r.text for r in results if r.status_code != 200]
        spilled = [r for r in results if r.headers["x-spillover-reason"] == "gpu_queue_full"]
        assert spilled and all(r.headers["x-spillover-route"] in ("cpu", "gpu") for r in spilled)
        assert all(r.headers["x-spillover-degraded"] == "1" for r in spilled if r.headers["x-spillover-route"] == "cpu")


def test_a_request_too_long_for_every_lane_is_a_400_even_while_every_place_is_taken() -> None:
    """Round 48: with the queues full, a prompt longer than every lane's cap got 503 queue_full
    (Retry-After, ``x-should-retry``: an SDK retries what can never run); its own 400 comes
    first. A short one then is the 503, with nothing journaled."""
    cfg = {"gpu_lane": {"slots": 1, "queue_depth": 1}, "cpu_lane": {"slots": 1, "queue_depth": 1, "canary_ratio": 0.0}}
    with GatewayProcess(["--gpu", "sim:1024"], config=cfg) as gw:
        long = {"prompt": COUNT_PROMPT, "max_tokens": 400, "temperature": 0}
        threads = [
            threading.Thread(
                target=httpx.post, args=(f"{gw.url}/v1/completions",), kwargs={"json": long, "timeout": 300}
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: sum(len(x["queued"]) for x in gw.status()["lanes"]) == 2, 60, "every place taken")
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            too_long = c.post("/v1/completions", json={"prompt": "word " * 6000, "max_tokens": 8})
            assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded", (
                too_long.text
            )
            full = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full", full.text
            assert c.get(f"/v1/requests/{full.headers['x-spillover-request-id']}").status_code == 404
            for r in gw.status()["running"]:
                c.delete(f"/v1/requests/{r['rid']}")
        for t in threads:
            t.join(300)
