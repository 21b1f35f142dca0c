"""Property-based fuzzing of the live HTTP API, and the request time limit.

Hypothesis mutates valid chat and completion bodies (wrong types, huge and odd numbers,
unknown fields, odd headers) and posts them to a real gateway: no 5xx but the documented
503s, every error in the OpenAI shape, and afterwards every slot, reservation, live request
and journal row back at rest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.testing import GatewayProcess
from spillover.testing.invariants import wait_quiescent
from tests.e2e.helpers import COUNT_PROMPT, ready_worker

pytestmark = pytest.mark.e2e

DOCUMENTED = {200, 400, 404, 409, 413, 415, 422, 503, 504}  # 504: request_timeout_s (4 s here)
odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
FIELDS = [
    "model", "stream", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "user", "stream_options", "spillover", "tools", "tool_choice", "junk",
]  # fmt: skip
good_values: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(min_value=1, max_value=4),
    "temperature": st.sampled_from([0, 0.0, 0.7, 2]),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "stop": st.sampled_from(["\n", [".", "!"], []]),
    "stream": st.booleans(),
    "spillover": st.sampled_from([{}, {"prefer": "cpu"}, {"allow_shrink": True}, {"deadline_ms": 60000}]),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, str]]:
    chat = draw(st.booleans())
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": draw(st.text(max_size=40))}]}
        if chat
        else {"prompt": draw(st.text(max_size=40))}
    )
    body["max_tokens"] = 3
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        strategy = good_values.get(name, odd)
        body[name] = draw(st.one_of(strategy, odd))
    if chat and draw(st.booleans()):
        body["messages"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"])},
                    optional={"content": odd, "tool_calls": odd, "tool_call_id": odd},
                ),
                max_size=3,
            )
        )
    headers = draw(
        st.sampled_from(
            [
                {},
                {"Idempotency-Key": "fuzz-key"},
                {"X-Spillover-Deadline-Ms": "0"},
                {"X-Spillover-Deadline-Ms": "60000"},
            ]
        )
    )
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, headers


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """A gateway with a short request time limit (for the timeout test) and no canary."""
    config = {"server": {"request_timeout_s": 4.0}, "cpu_lane": {"canary_ratio": 0.0}}
    with GatewayProcess(["--gpu", "sim:1024"], config=config) as g:
        yield g


def test_fuzzed_requests_get_documented_answers_and_leave_nothing_behind(gw: GatewayProcess) -> None:
    """Fuzzed bodies: only documented statuses, every error OpenAI-shaped, and quiescence after."""
    ready_worker(gw, "gpu")
    ready_worker(gw, "cpu")
    seen: dict[int, int] = {}
    with httpx.Client(base_url=gw.url, timeout=60) as c:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies())
        def one(case: tuple[str, dict[str, Any], dict[str, str]]) -> None:
            path, body, headers = case
            r = c.post(path, json=body, headers=headers)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code in DOCUMENTED, (r.status_code, body, r.text[:300])
            if r.status_code != 200:
                err = r.json()["error"]
                assert set(err) >= {"message", "type", "param", "code"}, err
                assert isinstance(err["message"], str) and err["message"]
                if r.status_code == 503:
                    assert int(r.headers["retry-after"]) >= 1

        one()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # the fuzzer reached both sides
    left = wait_quiescent(gw.status, Path(gw.state_dir) / "journal.sqlite3", timeout_s=60)
    assert left == [], left


@pytest.mark.parametrize("prefer", ["auto", "cpu"])
def test_request_timeout_is_enforced_and_frees_everything(gw: GatewayProcess, prefer: str) -> None:
    """A request still running at request_timeout_s is stopped: 504 request_timeout, journaled
    FAILED, and its slot and reservation come back."""
    body = {"prompt": COUNT_PROMPT, "max_tokens": 900, "temperature": 0, "spillover": {"prefer": prefer}}
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "request_timeout"
        assert c.get(f"/v1/requests/{r.headers['x-spillover-request-id']}").json()["state"] == "failed"
    left = wait_quiescent(gw.status, Path(gw.state_dir) / "journal.sqlite3", timeout_s=30)
    assert left == [], left
