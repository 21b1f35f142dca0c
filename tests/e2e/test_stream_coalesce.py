"""A stream's tokens may travel in groups (``[server].stream_coalesce_ms``): fewer channel
messages and fewer stream events, the same answer.

With a window the first token still comes alone, later frames carry several tokens, and the
text, the finish reason and the usage are those of the same request not streamed; with
``stream_coalesce_ms = 0`` every token is a frame of its own. The mid-stream failover tests
(``test_failover.py``) run with the default window: a continuation must account for every
token of a grouped frame."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import ready_worker

pytestmark = pytest.mark.e2e
BODY = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module", params=[200, 0], ids=["window-200ms", "window-0"])
def gw(request: pytest.FixtureRequest) -> Iterator[tuple[GatewayProcess, int]]:
    with GatewayProcess(["--gpu", "sim:1024"], config={"server": {"stream_coalesce_ms": request.param}}) as g:
        ready_worker(g, "gpu")
        yield g, request.param


def stream(gw: GatewayProcess, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The frames that carry text, and the usage frame."""
    frames, usage = [], {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{gw.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-spillover-route"] == "gpu"
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            frames += [ch for ch in doc.get("choices") or [] if text_of(ch)]
    return frames, usage


def text_of(ch: dict[str, Any]) -> str:
    """A choice's text: a completion's ``text``, a chat chunk's ``delta.content`` or a whole
    chat answer's ``message.content`` ("" for none)."""
    if "text" in ch:
        return str(ch["text"] or "")
    return str((ch.get("delta") or ch.get("message") or {}).get("content") or "")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_grouped_frames_carry_the_same_answer(gw: tuple[GatewayProcess, int], path: str) -> None:
    g, window_ms = gw
    body: dict[str, Any] = dict(BODY)
    if path == "/v1/chat/completions":
        body = {
            **{k: v for k, v in BODY.items() if k != "prompt"},
            "messages": [{"role": "user", "content": "Count to 30."}],
        }
    whole = httpx.post(f"{g.url}{path}", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    doc = whole.json()
    whole_text = text_of(doc["choices"][0])
    first_text = text_of(httpx.post(f"{g.url}{path}", json={**body, "max_tokens": 1}, timeout=120).json()["choices"][0])

    frames, usage = stream(g, path, body)
    assert "".join(map(text_of, frames)) == whole_text
    assert usage["completion_tokens"] == doc["usage"]["completion_tokens"] > 8
    assert text_of(frames[0]) == first_text  # the first token is never held
    if window_ms:
        assert len(frames) < usage["completion_tokens"] / 2, [text_of(f) for f in frames]
    else:
        assert len(frames) == usage["completion_tokens"], [text_of(f) for f in frames]
