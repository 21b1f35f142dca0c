"""The drill's scenarios. Each takes the Drill and a scale (1 for ``ci``, more for ``full``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from spillover.drill.mixed import MIXED_SCENARIOS

if TYPE_CHECKING:
    from spillover.drill.runner import Drill

__all__ = ["SCENARIOS"]

SHORT = "Name three colours."
COUNT = "Count from 1 to 500, separated by commas: 1, 2, 3,"
LONG = "The quick brown fox jumps over the lazy dog. " * 60
MIB = 1024 * 1024


def _greedy(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def short_prompts(d: Drill, n: int) -> None:
    for i in range(4 * n):
        d.client.op("short_prompts", f"short-{i}", _greedy(SHORT, 16), stream=i % 2 == 1)


def long_prompts(d: Drill, n: int) -> None:
    for i in range(2 * n):
        d.client.op("long_prompts", f"long-{i}", _greedy(LONG, 48), stream=i % 2 == 0)


def concurrent_mixed(d: Drill, n: int) -> None:
    bodies = [
        (_greedy(SHORT, 16), False),
        (_greedy(LONG, 32), True),
        (_greedy(COUNT, 64), False),
        (_greedy(SHORT, 24), True),
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futs = [
            pool.submit(d.client.op, "concurrent_mixed", f"mixed-{i}", b, stream=s)
            for i, (b, s) in enumerate(bodies * 2 * n)
        ]
        for f in futs:
            f.result()


def gpu_tenant(d: Drill, n: int) -> None:
    """Another GPU tenant takes most of the device; long requests must spill, short ones fit."""
    with d.tenant(leave_mib=75):
        for i in range(n):
            d.client.op("gpu_tenant", f"short-{i}", _greedy(SHORT, 16))
            d.client.op("gpu_tenant", f"long-{i}", _greedy(LONG, 120))
    d.await_gpu()


def memory_ramp(d: Drill, n: int) -> None:
    """Capacity shrinks step by step while traffic continues, then comes back."""
    sim = d.sim()
    full = sim.snapshot().capacity_bytes
    used = sim.snapshot().used_bytes
    for step, left_mib in enumerate((400, 200, 110, 60, 20)):
        cap = used + left_mib * MIB
        sim.set_capacity(cap)
        d.rec.write("fault", scenario="memory_ramp", kind="capacity", capacity_bytes=cap)
        for i in range(n):
            d.client.op("memory_ramp", f"ramp-{step}-{i}", _greedy(COUNT, 40 + 20 * step))
    sim.set_capacity(full)
    d.rec.write("fault", scenario="memory_ramp", kind="capacity_restored", capacity_bytes=full)
    d.await_gpu()


def routing_before_admission(d: Drill, n: int) -> None:
    """Under pressure, a request that does not fit is routed to CPU before any GPU allocation fails."""
    before = d.client.status()["device"]["alloc_failures"]
    with d.tenant(leave_mib=60):
        for i in range(n):
            r = d.client.op("routing_before_admission", f"long-{i}", _greedy(LONG, 200))
            d.expect("routing_before_admission", "routed to cpu", r.get("route") == "cpu", r.get("headers"))
    after = d.client.status()["device"]["alloc_failures"]
    d.expect("routing_before_admission", "no GPU allocation failure", after == before, f"{before} -> {after}")


def alloc_failure(d: Drill, n: int) -> None:
    """An allocation failure before generation: replayed on CPU with the same id."""
    ref = d.reference(SHORT, 12)  # before any fault
    for i in range(n):
        d.await_gpu()
        d.sim().fail_next(1)
        d.rec.write("fault", scenario="alloc_failure", kind="fail_next", expect_recovery=True)
        r = d.client.op("alloc_failure", f"alloc-{i}", _greedy(SHORT, 12), reference=ref)
        d.expect("alloc_failure", "replayed on attempt 2", r.get("attempts") == 2, r.get("headers"))


def worker_kill(d: Drill, n: int) -> None:
    """The GPU worker dies (driver reset) mid-request and mid-stream."""
    for i in range(n):
        d.await_gpu()
        ref = d.reference(COUNT, 100)
        t = threading.Thread(target=d.kill_gpu_when_busy, args=("worker_kill",))
        t.start()
        d.client.op("worker_kill", f"mid-request-{i}", _greedy(COUNT, 100), reference=ref)
        t.join(30)
        d.await_gpu()
        killed: list[int] = []

        def on_token(k: int, killed: list[int] = killed) -> None:
            # the 5th frame with text: frames may carry several tokens ([server].stream_coalesce_ms),
            # and 5 of them are well inside 100 tokens whatever the engine's pace
            if k == 5 and not killed:
                killed.append(d.kill_gpu("worker_kill", reset=True))

        d.client.op(
            "worker_kill", f"mid-stream-{i}", _greedy(COUNT, 100), stream=True, reference=ref, on_token=on_token
        )


def stall(d: Drill, n: int) -> None:
    """The device hangs: no token progress is a stall; the request completes on CPU."""
    ref = d.reference(SHORT, 12)  # before any fault
    for i in range(n):
        d.await_gpu()
        d.sim().set_hang(True)
        d.rec.write("fault", scenario="stall", kind="hang", expect_recovery=True)
        try:
            d.client.op("stall", f"stall-{i}", _greedy(SHORT, 12), reference=ref)
        finally:
            d.sim().set_hang(False)
    d.await_gpu()


def cancel_queued_cpu(d: Drill, n: int) -> None:
    """A request waiting on the CPU lane is cancelled by id; its place frees at once."""
    for i in range(n):
        body = {**_greedy(COUNT, 150), "spillover": {"prefer": "cpu"}}
        slots = next(w["slots"] for w in d.client.status()["workers"] if w["lane"] == "cpu")
        with ThreadPoolExecutor(max_workers=slots + 1) as pool:
            futs = [pool.submit(d.client.op, "cancel_queued_cpu", f"fill-{i}-{k}", body) for k in range(slots + 1)]
            queued = d.wait(lambda: next((q for lane in d.client.status()["lanes"] for q in lane["queued"]), None), 20)
            t0 = time.monotonic()
            doc = d.client.http.delete(f"/v1/requests/{queued['rid']}").json()
            d.expect("cancel_queued_cpu", "cancelled", doc.get("state") == "cancelled", doc.get("state"))
            d.expect("cancel_queued_cpu", "freed within 1 s", time.monotonic() - t0 < 1.0, time.monotonic() - t0)
            for f in futs:
                f.result()


def streaming(d: Drill, n: int) -> None:
    """The same greedy request streamed and not streamed gives the same text."""
    for i in range(n):
        ref = d.reference(COUNT, 60)
        d.client.op("streaming", f"off-{i}", _greedy(COUNT, 60), reference=ref)
        d.client.op("streaming", f"on-{i}", _greedy(COUNT, 60), stream=True, reference=ref)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "transfer",
            "parameters": {
                "type": "object",
                "properties": {"amount": {"type": "integer"}, "to": {"type": "string"}},
                "required": ["amount", "to"],
            },
        },
    }
]


def agent_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One step of the agent: a greedy chat that must call ``transfer``."""
    return {
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 60,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "transfer"}},
    }


