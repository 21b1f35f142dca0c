"""What a request that says little gets: no max_tokens runs to the serving lane's context
limit; the operator's shrink_by_default fits a too-long max_tokens to the lane."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import ready_worker

pytestmark = pytest.mark.e2e
GPU_CTX, CPU_CTX = 384, 320
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """Small context caps (so running to the limit is quick) and shrink_by_default on."""
    args = ["--gpu", "sim:1024", "--gpu-ctx", str(GPU_CTX), "--cpu-ctx", str(CPU_CTX)]
    with GatewayProcess(args, config={"admission": {"shrink_by_default": True}}) as g:
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
