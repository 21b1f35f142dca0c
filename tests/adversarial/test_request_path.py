"""The request path under attack: schema bombs, same-key races, cancels at every stage, the
CPU lane's context cap, malformed input, junk that would grow the journal. Every test ends by
checking the quiescence invariants (no slot, reservation, live request or open row left)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from spillover.testing import GatewayProcess
from spillover.testing.invariants import wait_quiescent
from tests.e2e.helpers import COUNT_PROMPT, healthy_client, ready_worker, sim, wait_for

pytestmark = pytest.mark.e2e

CONFIG: dict[str, dict[str, Any]] = {
    "breaker": {"cooldown_s": 1.0, "cooldown_max_s": 2.0},
    "cpu_lane": {"canary_ratio": 0.0},
    "server": {"ignored_fields": ["tolerated"]},  # an extra the operator lets through (item 11)
}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 20}}, "required": ["q"]},
    },
}


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """One gateway (1 GiB sim GPU + CPU worker) for the module, with a short breaker cooldown."""
    with GatewayProcess(["--gpu", "sim:1024"], config=CONFIG) as g:
        yield g


def assert_quiescent(gw: GatewayProcess) -> None:
    """Every slot, reservation, live request, held key and journal row is back to rest."""
    left = wait_quiescent(gw.status, Path(gw.state_dir) / "journal.sqlite3", timeout_s=60)
    assert left == [], left


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def stored_body_bytes(journal: Path, rid: str) -> int:
    """Bytes of the request body the journal keeps for ``rid``."""
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT length(body) FROM requests WHERE id=?", (rid,)).fetchone()[0])
    finally:
        db.close()


def tool_request(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "call it"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        "tool_choice": "required",
        "max_tokens": 32,
    }


# -- item 1: schema bombs ------------------------------------------------------------------
BOMBS = [
    ({"type": "string", "maxLength": 200000}, "maxLength"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 10**9}}}, "properties.a.minLength"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 100000}}}, "properties.a.minItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "abc"}}}, None),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 10**40}}}, "properties.a.minimum"),
]


def nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    return node


@pytest.mark.parametrize(("schema", "path"), BOMBS + [(nested(40), None)])
def test_schema_bombs_get_a_400_naming_the_schema_and_no_worker_sees_them(
    gw: GatewayProcess, schema: dict[str, Any], path: str | None
) -> None:
    """A schema whose grammar would crash or bloat a worker is refused with a 400 naming its
    place; both workers keep their pids and the breaker counts nothing."""
    with healthy_client(gw) as c:
        pids = {w["lane"]: w["pid"] for w in gw.status()["workers"]}
        r = c.post("/v1/chat/completions", json=tool_request({"type": "object", "properties": {"v": schema}}))
        err = assert_openai_error(r, 400, "invalid_request")
        assert err["param"].startswith("tools[0].function.parameters"), err
        if path is not None:
            assert err["param"].endswith(path), err
        st = gw.status()
        assert {w["lane"]: w["pid"] for w in st["workers"]} == pids
        assert st["breaker"]["circuit"] == "closed" and st["breaker"]["failures"] == 0
    assert_quiescent(gw)


def test_a_grammar_too_large_in_total_is_refused(gw: GatewayProcess) -> None:
    """Many small properties that together compile past max_grammar_bytes are refused as well."""
    props = {f"p{i:04d}": {"type": "string", "maxLength": 30} for i in range(400)}
    with healthy_client(gw) as c:
        r = c.post("/v1/chat/completions", json=tool_request({"type": "object", "properties": props}))
        err = assert_openai_error(r, 400)
        assert "grammar" in err["message"]


def test_a_bounded_tool_call_still_works_after_the_bombs(gw: GatewayProcess) -> None:
    """A normal forced tool call with a bounded string runs and returns a tool call."""
    with healthy_client(gw) as c:
        body = {
            "messages": [{"role": "user", "content": "look up cats"}],
            "tools": [TOOL],
            "tool_choice": "required",
            "max_tokens": 48,
            "temperature": 0,
        }
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "lookup"
        assert len(json.loads(call["function"]["arguments"])["q"]) <= 20
    assert_quiescent(gw)


# -- items 2, 3: same-key races ------------------------------------------------------------
def fire(gw: GatewayProcess, n: int, body: dict[str, Any], headers: dict[str, str]) -> list[httpx.Response]:
    """``n`` identical requests released at the same instant."""
    gate = threading.Barrier(n)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            gate.wait()
            return c.post("/v1/completions", json=body, headers=headers)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.parametrize("prefer", ["auto", "cpu"])
def test_concurrent_requests_with_one_fresh_key_run_once_and_leak_nothing(gw: GatewayProcess, prefer: str) -> None:
    """Repeated bursts of identical requests with a fresh key: exactly one execution each time
    (the others 409 or replay it), and slots, reservations and live requests return to zero."""
    ready_worker(gw, "gpu")
    body = {"prompt": "Say hi.", "max_tokens": 4, "temperature": 0, "spillover": {"prefer": prefer}}
    for _ in range(6):
        key = uuid.uuid4().hex
        rs = fire(gw, 3, body, {"Idempotency-Key": key})
        ran = [r for r in rs if r.status_code == 200 and "idempotent-replayed" not in r.headers]
        assert len(ran) == 1, [(r.status_code, r.text[:80]) for r in rs]
        ids = {r.headers["x-spillover-request-id"] for r in rs}
        assert len(ids) == 1, ids  # every answer names the one request bound to the key
        for r in rs:
            if r.status_code != 200:
                assert_openai_error(r, 409, "idempotency_key_in_flight")
    assert_quiescent(gw)


def test_concurrent_resumes_of_one_key_run_it_once(gw: GatewayProcess) -> None:
    """A request refused for capacity (REJECTED, resumable) resumed by several clients at
    once: one resume runs it, the others get 409 or its stored answer; nothing leaks."""
    ready_worker(gw, "cpu")
    key = uuid.uuid4().hex
    body = {"prompt": "Name a color.", "max_tokens": 4, "temperature": 0, "spillover": {"prefer": "cpu"}}
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        # A CPU deadline no lane can meet: refused at once, journaled REJECTED (resumable).
        r = c.post("/v1/completions", json=body, headers={"Idempotency-Key": key, "X-Spillover-Deadline-Ms": "1"})
        assert_openai_error(r, 503, "deadline_exceeded")
        rid = r.headers["x-spillover-request-id"]
        assert c.get(f"/v1/requests/{rid}").json()["state"] == "rejected"
    rs = fire(gw, 4, body, {"Idempotency-Key": key})
    ran = [r for r in rs if r.status_code == 200 and "idempotent-replayed" not in r.headers]
    assert len(ran) == 1, [(r.status_code, r.text[:80]) for r in rs]
    assert all(r.headers["x-spillover-request-id"] == rid for r in rs)
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        doc = c.get(f"/v1/requests/{rid}").json()
    assert doc["state"] == "completed"
    assert [h["to"] for h in doc["history"]].count("running") == 1, doc["history"]
    assert_quiescent(gw)


# -- item 4: a cancelled breaker probe -------------------------------------------------------
def test_a_cancelled_probe_does_not_pin_the_breaker_half_open(gw: GatewayProcess) -> None:
    """Open the breaker, cancel the half-open probe with DELETE: the next request probes the
    GPU again and the breaker closes (it used to stay half-open until restart)."""
    with healthy_client(gw) as c:
        sim(gw).fail_next(1)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "cpu"
        assert gw.status()["breaker"]["circuit"] in ("open", "half_open")
        wait_for(lambda: gw.status()["breaker"]["circuit"] == "half_open", 10, "half open")
        probe: dict[str, Any] = {}

        def run_probe() -> None:
            with httpx.Client(base_url=gw.url, timeout=120) as pc:
                probe["r"] = pc.post(
                    "/v1/completions", json={"prompt": COUNT_PROMPT, "max_tokens": 600, "temperature": 0}
                )

        t = threading.Thread(target=run_probe)
        t.start()
        rid = wait_for(
            lambda: next((x["rid"] for x in gw.status()["running"] if x["route"] == "gpu"), None), 30, "probe running"
        )
        assert gw.status()["breaker"]["probes_in_flight"] == 1
        assert c.delete(f"/v1/requests/{rid}").json()["state"] == "cancelled"
        t.join(30)
        assert_openai_error(probe["r"], 409, "request_cancelled")
        # The probe's place comes back with the worker's last word on it (it stops within a token).
        wait_for(lambda: gw.status()["breaker"]["probes_in_flight"] == 0, 10, "probe released")
        routes = [c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).headers["x-spillover-route"]]
        routes.append(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).headers["x-spillover-route"])
        assert routes == ["gpu", "gpu"]
        assert gw.status()["breaker"]["circuit"] == "closed"
    assert_quiescent(gw)


# -- item 12: DELETE of a running stream ---------------------------------------------------------
@pytest.mark.parametrize("prefer", ["auto", "cpu"])
@pytest.mark.parametrize("read_to_done", [True, False])
def test_delete_of_a_running_stream_ends_it_with_an_error_event_and_done(
    gw: GatewayProcess, prefer: str, read_to_done: bool
) -> None:
    """DELETE while streaming: the client reads a final request_cancelled error event and
    [DONE] (no aborted connection), and the stored transcript ends the same way, also when
    the client hangs up as soon as it sees the error event."""
    with healthy_client(gw) as c:
        events: list[str] = []
        body = {"prompt": COUNT_PROMPT, "max_tokens": 600, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=body | {"spillover": {"prefer": prefer}}) as r:
            rid = r.headers["x-spillover-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 5:
                    with httpx.Client(base_url=gw.url, timeout=30) as other:
                        assert other.delete(f"/v1/requests/{rid}").status_code == 200
                if not read_to_done and '"error"' in line:
                    break
        if read_to_done:
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "request_cancelled"
        else:
            assert json.loads(events[-1])["error"]["code"] == "request_cancelled"
        doc = wait_for(lambda: (d := c.get(f"/v1/requests/{rid}").json())["state"] != "running" and d, 10)
        assert doc["state"] == "cancelled"
        assert doc["response"].rstrip().endswith("data: [DONE]")
        assert "request_cancelled" in doc["response"]
    assert_quiescent(gw)


@pytest.mark.parametrize("prefer", ["auto", "cpu"])
def test_delete_of_a_running_non_stream_request_releases_its_slot(gw: GatewayProcess, prefer: str) -> None:
    """DELETE of a running (non-stream) request on either lane: 409 for its client, and its
    slot and reservation come back only once the worker has stopped."""
    with healthy_client(gw) as c:
        out: dict[str, Any] = {}
        body = {"prompt": COUNT_PROMPT, "max_tokens": 600, "temperature": 0, "spillover": {"prefer": prefer}}

        def run() -> None:
            with httpx.Client(base_url=gw.url, timeout=120) as rc:
                out["r"] = rc.post("/v1/completions", json=body)

        t = threading.Thread(target=run)
        t.start()
        rid = wait_for(lambda: next((x["rid"] for x in gw.status()["running"] if x["route"]), None), 30, "running")
        time.sleep(0.5)  # let it generate a few tokens: cancelled mid-decode, not before
        assert c.delete(f"/v1/requests/{rid}").json()["state"] == "cancelled"
        t.join(30)
        assert_openai_error(out["r"], 409, "request_cancelled")
    assert_quiescent(gw)


# -- item 6: the CPU lane's context cap ------------------------------------------------------------
LONG = "The quick brown fox jumps over the lazy dog. " * 110  # about 1,100 tokens


def test_a_prompt_too_long_for_the_cpu_lane_is_a_400_not_an_empty_200(gw: GatewayProcess) -> None:
    """prefer:cpu with a prompt over the CPU lane's cap: 400 context_length_exceeded."""
    with healthy_client(gw) as c:
        r = c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 16, "spillover": {"prefer": "cpu"}})
        err = assert_openai_error(r, 400, "context_length_exceeded")
        assert "CPU lane" in err["detail"] and "too long" in err["message"]
    assert_quiescent(gw)


