"""CPU replica readiness (warm / mmap / on_demand / auto) with real workers and the real model:
auto follows the recovery budget, an on_demand replica recovers a failover within the time it
measured, and the CPU worker holds what its mode says, as /v1/status reports it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import sim, wait_for

pytestmark = pytest.mark.e2e
PROMPT = "Hello! How are you today?"  # the replica's own first-token probe: this message, chat-templated
# What a failover adds to the replica's measured steps: the gateway's failover path (the
# fault's journal rows, re-queueing, dispatch) and the channel; on 2 busy cores, generous.
GATEWAY_SLACK_MS = 300.0


def readiness(gw: GatewayProcess) -> dict[str, Any]:
    row: dict[str, Any] = gw.status()["services"][0]["cpu_readiness"]
    return row


def settled(gw: GatewayProcess, mode: str) -> dict[str, Any]:
    """Wait until the replica was picked ``mode`` and reports holding it."""

    def done() -> dict[str, Any] | None:
        r = readiness(gw)
        return r if r["mode"] == mode and r["holding"] == mode and r["why"] != "not_measured" else None

    result: dict[str, Any] = wait_for(done, 30, f"CPU replica settled in {mode}")
    return result


def replica_in_ps(gw: GatewayProcess) -> int:
    """The CPU replica's bytes in /api/ps."""
    workers = httpx.get(gw.url + "/api/ps").json()["models"][0]["spillover"]["workers"]
    return int(next(w["size"] for w in workers if w["lane"] == "cpu"))


def gateway(readiness_mode: str, budget_ms: float = 1000.0) -> GatewayProcess:
    cfg = {"cpu_lane": {"readiness": readiness_mode, "recovery_budget_ms": budget_ms, "slots": 2}}
    return GatewayProcess(["--gpu", "sim:1024"], config=cfg)


def test_auto_keeps_warm_when_the_budget_is_tight_and_on_demand_when_it_is_loose() -> None:
    with gateway("auto", budget_ms=1.0) as gw:
        r = settled(gw, "warm")
        assert r["configured"] == "auto" and r["why"] == "no_mode_meets_budget" and not r["meets_budget"]
        assert r["model_loaded"] and r["contexts"] == 2  # the model and both slots' contexts
        rec = r["recovery_ms"]
        assert 0 < rec["warm"] <= rec["mmap"] <= rec["on_demand"]
        assert gw.status()["host"]["cpu_replica_bytes"] == r["host_bytes"] > 0
        assert replica_in_ps(gw) == r["host_bytes"]  # Ollama's view counts what it holds
    with gateway("auto", budget_ms=60_000.0) as gw:
        r = settled(gw, "on_demand")
        assert r["why"] == "cheapest_within_budget" and r["meets_budget"]
        assert not r["model_loaded"] and r["contexts"] == 0
        assert gw.status()["host"]["cpu_replica_bytes"] == 0 == r["host_bytes"]  # the guard counts nothing held
        assert replica_in_ps(gw) == 0  # nor does /api/ps
        # it still serves: the first CPU request loads the model, and the replica keeps it
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            ok = http.post(
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "spillover": {"prefer": "cpu"}},
            )
        assert ok.status_code == 200 and ok.headers["x-spillover-route"] == "cpu", ok.text
        r = wait_for(lambda: (x := readiness(gw))["model_loaded"] and x, 10, "model loaded")
        assert r["contexts"] == 1 and gw.status()["host"]["cpu_replica_bytes"] > 0


def test_a_budget_between_the_modes_picks_the_cheapest_that_meets_it() -> None:
    """The budget set halfway between two modes' measured figures (read from a first run)
    picks the cheapest mode that meets it by the second run's own figures: mmap, unless the
    second run measured differently (on two busy cores a figure can move by more than the
    gap), and then the mode those figures call for, never another. A new measurement is picked
    on at the next host reading, so the mode is read once it follows the figures it is shown
    with (a snapshot between the two showed mmap with figures that called for on_demand)."""
    with gateway("auto", budget_ms=1.0) as gw:
        rec = settled(gw, "warm")["recovery_ms"]
    budget = (rec["mmap"] + rec["on_demand"]) / 2  # mmap meets it, on_demand does not
    with gateway("auto", budget_ms=budget) as gw:
        seen: list[dict[str, Any]] = []

        def picked() -> dict[str, Any] | None:
            r = readiness(gw)
            seen.append(r)
            if r["mode"] != r["holding"] or r["why"] == "not_measured":
                return None
            now = r["recovery_ms"]
            return (
                r if r["mode"] == next((m for m in ("on_demand", "mmap", "warm") if now[m] <= budget), "warm") else None
            )

        try:
            r = wait_for(picked, 30, "CPU replica settled on the mode its figures call for")
        except TimeoutError:
            raise AssertionError((budget, rec, seen[-1])) from None
        if r["mode"] == "mmap":  # the usual case (the first run's figures held)
            assert r["why"] == "cheapest_within_budget" and r["model_loaded"] and r["contexts"] == 0


def test_on_demand_replica_recovers_within_its_measured_time() -> None:
    with gateway("on_demand") as gw, httpx.Client(base_url=gw.url, timeout=120) as http:
        before = settled(gw, "on_demand")
        assert before["why"] == "configured" and not before["model_loaded"] and before["contexts"] == 0
        predicted = before["recovery_ms"]["on_demand"]
        sim(gw).fail_next(1)  # the GPU worker's next allocation fails: the request replays on the CPU
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/chat/completions", json=chat)  # a chat request prefills what the probe did
        assert r.status_code == 200, r.text
        assert r.headers["x-spillover-route"] == "cpu"
        assert r.headers["x-spillover-reason"] == "failover:alloc_failed"
        after = readiness(gw)
        last = after["last_failover"]
        assert last is not None and last["mode"] == "on_demand"
        assert last["recovery_ms"] <= predicted + GATEWAY_SLACK_MS, (last, predicted)
        assert after["model_loaded"] and after["contexts"] == 1  # loaded by the failover, and kept