def _agent(d: Drill, scenario: str, agent: str, n: int, *, keys: bool) -> None:
    """An agent loop with a side-effecting tool; the GPU worker dies mid-step, and the
    agent re-sends a step after 'crashing' between executing and saving its progress."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Pay Bob 5, then Carol 7, then Dan 9."}]
    applied: set[str] = set()

    def execute(calls: list[dict[str, Any]], step: int) -> None:
        """Apply each tool call once: the side-effect ledger is keyed by tool_call_id."""
        for call in calls:
            if call["id"] not in applied:
                applied.add(call["id"])
                d.rec.write("tool", scenario=scenario, agent=agent, step=step, tool_call_id=call["id"])

    for step in range(1, 3 * n + 1):
        body = agent_body(messages)
        key = f"{agent}-step-{step}" if keys else None
        if step % 3 == 2:
            d.await_gpu()
            threading.Thread(target=d.kill_gpu_when_busy, args=(scenario,)).start()
        res: dict[str, Any] = {}
        for attempt in range(20):
            res = d.client.op(
                scenario,
                f"{agent}-{step}-{attempt}",
                body,
                path="/v1/chat/completions",
                key=key or f"{agent}-step-{step}-try-{attempt}",
            )
            if res["type"] == "ok":
                break
            time.sleep(0.5)
        calls = res.get("tool_calls") or []
        execute(calls, step)
        if step % 3 == 0:  # crashed after executing, before saving progress: the step is sent again
            again = d.client.op(
                scenario,
                f"{agent}-{step}-resend",
                body,
                path="/v1/chat/completions",
                key=key or f"{agent}-step-{step}-resend",
            )
            execute(again.get("tool_calls") or [], step)
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": '{"ok": true}'} for c in calls]


def agent_tool(d: Drill, n: int) -> None:
    _agent(d, "agent_tool", "agent", n, keys=True)


def agent_negative_control(d: Drill, n: int) -> None:
    """Negative control: the same agent without Idempotency-Keys re-sends a step and gets new
    tool-call ids, so its ledger applies the effect twice; the checker must catch it."""
    _agent(d, "agent_negative_control", "naive-agent", 1, keys=False)


def gateway_restart(d: Drill, n: int) -> None:
    """The gateway is SIGKILLed with work queued and running, then restarted; every accepted
    request must end completed or with an explicit error."""
    if d.gateway is None:
        d.rec.write("info", scenario="gateway_restart", op=0, note="skipped: the drill does not own the gateway")
        return
    d.await_gpu()
    results: list[dict[str, Any]] = []
    ops = [(f"restart-{i}", _greedy(COUNT, 150), i % 3 == 0) for i in range(4 * n)]
    with ThreadPoolExecutor(max_workers=len(ops)) as pool:
        futs = [pool.submit(d.client.op, "gateway_restart", name, body, stream=s) for name, body, s in ops]
        d.wait(lambda: d.client.status()["live_requests"] >= 2, 30)
        time.sleep(0.5)
        d.rec.write("fault", scenario="gateway_restart", kind="gateway_sigkill", expect_recovery=True)
        d.gateway.kill9()
        results = [f.result() for f in futs]
    d.gateway.restart()
    d.await_gpu()
    streams = {name: s for name, _, s in ops}
    for r in results:  # resolve: the same key and body give the stored outcome (or resume it)
        if r["type"] != "info" and r.get("request_id") is not None:
            continue
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = d.client.op(
                "gateway_restart", f"resolve-{r['name']}", _greedy(COUNT, 150), key=r["key"], stream=streams[r["name"]]
            )
            if got.get("status") != 409:  # 409: the recovered request is still running
                break
            time.sleep(0.5)
    d.wait(lambda: d.client.status()["live_requests"] == 0, 120)


def idempotency(d: Drill, n: int) -> None:
    """Same key and body: the stored bytes; same key, other body: 422."""
    for i in range(n):
        key = f"idem-{i}-{int(time.time())}"
        a = d.client.op("idempotency", f"first-{i}", _greedy(SHORT, 8), key=key)
        b = d.client.op("idempotency", f"replay-{i}", _greedy(SHORT, 8), key=key)
        d.expect(
            "idempotency",
            "replayed",
            (b.get("headers") or {}).get("idempotent-replayed") == "true" and a.get("text") == b.get("text"),
            b.get("headers"),
        )
        c = d.client.op("idempotency", f"mismatch-{i}", _greedy(SHORT, 9), key=key)
        d.expect("idempotency", "422 on another body", c.get("status") == 422, c.get("status"))


SCENARIOS: dict[str, Callable[[Drill, int], None]] = {
    "short_prompts": short_prompts,
    "long_prompts": long_prompts,
    "concurrent_mixed": concurrent_mixed,
    "gpu_tenant": gpu_tenant,
    "memory_ramp": memory_ramp,
    "routing_before_admission": routing_before_admission,
    "alloc_failure": alloc_failure,
    "worker_kill": worker_kill,
    "stall": stall,
    "cancel_queued_cpu": cancel_queued_cpu,
    "streaming": streaming,
    "agent_tool": agent_tool,
    "agent_negative_control": agent_negative_control,
    "gateway_restart": gateway_restart,
    "idempotency": idempotency,
    **MIXED_SCENARIOS,
}
NEGATIVE_CONTROLS = frozenset({"agent_negative_control"})
