"""The split profile with real workers and the real model: a sim device too small for the whole
model but large enough for part of it serves requests on a split worker (route split, flagged
degraded, with the reason), and a split worker's fault replays on the CPU replica."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import sim, stream

pytestmark = pytest.mark.e2e
SMALL_MIB = 160  # 128 MiB usable: SmolLM2 with a 2048-token request needs about 243 MiB


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", f"sim:{SMALL_MIB}", "--split"]) as g:
        yield g


def test_the_device_runs_the_planned_split(gw: GatewayProcess) -> None:
    st = gw.status()
    plan = st["services"][0]["profile"]
    assert plan["profile"] == "split" and plan["split_worker"]
    assert plan["resident_bytes"] > plan["usable_bytes"] >= plan["split_bytes"] > 0
    assert 0 < plan["split_layers"] <= 30
    assert {(w["worker_id"], w["lane"]) for w in st["workers"]} == {("split0", "split"), ("cpu0", "cpu")}
    assert st["mode"] == "degraded" and any(r.startswith("split profile:") for r in st["reasons"])
    # the split worker's weights are on the device ledger, well under the whole model's
    assert 0 < st["device"]["ledger"]["predicted_bytes"] <= plan["split_bytes"]


def test_a_request_is_served_split_flagged_with_the_reason(gw: GatewayProcess) -> None:
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        h = r.headers
        assert (h["x-spillover-route"], h["x-spillover-degraded"]) == ("split", "1"), (dict(h), gw.status())
        assert h["x-spillover-reason"] == "resident_does_not_fit"
        sp = r.json()["spillover"]
        assert (sp["route"], sp["degraded"], sp["reason"], sp["attempts"]) == (
            "split",
            True,
            "resident_does_not_fit",
            1,
        )
        assert "GPU and CPU together" in sp["notice"]
        doc = http.get(f"/v1/requests/{h['x-spillover-request-id']}").json()
        assert doc["state"] == "completed"
        assert [x["route"] for x in doc["history"] if x["to"] == "admitted"] == ["split"]
        out = stream(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6})
        assert out["done"] and out["spillover"][0]["route"] == "split"
        assert out["headers"]["x-spillover-route"] == "split"
    row = gw.status()["services"][0]
    assert row["where"] == "split" and row["why"] == "resident_does_not_fit" and row["split_total"] >= 2
    assert gw.status()["device"]["ledger"]["request_reservations"] == 0  # every reservation came back


def test_a_split_worker_fault_replays_on_the_cpu_replica(gw: GatewayProcess) -> None:
    sim(gw).fail_next(1)  # the split worker's next allocation is refused
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-spillover-route"] == "cpu"
    assert r.headers["x-spillover-reason"] == "failover:alloc_failed"
    assert r.json()["spillover"]["attempts"] == 2


def test_a_failing_split_worker_opens_its_own_breaker(gw: GatewayProcess) -> None:
    """Allocations on the split worker keep failing: after the breaker's threshold its own
    breaker opens (status, reasons, metric), later requests go straight to the CPU replica
    (one attempt), and once the cooldown ends and the device allocates again a probe is served
    on the split worker again."""
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    sim(gw).fail_next(100)
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        for _ in range(4):  # the threshold (3), counting the previous test's failure
            r = http.post("/v1/completions", json=body)
            assert (r.status_code, r.headers["x-spillover-route"]) == (200, "cpu"), r.text
            if gw.status()["split_breaker"]["circuit"] == "open":
                break
        st = gw.status()
        assert st["split_breaker"]["circuit"] == "open" and st["split_breaker"]["worker_id"] == "split0"
        assert st["breaker"]["circuit"] == "closed" and "split breaker open" in st["reasons"]
        assert 'spillover_breaker_state{worker="split0"} 2.0' in http.get("/metrics").text
        r = http.post("/v1/completions", json=body)
        assert (r.status_code, r.headers["x-spillover-route"], r.json()["spillover"]["attempts"]) == (200, "cpu", 1)
        sim(gw).fail_next(0)
        deadline = time.monotonic() + 60
        while gw.status()["split_breaker"]["circuit"] == "open":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = http.post("/v1/completions", json=body)
        assert (r.status_code, r.headers["x-spillover-route"]) == (200, "split"), r.text
