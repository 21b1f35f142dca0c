"""The split profile with real workers and the real model: a sim device too small for the whole
model but large enough for part of it serves requests on a split worker (route split, flagged
degraded, with the reason), and a split worker's fault replays on the CPU replica."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import sim, stream

pytestmark = pytest.mark.e2e
SMALL_MIB = 160  # 128 MiB usable: SmolLM2 with a 2048-token request needs about 243 MiB


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    # A cooldown that outlasts a CPU replay and two status reads on a loaded machine: the
    # split breaker's test sends a request that must find the breaker still open.
    with GatewayProcess(["--gpu", f"sim:{SMALL_MIB}", "--split"], config={"breaker": {"cooldown_s": 6.0}}) as g:
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
    # before any request was decided, the row already says where one would start
    assert (st["services"][0]["where"], st["services"][0]["why"]) == ("split", "resident_does_not_fit")
    # the GPU lane's row shows the split worker's context, the longest it serves (round 33: the
    # resident's configured 2048, which does not run here)
    assert [(x["lane"], x["ctx_cap_tokens"]) for x in st["lanes"]] == [("gpu", 1024), ("cpu", 1024)], st["lanes"]


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
    ps = httpx.get(f"{gw.url}/api/ps").json()["models"][0]  # Ollama's view: layers on both sides
    assert ps["spillover"]["placement"] == "split" and 0 < ps["size_vram"] < ps["size"]
    assert gw.status()["device"]["ledger"]["request_reservations"] == 0  # every reservation came back


def test_a_request_longer_than_every_running_lane_is_refused_at_once(gw: GatewayProcess) -> None:
    """The resident GPU lane (2048 tokens) does not run on this device: a prompt past the split
    and CPU lanes' 1024 is the client's 400 context_length_exceeded, not a 503 to retry forever."""
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": "word " * 1400, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "any lane serves is 1024 tokens" in err["detail"]


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
        metrics = http.get("/metrics").text
        assert 'spillover_breaker_state{worker="split0"} 2.0' in metrics
        assert 'worker="gpu0"' not in metrics  # only the split runs on the device: no resident's breaker
        r = http.post("/v1/completions", json=body)
        assert (r.status_code, r.headers["x-spillover-route"], r.json()["spillover"]["attempts"]) == (200, "cpu", 1)
        sim(gw).fail_next(0)
        deadline = time.monotonic() + 60
        while gw.status()["split_breaker"]["circuit"] == "open":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = http.post("/v1/completions", json=body)
        assert (r.status_code, r.headers["x-spillover-route"]) == (200, "split"), r.text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpu", "sim:160", "--split-layers", "99999"], "[split].gpu_layers is 99999, but chat model"),
        (["--gpu", "sim:160", "--split-layers", "0"], "puts no layer on the device"),
        (["--gpu", "none", "--split"], "[split] needs a GPU device"),
    ],
)
def test_a_split_that_cannot_run_is_refused_at_start(tmp_path: Path, args: list[str], words: str) -> None:
    """A split asked for more layers than the model has, for none, or with no device: one line
    and exit status 2 before the server starts, not a quiet CPU profile."""
    cmd = [sys.executable, "-m", "spillover.cli", "serve", *args, "--port", "0", "--state-dir", str(tmp_path)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr[-2000:]
    assert words in got.stderr and "Traceback" not in got.stderr


def test_a_device_too_small_for_any_request_runs_no_resident_worker() -> None:
    """Without a split worker, a device whose room beside the weights holds not even a 1-token
    request (sim:160: 128 MiB usable, 92 MiB of weights, a request's buffers 53 more) is the cpu
    profile with nothing on the device: no resident worker holding weights it would never be
    admitted a request for, and the mode says why."""
    with GatewayProcess(["--gpu", "sim:160"]) as g:
        st = g.status()
        plan = st["services"][0]["profile"]
        assert plan["profile"] == "cpu" and "not even a 1-token request fits" in plan["why"]
        assert "split" not in plan["why"]
        assert [w["worker_id"] for w in st["workers"]] == ["cpu0"]
        assert st["device"]["ledger"]["predicted_bytes"] == 0
        # the GPU lane's row serves no context by plan (it showed the configured 2048)
        assert [(x["lane"], x["ctx_cap_tokens"]) for x in st["lanes"]] == [("gpu", 0), ("cpu", 1024)], st["lanes"]
        assert st["mode"] == "degraded" and any(r.startswith("cpu profile:") for r in st["reasons"])
        assert "gpu worker not ready" not in st["reasons"]
        r = httpx.post(f"{g.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert (r.status_code, r.headers["x-spillover-route"], r.headers["x-spillover-degraded"]) == (200, "cpu", "1")
        # not "GPU not available": the plan keeps the model off the device
        assert r.headers["x-spillover-reason"] == "resident_does_not_fit"
        # the replica is the only path (no device worker to fail over from): kept mmap, as without a GPU
        deadline = time.monotonic() + 30
        while (cr := g.status()["services"][0]["cpu_readiness"])["why"] != "no_gpu_lane":
            assert time.monotonic() < deadline, cr
            time.sleep(0.2)
        assert cr["mode"] == "mmap"


def test_a_request_longer_than_the_resident_can_ever_hold_is_a_400_or_shrinks_to_it() -> None:
    """Round 27: without a split worker, a device a little too small for one request at the GPU
    lane's cap runs the resident for the requests that fit (rule 4). One longer than the most
    it can ever hold, and than the CPU lane's cap, was a 503 "try again in a second", every
    time; it is a 400 naming the limit. With ``allow_shrink`` it shrinks to that limit (it was
    the same 503)."""
    with GatewayProcess(["--gpu", "sim:272", "--chat-only"]) as g:
        plan = g.status()["services"][0]["profile"]
        most = plan["resident_tokens"]
        assert plan["profile"] == "gpu" and f"requests up to about {most} tokens fit" in plan["why"], plan
        assert 1100 < most < 2048, plan  # past the CPU lane's cap (1024), short of the GPU lane's
        lanes = [(x["lane"], x["ctx_cap_tokens"]) for x in g.status()["lanes"]]
        assert lanes == [("gpu", most), ("cpu", 1024)], lanes  # the most it holds, not the configured 2048
        with httpx.Client(base_url=g.url, timeout=120) as http:
            prompt = " apple" * (most - 20)
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4 * most})
            n = int(r.json()["error"]["detail"].split(" in the prompt")[0].rsplit("(", 1)[1])  # its prompt's tokens
            over = {"prompt": prompt, "max_tokens": most - n + 1, "temperature": 0}
            r = http.post("/v1/completions", json=over)  # one token more than the resident holds
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert f"needs {most + 1} tokens ({n} in the prompt)" in r.json()["error"]["detail"]
            assert f"the longest context any lane serves is {most} tokens" in r.json()["error"]["detail"]
            r = http.post("/v1/completions", json=over | {"max_tokens": 100, "spillover": {"allow_shrink": True}})
            assert (r.status_code, r.headers["x-spillover-route"]) == (200, "gpu"), r.text
            sp = r.json()["spillover"]
            assert (sp["shrunk"], sp["limits"]["max_tokens"]) == (True, most - n), sp  # to the most it holds
            # Round 31: with less room left than the least a shrunk answer gets (16 tokens), a
            # request allowed to shrink was a 503 "try again in a second" that no retry passes.
            tight = {"prompt": prompt + " apple" * 10, "max_tokens": 100, "spillover": {"allow_shrink": True}}
            r = http.post("/v1/completions", json=tight)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert f"needs at least {n + 10 + 16} tokens ({n + 10} in the prompt, 16 to answer" in r.text, r.text
            assert most - (n + 10) < 16
            # Ollama's rule: a generation stops when its context is full. With less room than a
            # shrunk answer keeps, a num_predict past it was the 400 above; it runs to the cap.
            ollama = {"model": "smollm2", "prompt": tight["prompt"], "raw": True, "stream": False}
            r = http.post("/api/generate", json=ollama | {"options": {"num_predict": 100, "temperature": 0}})
            assert r.status_code == 200 and r.json()["done"], r.text
            a = r.json()
            assert a["prompt_eval_count"] == n + 10 and 1 <= a["eval_count"] <= most - (n + 10), a
            assert a["eval_count"] == most - (n + 10) or a["done_reason"] == "stop", a
            # cut, it says so as a shrunk OpenAI request does (it said shrunk: false); a num_predict
            # past any context is cut the same (it was a 400 naming max_tokens); null is not given
            assert (a["spillover"]["shrunk"], a["spillover"]["limits"]["max_tokens"]) == (True, most - (n + 10)), a
            huge = {"num_predict": 10**7, "num_ctx": None, "temperature": 0}
            r = http.post("/api/generate", json=ollama | {"options": huge})
            assert r.status_code == 200 and r.json()["spillover"]["limits"]["max_tokens"] == most - (n + 10), r.text
            # a prompt alone past its own limit needs one token more than the prompt, not num_predict more
            r = http.post("/api/generate", json=ollama | {"prompt": "Hi there", "options": {"num_ctx": 1}})
            assert r.status_code == 400 and r.json()["code"] == "context_length_exceeded", r.text
            assert r.json()["detail"].endswith("needs 3 tokens (2 in the prompt) but its own context limit is 1 token")
            # A client's own context limit (Ollama's num_ctx) is not a lane, and it holds for an
            # explicit num_predict: the output stopped past it (at num_predict), not at the limit.
            ollama = {"model": "smollm2", "prompt": " apple" * 55, "raw": True, "stream": False}
            r = http.post(
                "/api/generate", json=ollama | {"options": {"num_ctx": 64, "num_predict": 16, "temperature": 0}}
            )
            assert r.status_code == 200 and r.json()["done"], r.text
            a = r.json()
            assert 50 < a["prompt_eval_count"] < 64 and 1 <= a["eval_count"] <= 64 - a["prompt_eval_count"], a
            assert a["eval_count"] == 64 - a["prompt_eval_count"] or a["done_reason"] == "stop", a
            # the client's own limit cut it, not spillover's: not shrunk, no notice
            assert (a["spillover"]["shrunk"], a["spillover"]["notice"]) == (False, None), a
            # a null option is not given, whatever its name (as Ollama reads it: round 69, the ollama
            # client sends a dict's nulls), and an option that is never taken is refused when given
            r = http.post("/api/generate", json=ollama | {"options": {"num_gpu": None, "num_predict": 1}})
            assert r.status_code == 200, r.text
            r = http.post("/api/generate", json=ollama | {"options": {"num_gpu": 1}})
            assert r.status_code == 400 and r.json()["param"] == "options.num_gpu", r.text


def test_a_request_longer_than_the_split_runs_there_shrunk_when_it_allows_it(gw: GatewayProcess) -> None:
    """Past the split worker's context cap: with ``allow_shrink`` the request runs on the idle
    split worker with fewer tokens, flagged shrunk (before, on the CPU lane as 'GPU not
    available'). Without it, here, it is longer than every lane (400)."""
    body = {"prompt": "Hi", "max_tokens": 1500, "temperature": 0}
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        r = http.post("/v1/completions", json=body | {"spillover": {"allow_shrink": True}})
        assert r.status_code == 200, r.text
        sp = r.json()["spillover"]
        assert (sp["route"], sp["shrunk"], r.headers["x-spillover-route"]) == ("split", True, "split"), sp
        assert sp["limits"]["max_tokens"] < 1500
        r = http.post("/v1/completions", json=body | {"max_tokens": 1100})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_the_plan_fits_in_the_room_other_services_keep() -> None:
    """Round 49a: the plan counted the whole device (268 of sim:300) while other services kept
    161 MiB of it, and a request the plan said the resident held got a 503 every time. An
    interactive embeddings service keeps its weights (a chat model demotes only batch ones):
    the chat model plans in what it leaves, and says so."""
    with GatewayProcess(
        ["--gpu", "sim:300", "--split"],
        services=("chat", "embeddings"),
        config={"services": [{"name": "bge-small-en", "priority": "interactive"}]},
    ) as g:
        st = g.status()
        chat = next(s for s in st["services"] if s.get("profile"))
        plan = chat["profile"]
        assert plan["usable_bytes"] <= (268 - 40) * 2**20, plan  # bge-small-en keeps about 47 MiB
        assert "MiB kept by bge-small-en" in plan["why"], plan
        # all layers with a 2048-token request (243 MiB) no longer fit beside it
        assert not (plan["profile"] == "gpu" and plan["resident_tokens"] == 2048), plan
