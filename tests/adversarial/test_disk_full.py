"""A full disk under the journal (injected: every write fails with ENOSPC, through the same
path as a real full disk): nothing accepted is stranded, nothing refused is half-accepted,
and when the disk has room again every outcome reaches the journal."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from spillover.runtime.journal import set_disk_full
from spillover.testing import GatewayProcess
from spillover.testing.invariants import wait_quiescent
from tests.e2e.helpers import COUNT_PROMPT, healthy_client, stream, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """A gateway with one CPU slot, so a second CPU request waits in the queue."""
    with GatewayProcess(["--gpu", "sim:1024", "--cpu-slots", "1"], config={"cpu_lane": {"canary_ratio": 0.0}}) as g:
        yield g


def journal(gw: GatewayProcess) -> Path:
    return Path(gw.state_dir) / "journal.sqlite3"


def test_a_full_disk_refuses_new_requests_without_binding_their_key(gw: GatewayProcess) -> None:
    """While the disk is full a new request gets 503 journal_unavailable (nothing accepted,
    nothing run); its Idempotency-Key is not bound, so the same request runs once there is room."""
    key = uuid.uuid4().hex
    body = {"prompt": "Say hi.", "max_tokens": 3, "temperature": 0}
    with healthy_client(gw) as c:
        set_disk_full(journal(gw), True)
        try:
            r = c.post("/v1/completions", json=body, headers={"Idempotency-Key": key})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "journal_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            assert c.get(f"/v1/requests/{r.headers['x-spillover-request-id']}").status_code == 404
            status = gw.status()  # round 18: it said normal, with no reason, while it refused everything
            assert status["mode"] == "unavailable", status["reasons"]
            assert any("journal cannot write" in why for why in status["reasons"])
        finally:
            set_disk_full(journal(gw), False)
        r = c.post("/v1/completions", json=body, headers={"Idempotency-Key": key})
        assert r.status_code == 200 and "idempotent-replayed" not in r.headers, r.text
        assert not any("journal" in why for why in gw.status()["reasons"])
    assert wait_quiescent(gw.status, journal(gw)) == []


def test_requests_in_flight_when_the_disk_fills_end_and_their_outcomes_are_kept(gw: GatewayProcess) -> None:
    """A running CPU request and one queued behind it when the disk fills: both run to their
    end (the queued one's ADMITTED and RUNNING moves are not waited for and wait for the disk:
    journal rule 7), but neither answer is sent while it is not durable (round 16: a gateway
    killed then re-ran requests whose answers their clients had, and a key gave a different
    answer): each client gets 503 ``journal_unavailable``, resumable, with its request id; the
    key answers 409 meanwhile. Both outcomes wait in memory and reach the journal, every move
    in order, once the disk has room; the key then answers from the journal."""
    out: dict[str, Any] = {}
    key = uuid.uuid4().hex
    running = {"prompt": COUNT_PROMPT, "max_tokens": 120, "temperature": 0, "spillover": {"prefer": "cpu"}}
    queued = {"prompt": "Name a fruit.", "max_tokens": 3, "temperature": 0, "spillover": {"prefer": "cpu"}}

    def send(name: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            out[name] = c.post("/v1/completions", json=body, headers=headers)

    with healthy_client(gw) as c:
        a = threading.Thread(target=send, args=("running", running, {}))
        a.start()
        wait_for(lambda: any(x["route"] == "cpu" for x in gw.status()["running"]), 30, "running on cpu")
        b = threading.Thread(target=send, args=("queued", queued, {"Idempotency-Key": key}))
        b.start()
        wait_for(lambda: any(q for lane in gw.status()["lanes"] for q in lane["queued"]), 30, "queued")
        set_disk_full(journal(gw), True)
        try:
            a.join(120)
            b.join(120)
            for r in (out["running"], out["queued"]):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "journal_unavailable" and int(r.headers["retry-after"]) >= 1
                assert "could not be made durable" in r.json()["error"]["detail"]
            assert wait_for(lambda: gw.status()["journal_pending_outcomes"] == 2, 10, "outcomes kept")
            early = c.post("/v1/completions", json=queued, headers={"Idempotency-Key": key})
            assert early.status_code == 409 and int(early.headers["retry-after"]) >= 1, early.text
        finally:
            set_disk_full(journal(gw), False)
        wait_for(lambda: gw.status()["journal_pending_outcomes"] == 0, 20, "outcomes written")
        rid_a = out["running"].headers["x-spillover-request-id"]
        rid_b = out["queued"].headers["x-spillover-request-id"]
        assert c.get(f"/v1/requests/{rid_a}").json()["state"] == "completed"
        assert c.get(f"/v1/requests/{rid_b}").json()["state"] == "completed"
        for rid in (rid_a, rid_b):
            moves = [h["to"] for h in c.get(f"/v1/requests/{rid}").json()["history"]]
            assert moves == ["accepted", "queued", "admitted", "running", "completed"], (rid, moves)
        again = c.post("/v1/completions", json=queued, headers={"Idempotency-Key": key})
        assert again.status_code == 200 and again.headers["x-spillover-request-id"] == rid_b, again.text
        assert again.headers["idempotent-replayed"] == "true" and again.json()["choices"][0]["text"]
    assert wait_quiescent(gw.status, journal(gw)) == []


def test_a_stream_that_ends_while_the_disk_is_full_ends_resumable_and_its_key_gets_it_after(
    gw: GatewayProcess,
) -> None:
    """The disk fills while a stream runs (its first token's delivery was journaled): its
    tokens go on, but its end is not sent as a finish while it is not durable: the last frame
    is ``journal_unavailable`` (resumable), then ``[DONE]``. Once the disk has room the kept
    outcome is journaled, and the key answers the whole stream as it ran, its finish included."""
    key = uuid.uuid4().hex
    body = {"prompt": COUNT_PROMPT, "max_tokens": 60, "temperature": 0, "spillover": {"prefer": "cpu"}}
    filled: list[bool] = []

    def on_token(n: int) -> None:
        if n == 3 and not filled:
            filled.append(True)
            set_disk_full(journal(gw), True)

    with healthy_client(gw) as c:
        try:
            got = stream(c, "/v1/completions", body, headers={"Idempotency-Key": key}, on_token=on_token)
            assert filled and got["done"] and got["text"], got
            assert got["error"] is not None and got["error"]["code"] == "journal_unavailable", got
            assert got["finish"] is None  # no finish went out before the error
        finally:
            set_disk_full(journal(gw), False)
        wait_for(lambda: gw.status()["journal_pending_outcomes"] == 0, 20, "outcome written")
        again = stream(c, "/v1/completions", body, headers={"Idempotency-Key": key})
        assert again["headers"]["idempotent-replayed"] == "true", again
        assert again["error"] is None and again["finish"] == "length" and again["text"].startswith(got["text"])
    assert wait_quiescent(gw.status, journal(gw)) == []
