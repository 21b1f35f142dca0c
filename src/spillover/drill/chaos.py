"""The chaos scenarios (``spillover drill --profile chaos``): the ci scenarios, plus a hostile
or unlucky client and a failing disk. Each ends with the gateway at rest; the quiescence
invariants (``spillover.testing.invariants``) are checked after every profile.

- ``same_key_races``: several identical requests with one fresh Idempotency-Key at the same
  instant, on both lanes: at most one execution per key, ever.
- ``bad_schemas_mixed``: tool schemas that would crash or bloat a worker, mixed into normal
  traffic: each refused with a 400, no worker restarted, the breaker untouched.
- ``random_cancels``: DELETE at random points of a request's life: queued, running on either
  lane, streaming, during a failover, during the breaker's half-open probe.
- ``disk_full_window``: the journal's disk is full for a while under traffic: requests are
  answered or refused (503), none is stranded, and every outcome is journaled afterwards.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spillover.drill.scenarios import COUNT, SHORT, _greedy

if TYPE_CHECKING:
    from spillover.drill.runner import Drill

__all__ = ["CHAOS_SCENARIOS"]

BOMBS: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 200000},
    {"type": "string", "minLength": 10**9},
    {"type": "array", "minItems": 100000},
    {"type": "string", "pattern": "no anchors"},
]


def _race(d: Drill, scenario: str, name: str, body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` identical requests with one fresh key, released together."""
    key = f"race-{uuid.uuid4().hex}"
    gate = threading.Barrier(n)

    def one(k: int) -> dict[str, Any]:
        gate.wait()
        return d.client.op(scenario, f"{name}-{k}", body, key=key)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def same_key_races(d: Drill, n: int) -> None:
    """Concurrent retries of one request: one execution, the others 409 or its stored answer."""
    for i in range(3 * n):
        for lane in ("auto", "cpu"):
            body = {**_greedy(SHORT, 6), "spillover": {"prefer": lane}}
            rs = _race(d, "same_key_races", f"{lane}-{i}", body, 3)
            ran = [r for r in rs if r.get("status") == 200 and "idempotent-replayed" not in (r.get("headers") or {})]
            others_ok = all(r.get("status") == 200 or r.get("error_code") == "idempotency_key_in_flight" for r in rs)
            d.expect("same_key_races", "one execution per key", len(ran) == 1, [r.get("status") for r in rs])
            d.expect("same_key_races", "the others 409 or replay", others_ok, [r.get("error_code") for r in rs])
            ids = {r.get("request_id") for r in rs}
            d.expect("same_key_races", "one request id per key", len(ids) == 1, ids)


def bad_schemas_mixed(d: Drill, n: int) -> None:
    """Schema bombs among normal requests: 400 each; no worker restarts, breaker unmoved."""
    d.await_gpu()
    before = {w["lane"]: w["pid"] for w in d.client.status()["workers"]}
    failures = d.client.status()["breaker"]["failures"]
    jobs: list[tuple[str, str, dict[str, Any]]] = []  # (name, path, body)
    for i in range(2 * n):
        for j, schema in enumerate(BOMBS):
            body = {
                "messages": [{"role": "user", "content": "call it"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required",
                "max_tokens": 16,
            }
            jobs.append((f"bomb-{i}-{j}", "/v1/chat/completions", body))
        jobs.append((f"normal-{i}", "/v1/completions", _greedy(SHORT, 6)))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: d.client.op("bad_schemas_mixed", job[0], job[2], path=job[1]), jobs))
    bombs = [r for r in results if r["name"].startswith("bomb")]
    normal = [r for r in results if r["name"].startswith("normal")]
    d.expect("bad_schemas_mixed", "every bomb refused with 400", all(r.get("status") == 400 for r in bombs))
    d.expect("bad_schemas_mixed", "normal traffic served", all(r.get("status") == 200 for r in normal))
    st = d.client.status()
    d.expect("bad_schemas_mixed", "no worker restarted", {w["lane"]: w["pid"] for w in st["workers"]} == before)
    d.expect("bad_schemas_mixed", "breaker unmoved", st["breaker"]["failures"] <= failures, st["breaker"])