def test_a_gpu_failure_of_a_prompt_too_long_for_the_cpu_is_a_typed_error(gw: GatewayProcess) -> None:
    """A GPU allocation failure of a request the CPU lane cannot hold ends in a resumable 503
    that says why, never in an empty 200 from a truncated context."""
    with healthy_client(gw) as c:
        sim(gw).fail_next(1)
        r = c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 16})
        err = assert_openai_error(r, 503, "worker_failed")
        assert "CPU lane serves at most" in err["detail"] and "try again" in err["message"]
    assert_quiescent(gw)


def test_a_request_of_exactly_the_cpu_cap_runs_there(gw: GatewayProcess) -> None:
    """prompt + max_tokens equal to the CPU lane's cap is served on the CPU lane (the boundary
    belongs to the lane); one token more is refused."""
    with healthy_client(gw) as c:
        probe = c.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 1, "temperature": 0})
        n = probe.json()["usage"]["prompt_tokens"]
        cap = next(x["ctx_cap_tokens"] for x in gw.status()["lanes"] if x["lane"] == "cpu")
        body = {"prompt": "one two three", "temperature": 0, "spillover": {"prefer": "cpu"}}
        r = c.post("/v1/completions", json=body | {"max_tokens": cap - n})
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "cpu", r.text
        r = c.post("/v1/completions", json=body | {"max_tokens": cap - n + 1})
        assert_openai_error(r, 400, "context_length_exceeded")
    assert_quiescent(gw)


