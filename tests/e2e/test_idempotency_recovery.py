"""Idempotency-Key semantics, gateway SIGKILL recovery, and an agent that never runs a
tool twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from spillover.drill.scenarios import agent_body
from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess
from spillover.testing.audio import speech_of
from tests.e2e.helpers import COUNT_PROMPT, kill_worker, ready_worker, stream, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1"]) as g:
        yield g


def test_f_idempotency_replay_conflict_and_mismatch(gw: GatewayProcess) -> None:
    """Same key + body: byte-identical replay; different body: 422; in flight: 409 +
    Retry-After; malformed key: 400."""
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
        first = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == 200 and "idempotent-replayed" not in first.headers
        again = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "k-1"})
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
        assert again.headers["x-spillover-request-id"] == first.headers["x-spillover-request-id"]
        other = c.post("/v1/completions", json={**body, "max_tokens": 13}, headers={"Idempotency-Key": "k-1"})
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
        assert other.headers["x-spillover-request-id"] == first.headers["x-spillover-request-id"]  # the key's
        bad = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "x" * 300})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Idempotency-Key"

        long_body = {"prompt": COUNT_PROMPT, "max_tokens": 300, "temperature": 0}
        result: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: result.setdefault(
                "r", c.post("/v1/completions", json=long_body, headers={"Idempotency-Key": "k-2"})
            )
        )
        t.start()
        wait_for(lambda: gw.status()["live_requests"] >= 1, 30, "in flight")
        busy = c.post("/v1/completions", json=long_body, headers={"Idempotency-Key": "k-2"})
        assert busy.status_code == 409 and int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["code"] == "idempotency_key_in_flight"
        t.join(120)
        assert result["r"].status_code == 200
        assert busy.headers["x-spillover-request-id"] == result["r"].headers["x-spillover-request-id"]


def test_stream_replay_is_the_same_transcript(gw: GatewayProcess) -> None:
    """A streamed request replayed by key returns the very same SSE bytes."""
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        body = {"prompt": "Roses are red", "max_tokens": 10, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=body, headers={"Idempotency-Key": "s-1"}) as r:
            original = r.read()
        replay = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "s-1"})
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.headers["content-type"].startswith("text/event-stream")
        assert replay.content == original and original.endswith(b"data: [DONE]\n\n")


def test_the_journal_keeps_a_body_as_sent_its_keys_in_order(gw: GatewayProcess) -> None:
    """Round 16: the journal stored a body with its keys sorted, and a replay after a restart
    ran that copy: a json_schema's properties (``zeta_reasoning`` before ``alpha_answer``) came
    back alphabetised, so the model was asked to write them in the other order and answered
    differently. The stored body keeps the client's order; the key's hash still ignores it."""
    schema = {
        "type": "object",
        "properties": {"zeta_reasoning": {"type": "string"}, "alpha_answer": {"type": "string"}},
        "required": ["zeta_reasoning", "alpha_answer"],
    }
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 6,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "order-1"})
        assert r.status_code == 200, r.text
        reordered = {k: body[k] for k in reversed(list(body))}  # the same JSON, keys in another order
        again = c.post("/v1/chat/completions", json=reordered, headers={"Idempotency-Key": "order-1"})
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    db = sqlite3.connect(Path(gw.state_dir) / "journal.sqlite3")
    try:
        rid = r.headers["x-spillover-request-id"]
        (text,) = db.execute("SELECT body FROM requests WHERE id = ?", (rid,)).fetchone()
    finally:
        db.close()
    stored = json.loads(text)["body"]
    assert list(stored["response_format"]["json_schema"]["schema"]["properties"]) == ["zeta_reasoning", "alpha_answer"]
    assert [k for k in stored if k in body] == list(body)


def journal_rows(state_dir: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(Path(state_dir) / "journal.sqlite3")
    try:
        rows = db.execute("SELECT id, idem_key, state, attempts, stream, tokens_delivered FROM requests").fetchall()
        completed = Counter(r[0] for r in db.execute("SELECT rid FROM transitions WHERE to_state='completed'"))
    finally:
        db.close()
    keys = ("id", "key", "state", "attempts", "stream", "delivered")
    return [dict(zip(keys, r, strict=True)) | {"completions": completed[r[0]]} for r in rows]


def post_keyed(g: GatewayProcess, body: dict[str, Any], key: str, outcomes: dict[str, Any]) -> None:
    """POST a completion with an Idempotency-Key; its response (or the connection's error) goes
    into ``outcomes[key]``."""
    try:
        with httpx.Client(base_url=g.url, timeout=120) as c:
            outcomes[key] = c.post("/v1/completions", json=body, headers={"Idempotency-Key": key})
    except httpx.HTTPError as exc:
        outcomes[key] = exc


def test_e_gateway_sigkill_loses_nothing_and_runs_nothing_twice(tmp_path: Path) -> None:
    """Requests queued and running when the gateway is SIGKILLed all end, after restart,
    completed (replayed) or with an explicit resumable error; each completes at most once."""
    state = str(tmp_path / "state")
    g = GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1", "--cpu-slots", "1"], state_dir=state)
    g.start()
    try:
        body = {"prompt": COUNT_PROMPT, "max_tokens": 250, "temperature": 0}
        outcomes: dict[str, Any] = {}
        tokens_seen = threading.Event()

        def send(key: str) -> None:
            post_keyed(g, body, key, outcomes)

        def send_stream() -> None:
            try:
                with httpx.Client(base_url=g.url, timeout=120) as c:
                    outcomes["s"] = stream(
                        c,
                        "/v1/completions",
                        {**body, "max_tokens": 900},  # still streaming when the gateway dies
                        headers={"Idempotency-Key": "s"},
                        on_token=lambda n: n >= 5 and tokens_seen.set(),
                    )
            except httpx.HTTPError as exc:
                outcomes["s"] = exc

        threads = [threading.Thread(target=send_stream)]
        threads += [threading.Thread(target=send, args=(f"n{i}",)) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        assert tokens_seen.wait(60)
        wait_for(lambda: len(journal_rows(state)) == 5, 30, "all five accepted")
        old_workers = [w["pid"] for w in g.status()["workers"]]
        g.kill9()
        for t in threads:
            t.join(60)
        s_out = outcomes.get("s")
        assert isinstance(s_out, httpx.HTTPError) or not s_out["done"]  # the stream was cut by the kill

        g.restart()
        with httpx.Client(base_url=g.url, timeout=120) as c:
            # A request that arrives while recovery is pending is not mistaken for an orphan.
            fresh = c.post(
                "/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, headers={"Idempotency-Key": "f"}
            )
            assert fresh.status_code == 200 and fresh.json()["spillover"]["attempts"] == 1
            history = c.get(f"/v1/requests/{fresh.headers['x-spillover-request-id']}").json()["history"]
            assert not [h for h in history if "recovered" in (h["reason"] or "")]
        rows = wait_for(
            lambda: (r := journal_rows(state)) and all(x["state"] in ("completed", "resumable_error") for x in r) and r,
            240,
            "every request ended",
        )
        assert len(rows) == 6  # the five from before the kill, none lost, and the fresh one
        by_key = {r["key"]: r for r in rows}
        assert by_key["s"]["state"] == "resumable_error" and by_key["s"]["delivered"] >= 1
        for i in range(4):
            r = by_key[f"n{i}"]
            assert r["state"] == "completed" and r["completions"] == 1, r  # none run twice
        for pid in old_workers:
            assert _gone(pid)
        with httpx.Client(base_url=g.url, timeout=60) as c:
            replay = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "n0"})
            assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
            doc = c.get(f"/v1/requests/{by_key['s']['id']}").json()
            assert doc["error"]["error"]["code"] == "failover_interrupted"
            assert doc["error"]["error"]["message"].startswith("The server restarted partway"), doc  # not "the GPU"
    finally:
        g.stop()


def _gone(pid: int) -> bool:
    """The process ended (a zombie waiting for its reaper is gone too: it holds no memory)."""
    return not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def test_a_stopped_worker_dies_with_its_gateway_and_frees_the_device(tmp_path: Path) -> None:
    """Round 49b: a worker SIGSTOPped (hung) when its gateway was SIGKILLed never read its
    channel's end: it kept its weights and a request's reservation in the sim ledger beside the
    next gateway's workers until someone sent it SIGCONT. The kernel kills it with its gateway."""
    state = str(tmp_path / "state")
    g = GatewayProcess(["--gpu", "sim:1024"], state_dir=state).start()
    try:
        pids = [int(ready_worker(g, lane)["pid"]) for lane in ("gpu", "cpu")]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        g.kill9()
        wait_for(lambda: all(_gone(pid) for pid in pids), 15, "the stopped workers gone with their gateway")
        assert not [a for a in SimDevice(state).snapshot().allocations if a[1] in pids]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        g.stop()


def test_after_a_restart_a_stream_is_replayed_only_while_nothing_of_it_reached_a_client(tmp_path: Path) -> None:
    """Round 36. A streamed transcription whose first segment had reached its client was run
    again after a SIGKILL of the gateway (a transcription stream's delivery was never
    journaled), and its key then answered frames the client never saw: it ends
    ``failover_interrupted``, as a chat stream does. And a stream replayed after a restart has
    no client: what the replay streams reaches nobody, so a second crash during it replays it
    again (it ended ``failover_interrupted``, "tokens had been delivered", for tokens nobody read)."""
    state = str(tmp_path / "state")
    args = ["--gpu", "sim:1024", "--gpu-slots", "1", "--cpu-slots", "1"]
    g = GatewayProcess(args, state_dir=state, services=("chat", "transcription"))
    g.start()
    try:
        blocker = {"prompt": COUNT_PROMPT, "max_tokens": 400, "temperature": 0}
        outcomes: dict[str, Any] = {}
        threads = [threading.Thread(target=post_keyed, args=(g, blocker, f"b{i}", outcomes)) for i in range(2)]
        for t in threads:  # both chat slots busy: the stream below waits in a queue, nothing of it sent
            t.start()
            time.sleep(0.3)
        wait_for(lambda: len(journal_rows(state)) == 2, 30, "the blockers accepted")

        def chat_stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=g.url, timeout=120) as c:
                stream(c, "/v1/completions", blocker | {"max_tokens": 300}, headers={"Idempotency-Key": "s"})

        first_segment = threading.Event()

        def transcription() -> None:
            files = {"file": ("clip.wav", speech_of(120.0), "audio/wav")}
            data = {"model": "whisper-1", "stream": "true"}
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream(
                    "POST", g.url + "/v1/audio/transcriptions", data=data, files=files,
                    headers={"Idempotency-Key": "t"}, timeout=120,
                ) as r,
            ):  # fmt: skip
                for line in r.iter_lines():
                    if "transcript.text.delta" in line:
                        first_segment.set()

        threads += [threading.Thread(target=chat_stream), threading.Thread(target=transcription)]
        threads[2].start()
        wait_for(lambda: len(journal_rows(state)) == 3, 30, "the stream accepted")
        threads[3].start()
        assert first_segment.wait(120), g.tail()
        by_key = {r["key"]: r for r in journal_rows(state)}
        assert by_key["s"]["delivered"] == 0 and by_key["t"]["delivered"] == 1, by_key
        g.kill9()
        for t in threads:
            t.join(60)

        g.restart()

        def keyed() -> dict[str, dict[str, Any]]:
            return {x["key"]: x for x in journal_rows(state)}

        rows = wait_for(lambda: (r := keyed())["t"]["state"] not in ("running", "queued") and r, 60, "t's end")
        assert rows["t"]["state"] == "resumable_error", rows["t"]  # its client saw a segment: not run again
        doc = httpx.get(f"{g.url}/v1/requests/{rows['t']['id']}", timeout=30).json()
        assert doc["error"]["error"]["code"] == "failover_interrupted", doc
        assert doc["error"]["error"]["message"].startswith("The server restarted partway"), doc  # not "the GPU"
        # the chat stream is replayed, with no client: what it streams is not delivered
        wait_for(lambda: keyed()["s"]["state"] == "running", 120, "the stream's replay running on a worker")
        time.sleep(3.0)  # tokens streamed to nobody
        assert keyed()["s"]["state"] == "running"  # still (300 tokens)
        assert keyed()["s"]["delivered"] == 0
        g.kill9()
        g.restart()
        done = wait_for(lambda: (r := keyed())["s"]["state"] == "completed" and r, 240, "the stream replayed again")
        assert done["s"]["attempts"] >= 3 and done["s"]["completions"] == 1, done["s"]
    finally:
        g.stop()