def _cancel_after(d: Drill, scenario: str, name: str, body: dict[str, Any], delay_s: float, **kw: Any) -> None:
    """Start a request, DELETE it after ``delay_s`` (it may have finished by then)."""
    key = f"cancel-{uuid.uuid4().hex}"
    rid: dict[str, str] = {}

    def run() -> None:
        r = d.client.op(scenario, name, body, key=key, **kw)
        rid["rid"] = r.get("request_id") or ""

    t = threading.Thread(target=run)
    t.start()
    time.sleep(delay_s)
    st = d.client.status()
    live = [x["rid"] for x in st["running"]] + [q["rid"] for lane in st["lanes"] for q in lane["queued"]]
    if live:  # one request at a time here: the live one is this one (unless it already ended)
        d.client.http.delete(f"/v1/requests/{live[0]}")
    t.join(120)


def random_cancels(d: Drill, n: int) -> None:
    """DELETE at random points: queued, running (both lanes, stream or not), during a
    failover, and the breaker's half-open probe; every request ends, the breaker recovers."""
    rng = random.Random(20261130)
    for i in range(2 * n):
        for lane in ("auto", "cpu"):
            for stream in (False, True):
                body = {**_greedy(COUNT, 80), "spillover": {"prefer": lane}}
                _cancel_after(d, "random_cancels", f"{lane}-{stream}-{i}", body, rng.uniform(0.0, 1.5), stream=stream)
    # During a failover: the GPU refuses the allocation, the replay is cancelled on its way.
    d.await_gpu()
    d.sim().fail_next(1)
    d.rec.write("fault", scenario="random_cancels", kind="fail_next", expect_recovery=True)
    _cancel_after(d, "random_cancels", "during-failover", _greedy(COUNT, 80), rng.uniform(0.05, 0.5))
    # During the breaker's probe: open it, wait for half-open, cancel the probe.
    d.await_gpu()
    d.sim().fail_next(1)
    d.rec.write("fault", scenario="random_cancels", kind="fail_next", expect_recovery=True)
    d.client.op("random_cancels", "trip", _greedy(SHORT, 4))
    d.wait(lambda: d.client.status()["breaker"]["circuit"] == "half_open", 30)
    _cancel_after(d, "random_cancels", "probe", _greedy(COUNT, 300), 0.5)
    with contextlib.suppress(TimeoutError):
        d.await_gpu(60)  # a released probe lets the next one in: the breaker closes again
    st = d.client.status()["breaker"]
    d.expect("random_cancels", "breaker closes after a cancelled probe", st["circuit"] == "closed", st)


def disk_full_window(d: Drill, n: int) -> None:
    """The journal's disk fills for a while under traffic: answered or refused, never stranded."""
    from spillover.runtime.journal import set_disk_full

    if d.state_dir is None:
        d.expect("disk_full_window", "needs the gateway's state folder", False)
        return
    journal = Path(d.state_dir) / "journal.sqlite3"
    stop = threading.Event()

    def traffic(k: int) -> list[dict[str, Any]]:
        out = []
        j = 0
        while not stop.is_set():
            out.append(d.client.op("disk_full_window", f"t{k}-{j}", _greedy(SHORT, 8), stream=j % 2 == 1))
            j += 1
            time.sleep(0.05)  # a refusal is instant: pace the clients
        return out

    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(traffic, k) for k in range(3)]
        time.sleep(1.0)
        set_disk_full(journal, True)
        d.rec.write("fault", scenario="disk_full_window", kind="disk_full", expect_recovery=False)
        try:
            time.sleep(1.5 + n)
        finally:
            set_disk_full(journal, False)
            d.rec.write("fault", scenario="disk_full_window", kind="disk_ok", expect_recovery=False)
        time.sleep(1.0)
        stop.set()
        results = [r for f in futs for r in f.result()]
    allowed = {"journal_unavailable", "request_cancelled", None}
    d.expect(
        "disk_full_window",
        "answered or refused with 503 journal_unavailable",
        all(r.get("status") in (200, 503) and r.get("error_code") in allowed for r in results),
        sorted({(r.get("status"), r.get("error_code")) for r in results}, key=str),
    )
    d.expect(
        "disk_full_window",
        "some requests were refused during the window",
        any(r.get("error_code") == "journal_unavailable" for r in results),
    )
    with contextlib.suppress(TimeoutError):
        d.wait(lambda: d.client.status()["journal_pending_outcomes"] == 0, 30)
    pending = d.client.status()["journal_pending_outcomes"]
    d.expect("disk_full_window", "every kept outcome journaled", pending == 0, pending)


CHAOS_SCENARIOS: dict[str, Callable[[Drill, int], None]] = {
    "same_key_races": same_key_races,
    "bad_schemas_mixed": bad_schemas_mixed,
    "random_cancels": random_cancels,
    "disk_full_window": disk_full_window,
}
