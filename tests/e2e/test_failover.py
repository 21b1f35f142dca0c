"""Failover on the sim device with real worker processes: nothing accepted is lost,
nothing the client saw is changed."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import COUNT_PROMPT, kill_worker, ready_worker, sim, stream, stream_killing_gpu, wait_for

pytestmark = pytest.mark.e2e
CONFIG = {
    "failover": {"stall_timeout_s": 3.0},
    "breaker": {"cooldown_s": 1.5, "cooldown_max_s": 3.0, "close_after_successes": 2},
}


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """A gateway on a 1 GiB sim GPU (1 slot) and a CPU replica, short stall bound."""
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1"], config=CONFIG) as g:
        yield g


def test_a_allocation_failure_before_generation_replays_on_cpu(gw: GatewayProcess, http: httpx.Client) -> None:
    """An injected allocation failure: completed on CPU, same id, attempt 2, flagged degraded."""
    sim(gw).fail_next(1)
    r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    sp = r.json()["spillover"]
    assert sp["route"] == "cpu" and sp["attempts"] == 2 and sp["degraded"] is True
    assert r.headers["x-spillover-degraded"] == "1" and r.headers["x-spillover-reason"] == "failover:alloc_failed"
    rid = r.headers["x-spillover-request-id"]
    assert r.json()["id"] == f"cmpl-{rid}"
    doc = http.get(f"/v1/requests/{rid}").json()
    assert doc["state"] == "completed" and doc["attempts"] == 2
    assert [h["route"] for h in doc["history"] if h["to"] == "admitted"] == ["gpu", "cpu"]


def test_b_gpu_worker_killed_mid_non_stream_request_completes_on_cpu(gw: GatewayProcess, http: httpx.Client) -> None:
    """SIGKILL of the GPU worker during a non-stream request: the answer comes from CPU."""
    ref = http.post("/v1/completions", json={"prompt": COUNT_PROMPT, "max_tokens": 120, "temperature": 0})
    assert ref.headers["x-spillover-route"] == "gpu"
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r", http.post("/v1/completions", json={"prompt": COUNT_PROMPT, "max_tokens": 120, "temperature": 0})
        )
    )
    before = gw.worker("gpu")["progress_tokens"]
    t.start()
    wait_for(lambda: gw.worker("gpu")["progress_tokens"] > before + 10, 30, "gpu generating")
    kill_worker(gw, "gpu")
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["spillover"]["route"] == "cpu" and r.json()["spillover"]["attempts"] == 2
    assert r.headers["x-spillover-reason"] == "failover:crash"
    assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]  # greedy, same model


def test_c_mid_stream_kill_greedy_continues_identically(gw: GatewayProcess, http: httpx.Client) -> None:
    """Killing the GPU worker mid-stream (greedy): one stream, equal to an uninterrupted run,
    with a spillover chunk announcing the route change."""
    body = {"prompt": COUNT_PROMPT, "max_tokens": 150, "temperature": 0}
    ref = stream(http, "/v1/completions", body)
    assert ref["done"] and ref["spillover"][0]["route"] == "gpu"
    got = stream_killing_gpu(gw, http, body, at=10)
    assert got["error"] is None and got["done"]
    assert got["text"] == ref["text"]
    routes = [s["route"] for s in got["spillover"]]
    assert routes[0] == "gpu" and routes[-1] == "cpu"
    assert got["spillover"][-1]["reason"] == "failover:crash" and got["spillover"][-1]["attempts"] == 2


def test_d_mid_stream_kill_with_sampling_ends_in_resumable_error(gw: GatewayProcess, http: httpx.Client) -> None:
    """With temperature > 0 the continuation cannot be proven identical: a typed resumable
    error event that carries the request id, which stays retrievable."""
    body = {"prompt": COUNT_PROMPT, "max_tokens": 200, "temperature": 0.8, "seed": 7}
    got = stream_killing_gpu(gw, http, body, at=10)
    err = got["error"]
    assert err is not None and err["code"] == "failover_interrupted"
    assert err["request_id"] == got["headers"]["x-spillover-request-id"]
    assert err["tokens_delivered"] >= 10  # a frame carries one token or more
    doc = http.get(f"/v1/requests/{err['request_id']}").json()
    assert doc["state"] == "resumable_error" and "failover_interrupted" in doc["response"]


def test_e_a_sampled_stream_whose_text_was_all_held_back_is_replayed_from_its_start(
    gw: GatewayProcess, http: httpx.Client
) -> None:
    """A stop string that the answer's first 150 characters begin (and never complete) holds
    their text back: the GPU worker killed after 10 of those tokens had sent the client
    nothing, so even a sampled stream is replayed on the CPU from its start (it was ended
    failover_interrupted): one whole answer, no error, the route change announced."""
    body = {"prompt": COUNT_PROMPT, "max_tokens": 160, "temperature": 0.8, "seed": 7}
    ref = stream(http, "/v1/completions", body)
    assert ref["done"] and len(ref["text"]) > 160, ref
    held = {**body, "stop": [ref["text"][:150] + "\u0001"]}  # the model never writes \u0001
    ready_worker(gw, "gpu")
    before = gw.worker("gpu")["progress_tokens"]
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("got", stream(http, "/v1/completions", held)))
    t.start()
    wait_for(lambda: gw.worker("gpu")["progress_tokens"] > before + 10, 30, "gpu generating")
    kill_worker(gw, "gpu")
    t.join(120)
    got = result["got"]
    assert got["error"] is None and got["done"], got
    assert got["spillover"][-1]["route"] == "cpu" and got["spillover"][-1]["reason"] == "failover:crash", got
    assert got["text"] and got["text"].count(ref["text"][:40]) <= 1, got["text"][:300]  # nothing twice
    rid = got["headers"]["x-spillover-request-id"]
    assert http.get(f"/v1/requests/{rid}").json()["state"] == "completed"


def test_stall_is_detected_and_replayed_on_cpu(gw: GatewayProcess, http: httpx.Client) -> None:
    """A hung device (no token progress) is a stall: the request completes on CPU and the
    hung worker is restarted."""
    pid = ready_worker(gw, "gpu")["pid"]
    dev = sim(gw)
    dev.set_hang(True)
    try:
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-reason"] == "failover:stall"
        assert time.monotonic() - t0 >= 3.0
    finally:
        dev.set_hang(False)
    ready_worker(gw, "gpu", not_pid=pid)


def test_a_failover_that_fails_before_its_start_is_reported_where_it_failed(
    gw: GatewayProcess, http: httpx.Client
) -> None:
    """The GPU attempt fails (an allocation failure), the CPU replica takes the replay and hangs
    before its start (SIGSTOP: killed by its health pings): the error's route, the journal and
    /metrics name the attempt that failed (cpu, failover:alloc_failed), not the first one's (gpu,
    fits) (round 49b)."""
    cpu_pid = int(ready_worker(gw, "cpu")["pid"])
    ready_worker(gw, "gpu")
    os.kill(cpu_pid, signal.SIGSTOP)
    try:
        sim(gw).fail_next(1)
        r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(cpu_pid, signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert r.headers["x-spillover-route"] == "cpu", r.headers
    rid = r.headers["x-spillover-request-id"]
    doc = http.get(f"/v1/requests/{rid}").json()
    assert (doc["state"], doc["route"], doc["reason"], doc["attempts"]) == (
        "resumable_error",
        "cpu",
        "failover:alloc_failed",
        2,
    ), doc
    metrics = http.get("/metrics").text
    assert 'outcome="resumable_error",reason="failover:alloc_failed",route="cpu"' in metrics
    ready_worker(gw, "cpu", not_pid=cpu_pid)


def test_g_breaker_opens_routes_to_cpu_half_opens_and_closes() -> None:
    """A classified allocation failure opens the breaker; new work goes to CPU; after the
    cooldown it half-opens, probes succeed on the GPU, and it closes. Its own gateway, with a
    cooldown that outlasts the first request's CPU replay on a loaded machine (the module's
    1.5 s could pass before the second request, which then went to the GPU as a probe)."""
    config = {**CONFIG, "breaker": {**CONFIG["breaker"], "cooldown_s": 6.0, "cooldown_max_s": 12.0}}
    with (
        GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1"], config=config) as g,
        httpx.Client(base_url=g.url, timeout=120) as http,
    ):
        ready_worker(g, "gpu")
        sim(g).fail_next(1)
        first = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 4})
        assert first.headers["x-spillover-route"] == "cpu"
        assert g.status()["breaker"]["circuit"] == "open"
        second = http.post("/v1/completions", json={"prompt": "Two", "max_tokens": 4})
        assert second.headers["x-spillover-route"] == "cpu"
        assert second.headers["x-spillover-reason"] == "breaker_open"
        wait_for(lambda: g.status()["breaker"]["circuit"] == "half_open", 30, "half-open")
        routes = [
            http.post("/v1/completions", json={"prompt": "Three", "max_tokens": 4}).headers["x-spillover-route"]
            for _ in range(2)
        ]
        assert routes == ["gpu", "gpu"]
        assert g.status()["breaker"]["circuit"] == "closed"


def test_h_cpu_work_undisturbed_while_gpu_worker_restarts_five_times() -> None:
    """A long CPU request streams on, token after token, while the GPU worker is killed and
    restarted five times."""
    args = ["--gpu", "sim:1024", "--gpu-ctx", "64", "--cpu-ctx", "2048"]
    with GatewayProcess(args) as g, httpx.Client(base_url=g.url, timeout=300) as c:
        kills: list[int] = []
        done = threading.Event()

        def killer() -> None:
            pid = None
            while len(kills) < 5 and not done.is_set():
                pid = ready_worker(g, "gpu", not_pid=pid)["pid"]
                kill_worker(g, "gpu")
                kills.append(pid)

        th = threading.Thread(target=killer)

        def on_token(n: int) -> None:
            if n == 1:
                th.start()

        got = stream(
            c, "/v1/completions", {"prompt": COUNT_PROMPT, "max_tokens": 900, "temperature": 0}, on_token=on_token
        )
        done.set()
        th.join(120)
        assert got["error"] is None and got["done"], got
        assert [s["route"] for s in got["spillover"]] == ["cpu"]
        assert got["spillover"][0]["reason"] == "too_long_for_gpu"
        assert len(kills) == 5, f"only {len(kills)} GPU restarts happened during the CPU stream"
        assert g.worker("cpu")["starts"] == 1