def test_a_graceful_stop_ends_its_requests_resumable_and_a_retry_with_the_key_runs_them(tmp_path: Path) -> None:
    """SIGTERM (Ctrl-C alike): a request still running after the 5 s grace, and one queued
    behind it, were not cancelled by their clients. They end 503 ``server_stopping``, journaled
    resumable (they ended CANCELLED, ``request_cancelled`` with x-should-retry false, and a
    retry with the key after the restart got that 409 back forever); after the restart a retry
    with the key runs each, once."""
    state = str(tmp_path / "state")
    g = GatewayProcess(["--gpu", "none", "--chat-only", "--cpu-slots", "1"], state_dir=state)
    g.start()
    body = {"prompt": COUNT_PROMPT, "max_tokens": 700, "temperature": 0}
    try:
        outcomes: dict[str, Any] = {}

        def send(key: str) -> None:
            post_keyed(g, body, key, outcomes)

        threads = [threading.Thread(target=send, args=(key,)) for key in ("g1", "g2")]
        for t in threads:
            t.start()
            time.sleep(0.3)
        wait_for(lambda: g.status()["live_requests"] == 2, 30, "one running, one queued")
        g.stop()  # SIGTERM: uvicorn's grace of 5 s, then what still runs is stopped
        for t in threads:
            t.join(60)
        for got in outcomes.values():  # told so before the server's grace ends (a bare 500 before)
            assert isinstance(got, httpx.Response) and got.status_code == 503, got
            assert got.json()["error"]["code"] == "server_stopping" and got.headers["x-should-retry"] == "true"
        rows = {r["key"]: r for r in journal_rows(state)}
        assert {k: r["state"] for k, r in rows.items()} == {"g1": "resumable_error", "g2": "resumable_error"}, rows
        g.restart()
        with httpx.Client(base_url=g.url, timeout=180) as c:
            doc = c.get(f"/v1/requests/{rows['g2']['id']}").json()
            assert doc["error"]["error"]["code"] == "server_stopping", doc
            again = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "g2"})
            assert again.status_code == 200, again.text
            assert again.headers["x-spillover-request-id"] == rows["g2"]["id"]
        assert {r["key"]: r["completions"] for r in journal_rows(state)} == {"g1": 0, "g2": 1}
    finally:
        g.stop()


