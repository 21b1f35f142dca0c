"""A configured fallback model on the CPU lane: used at request boundaries, always labelled
degraded with its own name, never used to continue a stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from spillover.config import default_model_path
from spillover.testing import GatewayProcess
from spillover.testing.gguf_factory import TinyLlamaSpec, write_tiny_llama
from tests.e2e.helpers import COUNT_PROMPT, sim, stream, stream_killing_gpu

pytestmark = pytest.mark.e2e
MAIN = "smollm2-135m-instruct"
FALLBACK = "tiny-fallback"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway whose CPU lane serves a different, tiny model (SmolLM2's vocabulary, random
    weights, no chat template: so its chat prompts differ from the main model's)."""
    path = write_tiny_llama(
        Path(tmp_path_factory.mktemp("fallback")) / "tiny.gguf",
        default_model_path(),
        TinyLlamaSpec(n_layers=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_ctx_train=2048, name=FALLBACK),
        chat_template=False,
    )
    cfg = {
        "model": {"fallback_path": str(path), "fallback_name": FALLBACK},
        "breaker": {"cooldown_s": 1.5, "cooldown_max_s": 3.0, "close_after_successes": 2},
    }
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1"], config=cfg) as g:
        yield g


def test_status_names_the_fallback_and_answers_say_which_model_served(gw: GatewayProcess, http: httpx.Client) -> None:
    """GPU answers name the main model and are not degraded; CPU-lane answers name the
    fallback model (header, body, spillover object), are flagged degraded and count the
    prompt in the fallback model's own tokens."""
    fb = gw.status()["fallback_model"]
    assert fb["name"] == FALLBACK and fb["lane"] == "cpu"
    gpu = http.post("/v1/chat/completions", json=CHAT)
    cpu = http.post("/v1/chat/completions", json={**CHAT, "spillover": {"prefer": "cpu"}})
    assert gpu.status_code == cpu.status_code == 200, (gpu.text, cpu.text)
    assert gpu.headers["x-spillover-route"] == "gpu" and gpu.headers["x-spillover-degraded"] == "0"
    assert gpu.headers["x-spillover-model"] == MAIN and gpu.json()["model"] == MAIN
    assert gpu.json()["spillover"]["fallback"] is False
    assert cpu.headers["x-spillover-route"] == "cpu" and cpu.headers["x-spillover-degraded"] == "1"
    assert cpu.headers["x-spillover-model"] == FALLBACK and cpu.json()["model"] == FALLBACK
    sp = cpu.json()["spillover"]
    assert sp["model"] == FALLBACK and sp["fallback"] is True and sp["degraded"] is True
    # No chat template in the fallback file: a different prompt, in its own tokens.
    assert cpu.json()["usage"]["prompt_tokens"] != gpu.json()["usage"]["prompt_tokens"]
    got = stream(http, "/v1/chat/completions", {**CHAT, "spillover": {"prefer": "cpu"}})
    assert got["done"] and got["error"] is None
    assert got["headers"]["x-spillover-model"] == FALLBACK
    assert got["spillover"][0]["model"] == FALLBACK and got["spillover"][0]["degraded"] is True


def test_allocation_failure_replays_on_the_fallback(gw: GatewayProcess, http: httpx.Client) -> None:
    """Nothing delivered yet: the request is replayed on the fallback model (attempt 2),
    labelled degraded and named."""
    sim(gw).fail_next(1)
    r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-spillover-reason"] == "failover:alloc_failed"
    assert r.headers["x-spillover-model"] == FALLBACK and r.headers["x-spillover-degraded"] == "1"
    sp = r.json()["spillover"]
    assert sp["attempts"] == 2 and sp["route"] == "cpu" and sp["fallback"] is True


def test_greedy_stream_is_never_continued_on_the_fallback(gw: GatewayProcess, http: httpx.Client) -> None:
    """Even a greedy stream killed mid-way is not continued on a different model: it ends
    with the typed resumable error, and no token after the kill comes from the fallback."""
    got = stream_killing_gpu(gw, http, {"prompt": COUNT_PROMPT, "max_tokens": 200, "temperature": 0}, at=10)
    err = got["error"]
    assert err is not None and err["code"] == "failover_interrupted", got
    assert all(sp["route"] == "gpu" for sp in got["spillover"])
    doc = http.get(f"/v1/requests/{err['request_id']}").json()
    assert doc["state"] == "resumable_error"
