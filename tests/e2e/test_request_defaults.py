"""What a request that says little gets: no max_tokens runs to the serving lane's context
limit; the operator's shrink_by_default fits a too-long max_tokens to the lane; with
degraded_notice a person sees, in the answer itself, that it was served degraded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from spillover.config import DEFAULT_MODEL_NAME
from spillover.testing import GatewayProcess
from tests.e2e.helpers import ready_worker

pytestmark = pytest.mark.e2e
GPU_CTX, CPU_CTX = 384, 320
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """Small context caps (so running to the limit is quick), shrink_by_default and
    degraded_notice on."""
    args = ["--gpu", "sim:1024", "--gpu-ctx", str(GPU_CTX), "--cpu-ctx", str(CPU_CTX)]
    cfg = {"admission": {"shrink_by_default": True}, "server": {"degraded_notice": True}}
    with GatewayProcess(args, config=cfg) as g:
        yield g


def complete(gw: GatewayProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", json={"prompt": COUNT, "temperature": 0, **body}, timeout=120)


@pytest.mark.parametrize(("lane", "ctx"), [("gpu", GPU_CTX), ("cpu", CPU_CTX)])
def test_no_max_tokens_runs_to_the_serving_lanes_context_limit(gw: GatewayProcess, lane: str, ctx: int) -> None:
    """Without max_tokens the answer runs until the context of the lane that serves it is
    full (finish_reason length), past the old fixed 256 on the GPU, and the CPU lane takes
    it (no too_long_for_cpu) with its own smaller limit."""
    ready_worker(gw, lane)
    r = complete(gw, spillover={"prefer": "cpu"}) if lane == "cpu" else complete(gw)
    assert r.status_code == 200, r.text
    doc = r.json()
    usage, sp = doc["usage"], doc["spillover"]
    assert sp["route"] == lane and doc["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == ctx, (usage, sp)
    assert sp["shrunk"] is False  # nothing was asked, so nothing was shrunk


def test_the_openai_client_without_max_tokens_runs_past_the_old_256_cap(gw: GatewayProcess) -> None:
    """The official openai client sends no max_tokens when it is not given: the answer then
    runs to the serving lane's context limit (OpenAI's meaning), not a fixed 256. On this
    gateway's 384-token GPU context that is past 256 in a few seconds; on the default 2048 it
    took over a minute of CI for the same proof."""
    ready_worker(gw, "gpu")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=COUNT, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens > 256, r.usage
    sp = (r.model_extra or {})["spillover"]
    assert sp["route"] == "gpu" and r.choices[0].finish_reason == "length", sp
    assert r.usage.prompt_tokens + r.usage.completion_tokens == GPU_CTX == sp["limits"]["ctx"], (r.usage, sp)


def test_shrink_by_default_fits_a_too_long_max_tokens_to_the_cpu_lane(gw: GatewayProcess) -> None:
    """With [admission].shrink_by_default, max_tokens=1000 on the 320-token CPU lane runs
    with the room there is (shrunk, and said so); a client that says allow_shrink=false
    still gets the 400."""
    ready_worker(gw, "cpu")
    r = complete(gw, max_tokens=1000, spillover={"prefer": "cpu"})
    assert r.status_code == 200, r.text
    doc = r.json()
    sp, usage = doc["spillover"], doc["usage"]
    assert sp["route"] == "cpu" and sp["shrunk"] is True and r.headers["x-spillover-degraded"] == "1"
    assert sp["limits"]["max_tokens"] == CPU_CTX - usage["prompt_tokens"], sp
    refused = complete(gw, max_tokens=1000, spillover={"prefer": "cpu", "allow_shrink": False})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded", refused.text


def chat(gw: GatewayProcess, **body: Any) -> httpx.Response:
    doc = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=doc, timeout=120)


def test_degraded_notice_is_appended_to_cpu_answers_only(gw: GatewayProcess) -> None:
    """A CPU answer ends with its one-line notice (body and stream), which is also
    spillover.notice; a GPU answer and a JSON answer get none."""
    ready_worker(gw, "cpu")
    line = f"answered on CPU: CPU asked for — slower, context {CPU_CTX}"
    cpu = chat(gw, spillover={"prefer": "cpu"}).json()
    assert cpu["spillover"]["notice"] == line
    assert cpu["choices"][0]["message"]["content"].endswith(f"\n\n_({line})_")
    lines = chat(gw, spillover={"prefer": "cpu"}, stream=True).text.splitlines()
    deltas = [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in lines if x.startswith("data: {")]
    assert deltas[-2] == f"\n\n_({line})_", deltas  # the last content, before the finish chunk
    ready_worker(gw, "gpu")
    gpu = chat(gw).json()
    assert gpu["spillover"]["route"] == "gpu" and gpu["spillover"]["notice"] is None
    assert "answered on" not in gpu["choices"][0]["message"]["content"]
    js = chat(gw, spillover={"prefer": "cpu"}, max_tokens=40, response_format={"type": "json_object"}).json()
    assert js["spillover"]["notice"] == line and "answered on" not in js["choices"][0]["message"]["content"]