def test_a_second_ctrl_c_answers_what_still_runs_503_not_a_bare_500(tmp_path: Path) -> None:
    """Round 36: a second Ctrl-C (uvicorn's "stop at once") cancelled the handlers of requests
    still running: a bare 500 text/plain with no request id and no ``x-should-retry``. They are
    stopped first (503 ``server_stopping``, journaled resumable, as after the grace), and the
    gateway stops 2 s later; a stream ends with its error event and ``[DONE]``. An embeddings
    request, whose stop waits up to a second for its batch, is answered so too."""
    state = str(tmp_path / "state")
    g = GatewayProcess(["--gpu", "none", "--cpu-slots", "2"], state_dir=state, services=("chat", "embeddings"))
    g.start()
    body = {"prompt": COUNT_PROMPT, "max_tokens": 700, "temperature": 0}
    try:
        outcomes: dict[str, Any] = {}
        streamed = threading.Event()

        def send_stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=g.url, timeout=60) as c:
                outcomes["s"] = stream(
                    c, "/v1/completions", body, headers={"Idempotency-Key": "s"}, on_token=lambda n: streamed.set()
                )

        def embed() -> None:
            vectors = {"model": "bge-small-en", "input": ["the quick brown fox jumps over the lazy dog " * 50] * 256}
            with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=g.url, timeout=60) as c:
                outcomes["e"] = c.post("/v1/embeddings", json=vectors, headers={"Idempotency-Key": "e"})

        threads = [threading.Thread(target=post_keyed, args=(g, body, "n", outcomes))]
        threads += [threading.Thread(target=send_stream), threading.Thread(target=embed)]
        for t in threads:
            t.start()
        assert streamed.wait(60)
        wait_for(lambda: g.status()["live_requests"] == 3, 30, "all three running")
        assert g.proc is not None
        g.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        g.proc.send_signal(signal.SIGINT)  # at once
        g.proc.wait(30)
        for t in threads:
            t.join(30)
        for key in ("n", "e"):
            got = outcomes.get(key)
            assert isinstance(got, httpx.Response) and got.status_code == 503, (key, got)
            assert got.json()["error"]["code"] == "server_stopping" and got.headers["x-should-retry"] == "true"
            assert got.headers["x-spillover-request-id"]
        s = outcomes["s"]
        assert s["done"] and s["error"]["code"] == "server_stopping", s  # its error event, then [DONE]
        rows = {r["key"]: r["state"] for r in journal_rows(state)}
        assert rows == {"n": "resumable_error", "s": "resumable_error", "e": "resumable_error"}, rows
    finally:
        g.stop()