def failovers(gw: GatewayProcess) -> float:
    """``spillover_failovers_total``, every kind summed."""
    text = httpx.get(f"{gw.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("spillover_failovers_total{"))


@pytest.mark.parametrize("prompt", ["", [""]])
def test_an_empty_prompt_starts_from_bos_and_never_fails_a_worker(gw: GatewayProcess, prompt: Any) -> None:
    """An empty prompt is answered from the model's BOS token, as llama-cpp-python does. It
    reached the engine as zero tokens, which failed the GPU worker, then the CPU one: a 503, a
    failover counted, and three such requests opened the GPU's breaker for every client."""
    with healthy_client(gw) as c:
        before = failovers(gw)
        for stream in (False, True, False, False):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": stream})
            assert r.status_code == 200, r.text
            if not stream:
                assert r.json()["usage"]["prompt_tokens"] == 1, r.json()
                assert r.headers["x-spillover-attempts"] == "1", r.headers
        assert failovers(gw) == before
        assert gw.status()["breaker"]["circuit"] != "open"
    assert_quiescent(gw)


# -- item 10: malformed input --------------------------------------------------------------------
MALFORMED: list[tuple[str, bytes, dict[str, str | bytes]]] = [
    ("deep JSON", b"[" * 100_000 + b"]" * 100_000, {}),
    ("huge float", b'{"prompt": "x", "temperature": 1e400}', {}),
    ("huge int temperature", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", {}),
    ("5000-digit integer", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}),
    ("deadline_ms overflow", b'{"prompt": "x", "spillover": {"deadline_ms": 1' + b"0" * 300 + b"}}", {}),
    ("superscript deadline header", b'{"prompt": "x"}', {"X-Spillover-Deadline-Ms": "\u00b2".encode()}),
    ("huge deadline header", b'{"prompt": "x"}', {"X-Spillover-Deadline-Ms": "9" * 40}),
    ("NaN", b'{"prompt": "x", "top_p": NaN}', {}),
    ("stop not strings", b'{"prompt": "x", "stop": [1, 2]}', {}),
    ("include_usage not bool", b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', {}),
    ("not UTF-8", b'{"prompt": "\xff\xfe"}', {}),
    ("lone surrogate", b'{"prompt": "\\ud800"}', {}),
    ("lone surrogate in a field's name", b'{"prompt": "x", "\\ud800x": 1}', {}),  # the 400 quoting it was a 500
    ("lone surrogate in stream_options", b'{"prompt": "x", "stream": true, "stream_options": {"\\udfff": 1}}', {}),
]
CHAT_MALFORMED: list[tuple[str, dict[str, Any]]] = [
    ("tool_choice.function a string", {"tools": [TOOL], "tool_choice": {"type": "function", "function": "lookup"}}),
    (
        "tool_choice.function.name a list",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": []}}},
    ),
    (
        "assistant tool_calls function a string",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": "f"}]}]},
    ),
    ("assistant tool_calls not objects", {"messages": [{"role": "assistant", "tool_calls": [1]}]}),
    ("tool parameters a list", {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
    ("messages not a list", {"messages": "hi"}),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}),
]


def test_malformed_input_gets_a_400_in_the_openai_shape_on_a_kept_connection(gw: GatewayProcess) -> None:
    """Every malformed body or header: 400 with an OpenAI error object, the connection stays
    usable, and a normal request on it works afterwards."""
    ready_worker(gw, "gpu")
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        for what, raw, headers in MALFORMED:
            r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json", **headers})
            assert r.status_code == 400, (what, r.status_code, r.text[:200])
            assert_openai_error(r, 400)
        base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for what, patch in CHAT_MALFORMED:
            r = c.post("/v1/chat/completions", json=base | patch)
            assert r.status_code == 400, (what, r.status_code, r.text[:200])
            assert_openai_error(r, 400)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert_quiescent(gw)


# -- item 11: junk does not grow the journal ---------------------------------------------------
def test_unknown_fields_are_not_journaled(gw: GatewayProcess) -> None:
    """Twenty requests each carrying a 900 KB unknown field are refused (400 naming it); twenty
    carrying one the operator tolerates ([server].ignored_fields) run, and that field is not
    stored: the journal grows by far less than the junk; the file is private (0600)."""
    journal = Path(gw.state_dir) / "journal.sqlite3"

    def size() -> int:
        return sum(p.stat().st_size for p in journal.parent.glob("journal.sqlite3*"))

    before = size()
    with healthy_client(gw) as c:
        for _ in range(20):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "junk": "x" * 900_000})
            assert assert_openai_error(r, 400)["param"] == "junk"
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "tolerated": "x" * 900_000})
            assert r.status_code == 200, r.text
            assert stored_body_bytes(journal, r.headers["x-spillover-request-id"]) < 1000
    grown = size() - before
    assert grown < 4 * 1024 * 1024, grown
    assert journal.stat().st_mode & 0o777 == 0o600
    assert_quiescent(gw)
