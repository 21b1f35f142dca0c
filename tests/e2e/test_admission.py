"""Admission on the sim device: a long request is routed to CPU *before* the GPU fails."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from spillover.engine.sim import MIB, SimDevice
from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e


def test_tenant_pressure_routes_long_requests_to_cpu_before_any_gpu_failure() -> None:
    """With a tenant holding most of the device, long requests go to CPU (reason
    observed_pressure) while short ones still run on GPU, no GPU allocation fails, and
    /v1/status turns from normal to degraded, naming the reason."""
    with GatewayProcess(["--gpu", "sim:1024", "--cpu-ctx", "2048"]) as gw:
        dev = SimDevice(gw.state_dir)
        snap = dev.snapshot()
        # Leave ~75 MiB of headroom: a short request (~50 MiB) fits, a long one (~116 MiB) does not.
        hold = snap.capacity_bytes - 32 * MIB - snap.used_bytes - 75 * MIB
        tenant = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spillover.cli",
                "tenant",
                "--state-dir",
                gw.state_dir,
                "--mib",
                str(hold // MIB),
                "--name",
                "other-service",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
