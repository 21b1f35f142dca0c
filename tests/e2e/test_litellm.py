"""litellm with the ``openai/`` prefix against spillover, unchanged (real model)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e
MODEL = "openai/smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def litellm() -> Any:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # its bundled price table: no network
    import litellm as lib

    return lib


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "sim:1024"]) as g:
        yield g


def test_completion_stream_and_the_spillover_object(litellm: Any, gw: GatewayProcess) -> None:
    """litellm.completion (plain and streamed) gets the same greedy text, and the response
    keeps spillover's object (route, degraded)."""
    kw: dict[str, Any] = dict(
        model=MODEL, api_base=gw.url + "/v1", api_key="none", messages=ASK, max_tokens=8, temperature=0
    )
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens == 8
    assert r.spillover["route"] == "gpu" and r.spillover["degraded"] is False
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    assert streamed == text


def test_json_mode_and_a_refused_field_reach_the_caller(litellm: Any, gw: GatewayProcess) -> None:
    """response_format passes through litellm and is enforced; a refused field is litellm's
    BadRequestError carrying spillover's message (not a silent drop)."""
    kw: dict[str, Any] = dict(model=MODEL, api_base=gw.url + "/v1", api_key="none", temperature=0)
    r = litellm.completion(
        **kw,
        messages=[{"role": "user", "content": "A JSON object about a dog."}],
        max_tokens=40,
        response_format={"type": "json_object"},
    )
    assert (r.choices[0].message.content or "").lstrip().startswith("{")
    with pytest.raises(litellm.BadRequestError) as e:
        litellm.completion(**kw, messages=ASK, max_tokens=4, n=2)
    assert "n=1" in str(e.value)
