"""Readiness of the embeddings and transcription services' CPU replicas, with real workers and
real models: ``auto`` follows the service's recovery budget, an ``on_demand`` replica holds
nothing until a failover loads it (within the time it measured), the host-RAM guard counts
the model only while the replica holds it, and /v1/status says so in the service's row."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from spillover.testing import GatewayProcess
from spillover.testing.audio import speech_clip
from tests.e2e.helpers import sim, wait_for

pytestmark = pytest.mark.e2e
TEXT = "The cat sits on the mat."  # about as long as the replica's own probe (an empty text)
GATEWAY_SLACK_MS = 300.0  # the failover path and the channel on 2 busy cores (as for chat)


def row(gw: GatewayProcess, kind: str) -> dict[str, Any]:
    return next(s for s in gw.status()["services"] if s["kind"] == kind)


def settled(gw: GatewayProcess, kind: str, mode: str) -> dict[str, Any]:
    """The service's row once its replica was picked ``mode`` and reports holding it."""

    def done() -> dict[str, Any] | None:
        r = row(gw, kind)
        x = r["cpu_readiness"]
        return r if x["mode"] == mode and x["holding"] == mode and x["why"] != "not_measured" else None

    result: dict[str, Any] = wait_for(done, 60, f"{kind} CPU replica settled in {mode}")
    return result


def gateway(kind: str, **svc: Any) -> GatewayProcess:
    name = {"embeddings": "bge-small-en", "transcription": "whisper-tiny.en"}[kind]
    cfg = {"cpu_lane": {"readiness": "mmap"}, "services": [{"name": name, "kind": kind, **svc}]}  # chat held still
    return GatewayProcess(["--gpu", "sim:1024"], services=("chat", kind), config=cfg)


def embed(gw: GatewayProcess) -> httpx.Response:
    return httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": TEXT}, timeout=120)


def test_an_embeddings_replica_is_kept_warm_when_the_budget_is_tight() -> None:
    with gateway("embeddings", cpu_readiness="auto", recovery_budget_ms=1) as gw:
        r = settled(gw, "embeddings", "warm")
        x = r["cpu_readiness"]
        assert x["configured"] == "auto" and x["why"] == "no_mode_meets_budget" and not x["meets_budget"]
        assert x["model_loaded"] and x["contexts"] == 0  # one model, no per-request context
        t = x["timings_ms"]
        assert t["load_ms"] > 0 and t["first_ms"] > 0 and t["ctx_ms"] == 0
        rec, steps = x["recovery_ms"], x["predicted_steps_ms"]
        assert steps["load_ms"] >= t["load_ms"] and steps["first_ms"] >= t["first_ms"]  # the slowest of the latest
        assert rec["warm"] == rec["mmap"] == pytest.approx(steps["first_ms"], abs=0.2)
        assert rec["on_demand"] == pytest.approx(steps["load_ms"] + steps["first_ms"], abs=0.2)


def test_an_on_demand_embeddings_replica_loads_at_a_failover_within_its_measured_time() -> None:
    """Budget loose: auto keeps the replica on_demand (nothing held, nothing counted). A GPU
    allocation failure replays the request on it: it loads the model, answers the vectors the
    GPU gave, within its measured recovery, and keeps the model (counted by the guard)."""
    with gateway("embeddings", cpu_readiness="auto", recovery_budget_ms=60_000) as gw:
        r = settled(gw, "embeddings", "on_demand")
        x = r["cpu_readiness"]
        assert x["why"] == "cheapest_within_budget" and x["meets_budget"] and not x["model_loaded"]
        predicted = x["recovery_ms"]["on_demand"]
        ref = embed(gw)
        assert ref.status_code == 200 and ref.headers["x-spillover-route"] == "gpu", ref.text
        before = gw.status()["host"]["cpu_replica_bytes"]
        sim(gw).fail_next(1)  # the GPU worker's next allocation fails: the request replays on the CPU
        got = embed(gw)
        assert got.status_code == 200, got.text
        assert got.headers["x-spillover-route"] == "cpu"
        assert got.headers["x-spillover-reason"] == "failover:alloc_failed"
        assert np.allclose(got.json()["data"][0]["embedding"], ref.json()["data"][0]["embedding"], atol=1e-5)
        x = row(gw, "embeddings")["cpu_readiness"]
        last = x["last_failover"]
        assert last is not None and last["mode"] == "on_demand"
        assert last["recovery_ms"] <= predicted + GATEWAY_SLACK_MS, (last, predicted)
        assert x["model_loaded"] and x["holding"] == "on_demand"  # loaded by the failover, and kept
        assert gw.status()["host"]["cpu_replica_bytes"] == before + r["weights_bytes"]


def test_an_on_demand_transcription_replica_loads_the_model_at_a_failover() -> None:
    """A configured on_demand Whisper replica holds nothing; a GPU fault replays the upload on
    it, which loads the model first (its recovery includes the load) and gives the GPU's text."""
    clip = speech_clip()

    def post(gw: GatewayProcess) -> httpx.Response:
        return httpx.post(
            gw.url + "/v1/audio/transcriptions",
            data={"model": "whisper-1"},
            files={"file": ("clip.wav", clip, "audio/wav")},
            timeout=300,
        )

    with gateway("transcription", cpu_readiness="on_demand", aliases=["whisper-1"]) as gw:
        x = settled(gw, "transcription", "on_demand")["cpu_readiness"]
        assert x["why"] == "configured" and not x["model_loaded"]
        load_ms = x["timings_ms"]["load_ms"]
        ref = post(gw)
        assert ref.status_code == 200 and ref.headers["x-spillover-route"] == "gpu", ref.text
        sim(gw).fail_next(1)
        got = post(gw)
        assert got.status_code == 200, got.text
        assert (
            got.headers["x-spillover-route"] == "cpu" and got.headers["x-spillover-reason"] == "failover:alloc_failed"
        )
        assert got.json()["text"] == ref.json()["text"]
        x = row(gw, "transcription")["cpu_readiness"]
        assert x["model_loaded"] and x["last_failover"]["mode"] == "on_demand"
        # the failover waited for a load: at least as long as the model's last measured load
        assert x["last_failover"]["recovery_ms"] >= 0.5 * min(load_ms, x["timings_ms"]["load_ms"])
