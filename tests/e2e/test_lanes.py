"""CPU lane and degraded mode: exact queue bounds, host-RAM guard, deadlines,
cancellation, degraded flags and metrics, on real processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from spillover.testing import GatewayProcess, tree_rss
from tests.e2e.helpers import COUNT_PROMPT, post_then_hang_up, ready_worker, stream, wait_for

pytestmark = pytest.mark.e2e
LONG = {"prompt": COUNT_PROMPT, "max_tokens": 120, "temperature": 0}


def test_exact_count_queue_sheds_k_immediately() -> None:
    """Queue depth Q=3 and concurrency C=1: Q + C + k requests give exactly k immediate
    503s with Retry-After, each within 50 ms; each is unknown (refused before acceptance) or
    journaled REJECTED (it raced the last place), never left unfinished."""
    q, c, k = 3, 1, 3
    with GatewayProcess(["--gpu", "none", "--cpu-slots", str(c)], config={"cpu_lane": {"queue_depth": q}}) as gw:
        results: list[tuple[int, float, dict[str, str]]] = []
        lock = threading.Lock()
        go = threading.Barrier(q + c + k)

        def one() -> None:
            with httpx.Client(base_url=gw.url, timeout=120) as cl:
                cl.get("/health")  # connected before the race: the time below is the gateway's
                go.wait()
                t0 = time.perf_counter()
                r = cl.post("/v1/completions", json=LONG)
                with lock:
                    results.append((r.status_code, time.perf_counter() - t0, dict(r.headers)))

        ts = [threading.Thread(target=one) for _ in range(q + c + k)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        shed = [x for x in results if x[0] == 503]
        assert len(shed) == k, [x[0] for x in results]
        assert all(x[1] < 0.050 for x in shed), [round(x[1], 4) for x in shed]
        assert all(int(x[2]["retry-after"]) >= 1 and "retry-after-ms" in x[2] for x in shed)
        assert sum(1 for x in results if x[0] == 200) == q + c
        with httpx.Client(base_url=gw.url, timeout=30) as cl:
            for x in shed:
                r = cl.get(f"/v1/requests/{x[2]['x-spillover-request-id']}")
                assert r.status_code == 404 or r.json()["state"] == "rejected", r.text


def test_a_full_queue_refuses_before_accepting() -> None:
    """With the CPU lane's slot and its one queue place taken, the next request gets 503 at
    once and nothing of it is journaled (its id is unknown); the other two complete."""
    with GatewayProcess(["--gpu", "none", "--cpu-slots", "1"], config={"cpu_lane": {"queue_depth": 1}}) as gw:
        codes: list[int] = []

        def one() -> None:
            codes.append(httpx.post(f"{gw.url}/v1/completions", json=LONG, timeout=300).status_code)

        ts = [threading.Thread(target=one) for _ in range(2)]
        for t in ts:
            t.start()
            time.sleep(0.2)
        wait_for(lambda: any(len(lane["queued"]) == 1 for lane in gw.status()["lanes"]), 30, "the queue full")
        with httpx.Client(base_url=gw.url, timeout=30) as cl:
            r = cl.post("/v1/completions", json=LONG)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
            assert cl.get(f"/v1/requests/{r.headers['x-spillover-request-id']}").status_code == 404
        for t in ts:
            t.join(300)
        assert codes == [200, 200]
        too_long = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 5000}, timeout=30)
        assert too_long.status_code == 400, too_long.text
        headers = {"content-type": "application/json"}
        not_json = httpx.post(f"{gw.url}/v1/chat/completions", content=b"{nope", headers=headers, timeout=30)
        too_big = httpx.post(f"{gw.url}/v1/embeddings", content=b" " * (2 << 20), headers=headers, timeout=30)
        assert (not_json.status_code, too_big.status_code) == (400, 413), (not_json.text, too_big.text)
        # refused before acceptance, yet counted once each with its reason (they were not counted),
        # the body's own refusals too
        metrics = httpx.get(f"{gw.url}/metrics").text
        for reason in ("queue_full", "context_length_exceeded", "invalid_request", "payload_too_large"):
            assert f'spillover_requests_total{{outcome="rejected",reason="{reason}",route="none"}} 1.0' in metrics


def overload_peak_rss(guard: bool, budget_mib: int) -> tuple[int, dict[str, Any]]:
    """Peak RSS of gateway + workers under 10x overload of a 12-slot CPU lane."""
    cfg = {"device": {"host_guard": guard, "host_budget_mib": budget_mib}, "cpu_lane": {"queue_depth": 64}}
    with GatewayProcess(["--gpu", "none", "--cpu-slots", "12", "--cpu-ctx", "2048"], config=cfg) as gw:
        assert gw.proc is not None
        pid = gw.proc.pid
        peak = [0]
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], tree_rss(pid))
                time.sleep(0.03)

        sam = threading.Thread(target=sampler)
        sam.start()

        def one() -> None:
            httpx.post(
                gw.url + "/v1/completions", json={"prompt": "Hello, how are you?", "max_tokens": 16}, timeout=300
            )

        ts = [threading.Thread(target=one) for _ in range(120)]  # 10x the 12 slots
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        stop.set()
        sam.join()
        return peak[0], gw.status()["host"]


@pytest.mark.timeout(900)
def test_host_ram_guard_keeps_peak_rss_under_budget_and_negative_control_fails() -> None:
    """With the guard, 10x overload stays under a 600 MiB host budget; the same run with
    the guard disabled goes over it (so the check can fail)."""
    budget = 600
    peak, host = overload_peak_rss(True, budget)
    assert peak < budget * 2**20, f"peak {peak / 2**20:.0f} MiB over the {budget} MiB budget"
    assert host["peak_rss_bytes"] < budget * 2**20
    unguarded, _ = overload_peak_rss(False, budget)
    assert unguarded > budget * 2**20, f"negative control stayed at {unguarded / 2**20:.0f} MiB"


def test_deadline_that_cpu_cannot_meet_is_refused_at_once() -> None:
    """A request whose estimated CPU completion exceeds its deadline gets an immediate 503."""
    with GatewayProcess(["--gpu", "none"]) as gw, httpx.Client(base_url=gw.url, timeout=60) as c:
        c.get("/health")  # connected: the time below is the refusal's
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={**LONG, "max_tokens": 500, "spillover": {"deadline_ms": 50}})
        assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_exceeded"
        assert time.perf_counter() - t0 < 0.5 and int(r.headers["retry-after"]) >= 1
        # accepted, then refused as it was queued: its error names it (round 54a: it had the
        # body of a refusal before acceptance, with no request_id), as the journal does
        rid = r.headers["x-spillover-request-id"]
        assert r.json()["error"]["request_id"] == rid
        assert c.get(f"/v1/requests/{rid}").json()["state"] == "rejected"
        r = c.post("/v1/completions", json={**LONG, "max_tokens": 500}, headers={"X-Spillover-Deadline-Ms": "50"})
        assert r.status_code == 503
        ok = c.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers={"X-Spillover-Deadline-Ms": "60000"}
        )
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """Sim GPU (1 slot) plus a 1-slot CPU lane."""
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1", "--cpu-slots", "1"]) as g:
        yield g


def journal_state(c: httpx.Client, rid: str) -> str:
    return str(c.get(f"/v1/requests/{rid}").json()["state"])


def test_disconnect_while_queued_on_cpu_frees_its_place(gw: GatewayProcess) -> None:
    """A client that goes away while its request waits on the CPU lane frees the queue
    place within 1 s, and the journal says RESUMABLE_ERROR (client_disconnected: a retry with
    its key runs it; only a DELETE cancels)."""
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        hold = threading.Thread(
            target=lambda: c.post("/v1/completions", json={**LONG, "max_tokens": 400, "spillover": {"prefer": "cpu"}})
        )
        hold.start()
        wait_for(lambda: gw.worker("cpu")["busy"] == 1, 30, "cpu busy")
        th = threading.Thread(
            target=post_then_hang_up, args=(gw.url, "/v1/completions", {**LONG, "spillover": {"prefer": "cpu"}}, 1.0)
        )
        th.start()
        queued = wait_for(
            lambda: next(
                (lane["queued"] for lane in gw.status()["lanes"] if lane["lane"] == "cpu" and lane["queued"]), None
            ),
            10,
            "queued",
        )
        rid = queued[0]["rid"]
        th.join(10)
        t0 = time.monotonic()
        wait_for(lambda: not any(lane["queued"] for lane in gw.status()["lanes"]), 5, "queue emptied")
        assert time.monotonic() - t0 < 1.0
        wait_for(lambda: journal_state(c, rid) == "resumable_error", 5, "journal resumable_error")
        hold.join(120)


def test_disconnect_while_generating_frees_slot_and_reservation(gw: GatewayProcess) -> None:
    """A streaming client that disconnects mid-generation frees the GPU slot and its
    device reservation within 1 s; the journal says RESUMABLE_ERROR (client_disconnected), and
    the same request sent again with its Idempotency-Key runs once more, whole, under the same
    id (a dropped connection is what the key is for: it answered 409 request_cancelled, for
    ever)."""
    ready_worker(gw, "gpu")
    body = {**LONG, "max_tokens": 400, "stream": True, "temperature": 0}
    key = {"Idempotency-Key": f"dropped-{time.monotonic_ns()}"}
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        weights = gw.status()["device"]["ledger"]["predicted_bytes"]
        with c.stream("POST", "/v1/completions", json=body, headers=key) as r:
            rid = r.headers["x-spillover-request-id"]
            assert r.headers["x-spillover-route"] == "gpu"
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:  # generating: its pages are reserved
                    assert gw.status()["device"]["ledger"]["predicted_bytes"] > weights
                if i > 10:
                    break  # leaving iter_lines closes the connection: the client is gone
        t0 = time.monotonic()
        wait_for(
            lambda: gw.worker("gpu")["busy"] == 0 and gw.status()["device"]["ledger"]["predicted_bytes"] == weights,
            5,
            "freed",
        )
        assert time.monotonic() - t0 < 1.0
        wait_for(lambda: journal_state(c, rid) == "resumable_error", 5, "journal resumable_error")
        assert "client_disconnected" in c.get(f"/v1/requests/{rid}").json()["response"]  # its stored answer
        with c.stream("POST", "/v1/completions", json=body, headers=key) as again:
            assert again.status_code == 200 and again.headers["x-spillover-request-id"] == rid
            lines = again.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            live = c.get(f"/v1/requests/{rid}").json()  # the resumed run: not the dropped attempt's answer
            assert live["state"] != "completed" and not live["response"] and live["status_code"] is None, live
            text = "\n".join([first, *lines])
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
        doc = c.get(f"/v1/requests/{rid}").json()
        assert doc["state"] == "completed" and doc["attempts"] == 2, doc


def test_delete_by_id_cancels_a_running_request(gw: GatewayProcess) -> None:
    """DELETE /v1/requests/{id} stops a running request: the client gets 409
    request_cancelled, the slot and reservation are free within 1 s. Before that, GET
    shows the live request as far as it got (its noted moves, journal rule 7, included)."""
    ready_worker(gw, "gpu")
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        weights = gw.status()["device"]["ledger"]["predicted_bytes"]
        out: dict[str, Any] = {}
        th = threading.Thread(
            target=lambda: out.setdefault("r", c.post("/v1/completions", json={**LONG, "max_tokens": 400}))
        )
        th.start()
        rid = wait_for(
            lambda: next((x["rid"] for x in gw.status()["running"] if x["route"] == "gpu"), None),
            30,
            "running on the GPU",
        )
        live = c.get(f"/v1/requests/{rid}").json()
        assert live["live"] and live["state"] in ("admitted", "running"), live
        steps = [h["to"] for h in live["history"]]
        assert steps == ["accepted", "queued", "admitted"] + ["running"] * (live["state"] == "running"), live
        t0 = time.monotonic()
        doc = c.delete(f"/v1/requests/{rid}").json()
        th.join(30)
        assert doc["state"] == "cancelled"
        wait_for(
            lambda: gw.worker("gpu")["busy"] == 0 and gw.status()["device"]["ledger"]["predicted_bytes"] == weights,
            5,
            "freed",
        )
        assert time.monotonic() - t0 < 1.0
        assert out["r"].status_code == 409 and out["r"].json()["error"]["code"] == "request_cancelled"


def test_delete_during_a_long_prefill_frees_the_slot_at_once(gw: GatewayProcess) -> None:
    """A request cancelled while its long prompt is being evaluated stops inside that decode
    (``Engine.abort``): its slot and reservation are free within 1 s, where the prompt
    alone takes seconds here (measured first, on the same worker: a prompt too quick to tell a
    stopped decode from its end fails the test, as it would prove nothing)."""
    ready_worker(gw, "gpu")
    body = {"prompt": " ".join(f"item {i} of the list," for i in range(200)), "max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "gpu", r.text
        whole = time.monotonic() - t0
        assert whole >= 2.5, f"the prompt takes {whole:.1f}s here: too quick to tell a stopped decode from its end"
        weights = gw.status()["device"]["ledger"]["predicted_bytes"]
        th = threading.Thread(target=lambda: c.post("/v1/completions", json=body))
        th.start()
        rid = wait_for(
            lambda: next((x["rid"] for x in gw.status()["running"] if x["route"] == "gpu"), None),
            30,
            "running on the GPU",
        )
        time.sleep(0.3)  # inside the prompt's evaluation
        t1 = time.monotonic()
        assert c.delete(f"/v1/requests/{rid}").json()["state"] == "cancelled"
        wait_for(
            lambda: gw.worker("gpu")["busy"] == 0 and gw.status()["device"]["ledger"]["predicted_bytes"] == weights,
            whole,
            "freed",
        )
        freed = time.monotonic() - t1
        th.join(30)
        assert freed < 1.0, f"freed {freed:.2f}s after the cancel; the prompt alone takes {whole:.1f}s"


def test_degraded_flags_exact_over_a_mixed_run(gw: GatewayProcess) -> None:
    """Every response served by CPU says X-Spillover-Degraded: 1 (header and body), none
    served by GPU does: zero missing and zero false flags."""
    ready_worker(gw, "gpu")
    routes: list[tuple[str, str, bool]] = []
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        bodies = [
            {"prompt": "Hi", "max_tokens": 4},
            {"prompt": "Hi", "max_tokens": 4, "spillover": {"prefer": "cpu"}},
            {"prompt": "word " * 1100, "max_tokens": 4},  # longer than the GPU lane? no: fits both caps
            {"prompt": "Hello", "max_tokens": 6, "stream": True},
            {"prompt": "Hello", "max_tokens": 6, "stream": True, "spillover": {"prefer": "cpu"}},
        ]
        for body in bodies * 2:
            if body.get("stream"):
                got = stream(c, "/v1/completions", body)
                routes.append(
                    (
                        got["headers"]["x-spillover-route"],
                        got["headers"]["x-spillover-degraded"],
                        got["spillover"][0]["degraded"],
                    )
                )
            else:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                routes.append(
                    (
                        r.headers["x-spillover-route"],
                        r.headers["x-spillover-degraded"],
                        r.json()["spillover"]["degraded"],
                    )
                )
    assert {r for r, _, _ in routes} == {"gpu", "cpu"}
    for route, header, body_flag in routes:
        assert (header == "1") == (route == "cpu") == body_flag


def test_metrics_exposes_conventional_names(gw: GatewayProcess) -> None:
    """/metrics speaks Prometheus text with spillover_ names in base units."""
    text = httpx.get(gw.url + "/metrics").text
    for name in (
        "spillover_requests_total",
        "spillover_queue_depth",
        "spillover_device_memory_bytes",
        "spillover_breaker_state",
        "spillover_request_duration_seconds_bucket",
        "spillover_time_to_first_token_seconds_bucket",
        "spillover_generated_tokens_total",
        "spillover_admission_decisions_total",
        "spillover_host_memory_bytes",
    ):
        assert name in text, name
    assert 'spillover_requests_total{outcome="completed",reason="fits",route="gpu"}' in text