def test_a_delete_of_an_orphan_waiting_for_recovery_cancels_it_and_it_never_runs(tmp_path: Path) -> None:
    """After a SIGKILL the restarted gateway replays its orphans once the workers are up (here
    the GPU worker's load waits behind a tenant). A DELETE of one meanwhile ends it cancelled
    and it never runs (it answered 200 with the stale state, and the replay ran it after)."""
    state = str(tmp_path / "state")
    g = GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1", "--cpu-slots", "1"], state_dir=state)
    g.start()
    tenant: subprocess.Popen[bytes] | None = None
    try:
        body = {"prompt": COUNT_PROMPT, "max_tokens": 600, "temperature": 0}

        def send(key: str) -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=g.url, timeout=120) as c:
                c.post("/v1/completions", json=body, headers={"Idempotency-Key": key})

        threads = [threading.Thread(target=send, args=(f"o{i}",), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        wait_for(lambda: len(journal_rows(state)) == 3, 30, "all three accepted")
        g.kill9()
        cmd = [sys.executable, "-m", "spillover.cli", "tenant", "--state-dir", state, "--mib", "1000"]
        tenant = subprocess.Popen([*cmd, "--name", "other"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: SimDevice(state).snapshot().used_bytes >= 900 * 2**20, 20, "the tenant's hold")
        g.wait_all_workers = False  # the GPU worker's load waits for room: recovery waits for it
        g.restart()
        victim = next(r for r in journal_rows(state) if r["key"] == "o2")
        assert victim["state"] not in ("completed", "cancelled")
        doc = httpx.get(f"{g.url}/v1/requests/{victim['id']}", timeout=30).json()
        assert (doc["live"], doc["recovering"]) == (False, True), doc  # it waits for recovery: said so
        unfinished = [r for r in journal_rows(state) if r["state"] not in ("completed", "resumable_error")]
        assert httpx.get(f"{g.url}/v1/status", timeout=30).json()["recovering"] == len(unfinished) >= 1
        r = httpx.delete(f"{g.url}/v1/requests/{victim['id']}", timeout=30)
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        tenant.terminate()
        tenant.wait(10)
        tenant = None
        rows = wait_for(
            lambda: (
                (rs := journal_rows(state))
                and all(x["state"] in ("completed", "resumable_error", "cancelled") for x in rs)
                and rs
            ),
            240,
            "every request ended",
        )
        by_key = {x["key"]: x for x in rows}
        assert by_key["o2"]["state"] == "cancelled" and by_key["o2"]["completions"] == 0, by_key
        assert {by_key[k]["state"] for k in ("o0", "o1")} == {"completed"}, by_key  # the others replayed
        db = sqlite3.connect(Path(state) / "journal.sqlite3")
        try:
            after = db.execute(
                "SELECT to_state FROM transitions WHERE rid=? ORDER BY rowid", (victim["id"],)
            ).fetchall()
        finally:
            db.close()
        assert after[-1][0] == "cancelled", after  # nothing moved it after the DELETE
        assert httpx.get(f"{g.url}/v1/requests/{victim['id']}", timeout=30).json()["recovering"] is False
        assert httpx.get(f"{g.url}/v1/status", timeout=30).json()["recovering"] == 0
    finally:
        if tenant is not None:
            tenant.terminate()
        g.stop()


def agent_step(c: httpx.Client, messages: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One agent call, retried with the same key until it has an answer."""
    body = agent_body(messages)
    for _ in range(40):
        r = c.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
        if r.status_code == 200:
            return dict(r.json())
        assert r.status_code in (409, 503), r.text
        time.sleep(float(r.headers.get("retry-after", "1")) / 2)
    raise AssertionError("no answer")


def kill_when_busy(gw: GatewayProcess, killed: list[int]) -> None:
    """SIGKILL the GPU worker as soon as it holds a request."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if gw.worker("gpu")["busy"] >= 1:
            killed.append(kill_worker(gw, "gpu"))
            return
        time.sleep(0.002)


def test_agent_never_executes_a_tool_twice(gw: GatewayProcess) -> None:
    """A scripted agent whose GPU worker is killed at different points, and which itself
    re-sends a step after 'crashing' post-execution, applies each side effect once."""
    ledger: dict[str, int] = {}
    effects: Counter[int] = Counter()
    killed: list[int] = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Pay Bob 5, then Carol 7, then Dan 9."}]
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for step in (1, 2, 3):
            key = f"agent-run-1-step-{step}"
            if step == 1:
                kill_worker(gw, "gpu")  # the GPU is down when the step starts
            killer = None
            if step == 2:
                ready_worker(gw, "gpu")
                # Step 1 may have tripped the breaker (its request can reach the dying worker).
                wait_for(lambda: gw.status()["breaker"]["circuit"] != "open", 40, "breaker not open")
                killer = threading.Thread(target=kill_when_busy, args=(gw, killed))
                killer.start()
            resp = agent_step(c, messages, key)
            if killer is not None:
                killer.join(30)
                assert killed, f"the GPU worker was killed while step 2 ran on it: {resp['spillover']}"
                assert resp["spillover"]["attempts"] == 2 and resp["spillover"]["route"] == "cpu"
            calls = resp["choices"][0]["message"]["tool_calls"]
            for call in calls:
                if call["id"] not in ledger:  # the side-effect ledger, keyed by tool_call_id
                    ledger[call["id"]] = step
                    effects[step] += 1
            if step == 3:
                # The agent crashes after executing, before saving its progress, and re-sends
                # the step: the replay carries the same tool_call ids, so nothing runs again.
                again = agent_step(c, messages, key)
                assert [x["id"] for x in again["choices"][0]["message"]["tool_calls"]] == [x["id"] for x in calls]
                for call in again["choices"][0]["message"]["tool_calls"]:
                    if call["id"] not in ledger:
                        ledger[call["id"]] = step
                        effects[step] += 1
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            for call in calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": json.dumps({"ok": True, "args": json.loads(call["function"]["arguments"])}),
                    }
                )
    assert effects == Counter({1: 1, 2: 1, 3: 1})
    assert len(ledger) == 3


def test_an_unseeded_ollama_request_is_replayed_after_a_gateway_sigkill(tmp_path: Path) -> None:
    """Ollama /api/chat requests (sampled, no seed) in flight when the gateway is SIGKILLed
    are replayed after restart through their own endpoint, with the seed their first run
    chose, and complete exactly once."""
    state = str(tmp_path / "state")
    g = GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1", "--cpu-slots", "1"], state_dir=state)
    g.start()
    try:
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": COUNT_PROMPT}],
            "stream": False,
            "options": {"num_predict": 250},
        }

        def send(key: str) -> None:
            with contextlib.suppress(httpx.HTTPError):  # the gateway dies under it
                httpx.post(f"{g.url}/api/chat", json=body, headers={"Idempotency-Key": key}, timeout=120)

        threads = [threading.Thread(target=send, args=(f"o{i}",)) for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(journal_rows(state)) == 2, 30, "both accepted")
        g.kill9()
        for t in threads:
            t.join(60)
        g.restart()
        rows = wait_for(
            lambda: (
                (r := journal_rows(state))
                and all(x["state"] not in ("accepted", "queued", "admitted", "running") for x in r)
                and r
            ),
            240,
            "both ended",
        )
        assert [(r["state"], r["completions"]) for r in rows] == [("completed", 1), ("completed", 1)], rows
    finally:
        g.stop()


def test_a_resend_while_the_dropped_run_still_holds_its_worker_is_in_flight_then_resumes() -> None:
    """Round 24: a client drops a keyed stream and resends it at once. The dropped run ends
    resumable (499) at once, but its GPU worker lets go of the request only later (here it is
    SIGSTOPped), so its slot and device reservation are still out under the request's id. The
    resend resumed the request under that id beside it: on a second free slot its reservation
    raised ``KeyError`` (500 ``internal_error``, journaled ``failed``, and every later resend
    replayed that 500). Until the worker lets go the key is in flight (409 with Retry-After);
    then the resend resumes the request, and every reservation comes back."""
    config = {"supervisor": {"health_timeout_s": 60.0}}  # the stopped worker is not killed meanwhile
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "2"], config=config) as g:
        pid = int(ready_worker(g, "gpu")["pid"])
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": COUNT_PROMPT}],
            "max_tokens": 60,
            "temperature": 0,
            "stream": True,
        }
        with httpx.Client(base_url=g.url, timeout=120) as c:

            @contextlib.contextmanager
            def streaming(key: dict[str, str]) -> Iterator[str]:
                """A keyed stream with two tokens read, open for the block; dropped after it."""
                with c.stream("POST", "/v1/chat/completions", json=body, headers=key) as r:
                    lines = (line for line in r.iter_lines() if line.startswith("data: "))
                    next(lines), next(lines)  # tokens are coming
                    yield r.headers["x-spillover-request-id"]

            def dropped(rid: str) -> None:
                wait_for(lambda: c.get(f"/v1/requests/{rid}").json()["state"] == "resumable_error", 10, "the drop")

            key = {"Idempotency-Key": "r24-dropped"}
            stopped = False
            try:
                with streaming(key) as rid:
                    os.kill(pid, signal.SIGSTOP)
                    stopped = True
                dropped(rid)
                again = c.post("/v1/chat/completions", json=body, headers=key)
                assert again.status_code == 409, again.text
                assert again.json()["error"]["code"] == "idempotency_key_in_flight" and "retry-after" in again.headers
                doc = c.get(f"/v1/requests/{rid}").json()
                assert (doc["state"], doc["live"]) == ("resumable_error", True), doc
            finally:
                if stopped:
                    os.kill(pid, signal.SIGCONT)
            resumed = wait_for(
                lambda: (r := c.post("/v1/chat/completions", json=body, headers=key)).status_code != 409 and r,
                60,
                "the worker let go",
            )
            assert resumed.status_code == 200 and resumed.headers["x-spillover-request-id"] == rid, resumed.text
            doc = c.get(f"/v1/requests/{rid}").json()
            assert doc["state"] == "completed" and doc["attempts"] == 2, doc

            # A DELETE answers once the worker has let go too (bounded): a resend with the key
            # right after it gets the stored cancellation, not 409 in flight.
            key = {"Idempotency-Key": "r24-deleted"}
            with streaming(key) as rid:
                os.kill(pid, signal.SIGSTOP)
                resume = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))
                resume.start()
                try:
                    deleted = c.delete(f"/v1/requests/{rid}").json()
                finally:
                    resume.join()
            assert (deleted["state"], deleted["live"]) == ("cancelled", False), deleted
            again = c.post("/v1/chat/completions", json=body, headers=key)
            assert again.headers.get("idempotent-replayed") == "true", again.text
            assert '"code":"request_cancelled"' in again.text.replace(" ", ""), again.text  # its stream, as sent

            # Round 25: a DELETE of a request that already ended resumable (its client went away)
            # cancelled nothing, and a resend with its key then ran it. It now ends it CANCELLED
            # for good, and the key answers the cancellation.
            key = {"Idempotency-Key": "r25-dropped-then-deleted"}
            with streaming(key) as rid:
                pass
            dropped(rid)
            deleted = c.delete(f"/v1/requests/{rid}").json()
            assert deleted["state"] == "cancelled" and deleted["history"][-1]["from"] == "resumable_error", deleted
            again = c.post("/v1/chat/completions", json=body, headers=key)
            assert again.status_code == 409 and again.headers.get("idempotent-replayed") == "true", again.text
            assert again.json()["error"]["code"] == "request_cancelled"
            assert c.get(f"/v1/requests/{rid}").json()["attempts"] == 1  # it never ran again

            # The same DELETE while the dropped run's worker holds on past the DELETE's 2 s wait
            # (round 26: it returned before ending the request, which the key then ran again).
            key = {"Idempotency-Key": "r26-held-then-deleted"}
            try:
                with streaming(key) as rid:
                    os.kill(pid, signal.SIGSTOP)
                dropped(rid)
                deleted = c.delete(f"/v1/requests/{rid}").json()
                assert (deleted["state"], deleted["live"]) == ("cancelled", True), deleted
            finally:
                os.kill(pid, signal.SIGCONT)
            again = wait_for(
                lambda: (
                    (r := c.post("/v1/chat/completions", json=body, headers=key)).headers.get("idempotent-replayed")
                    and r
                ),
                30,
                "the worker let go",
            )
            assert again.json()["error"]["code"] == "request_cancelled", again.text
            assert c.get(f"/v1/requests/{rid}").json()["attempts"] == 1
        wait_for(lambda: g.status()["device"]["ledger"]["request_reservations"] == 0, 10, "reservations back")
