"""Running one generation request: prompt -> tokens -> scheduler -> worker -> response."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from spillover.errors import (
    AllocationFailed,
    ContextLengthExceeded,
    NotFound,
    SpilloverError,
    WorkerFailed,
)
from spillover.http.schemas import GenerationRequest, tool_schema
from spillover.runtime.gateway import Gateway
from spillover.runtime.scheduler import Dispatch, Job
from spillover.runtime.worker_client import WorkerGone

__all__ = ["Prepared", "Run", "new_request_id", "prepare", "start"]


def new_request_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex[:24]


def tool_call_id(rid: str, index: int) -> str:
    """Stable tool-call id: derived from the request id, so a replay keeps it."""
    return "call_" + hashlib.sha256(f"{rid}:{index}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Prepared:
    """A request turned into tokens and limits, ready for the scheduler."""

    rid: str
    req: GenerationRequest
    tokens: list[int]
    max_tokens: int
    json_schema: str | None
    seed: int


def _tool_system_prompt(req: GenerationRequest) -> dict[str, Any]:
    fns = [t["function"] for t in req.tools if req.forced_tool in ("*", t["function"]["name"])]
    return {
        "role": "system",
        "content": 'You call functions. Reply with one JSON object {"name": ..., "arguments": {...}} '
        "that calls one of these functions:\n" + json.dumps(fns),
    }


def _render(gw: Gateway, req: GenerationRequest) -> tuple[list[int], str | None]:
    tok = gw.tokenizer
    if req.kind == "text":
        return tok.tokenize(req.prompt, special=False), None
    messages = [dict(m) for m in req.messages]
    schema: str | None = None
    if req.forced_tool is not None:
        messages.insert(0, _tool_system_prompt(req))
        schema = json.dumps(tool_schema(req.tools, req.forced_tool))
    prompt = tok.render_chat(messages, [dict(t) for t in req.tools] or None)
    return tok.tokenize(prompt, special=True), schema


async def prepare(gw: Gateway, req: GenerationRequest, rid: str) -> Prepared:
    """Check the model, tokenize, and apply the context limits (400 when too long)."""
    if req.model != gw.cfg.model.name:
        raise NotFound(
            f"model {req.model!r} does not exist; this server serves {gw.cfg.model.name!r}",
            param="model",
            code="model_not_found",
        )
    tokens, schema = await asyncio.to_thread(_render, gw, req)
    caps = [gw.cfg.cpu_lane.ctx_cap_tokens]
    if gw.device is not None:
        caps.append(gw.cfg.gpu_lane.ctx_cap_tokens)
    cap = min(max(caps), gw.tokenizer.n_ctx_train)
    n = len(tokens)
    if n >= cap or (req.max_tokens is not None and n + req.max_tokens > cap):
        want = n + (req.max_tokens or 1)
        raise ContextLengthExceeded(
            f"this request needs {want} tokens ({n} in the prompt) but the longest context "
            f"any lane serves is {cap} tokens",
            param="messages" if req.kind == "chat" else "prompt",
        )
    max_tokens = (
        req.max_tokens if req.max_tokens is not None else min(gw.cfg.model.default_max_tokens, cap - n)
    )
    seed = req.seed if req.seed is not None else gw.cfg.model.seed
    return Prepared(rid, req, tokens, max_tokens, schema, seed)


@dataclass
class Run:
    """A dispatched request: its events come from the worker."""

    prep: Prepared
    gw: Gateway
    job: Job
    dispatch: Dispatch
    started_s: float
    events: AsyncIterator[dict[str, Any] | WorkerGone]
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    outcome: str = "failed"
    _closed: bool = False

    @property
    def degraded(self) -> bool:
        return self.dispatch.route != "gpu"

    def spillover_object(self) -> dict[str, Any]:
        d = self.dispatch
        return {
            "request_id": self.prep.rid,
            "route": d.route,
            "degraded": self.degraded,
            "reason": d.reason,
            "model": self.gw.cfg.model.name,
            "limits": {"max_tokens": d.max_tokens, "ctx": d.kv_tokens},
            "shrunk": d.shrunk,
            "attempts": 1,
            "queued_ms": int(d.queued_s * 1000),
        }

    def headers(self) -> dict[str, str]:
        d = self.dispatch
        return {
            "X-Spillover-Request-Id": self.prep.rid,
            "X-Spillover-Route": d.route,
            "X-Spillover-Degraded": "1" if self.degraded else "0",
            "X-Spillover-Reason": d.reason,
            "X-Spillover-Model": self.gw.cfg.model.name,
            "X-Spillover-Limits": f"max_tokens={d.max_tokens};ctx={d.kv_tokens}",
            "X-Spillover-Queue-Position": "0",
            "X-Spillover-Estimated-Delay-Ms": "0",
        }

    async def next_event(self) -> dict[str, Any]:
        """The next worker event; a dead worker or a worker error raises a typed error."""
        item = await anext(self.events)
        if isinstance(item, WorkerGone):
            raise WorkerFailed(
                f"the {self.dispatch.route} worker failed mid-request ({item.kind}: "
                f"{item.message}); request {self.prep.rid} did not complete",
                retry_after_s=1.0,
            )
        if item.get("ev") == "error":
            if item.get("kind") == "alloc_failed":
                raise AllocationFailed(
                    f"device memory allocation failed: {item.get('message')}", retry_after_s=1.0
                )
            raise WorkerFailed(f"worker error: {item.get('message')}", retry_after_s=1.0)
        return item

    async def close(self) -> None:
        """Release slot and reservation exactly once, feeding the breaker the outcome."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await self.events.aclose()  # type: ignore[attr-defined]
        self.dispatch.worker.release_slot(self.prep.rid)
        assert self.gw.scheduler is not None
        self.gw.scheduler.finished(self.prep.rid, self.dispatch, self.outcome)

    def usage(self) -> dict[str, int]:
        n = len(self.prep.tokens)
        return {
            "prompt_tokens": n,
            "completion_tokens": self.completion_tokens,
            "total_tokens": n + self.completion_tokens,
        }


async def start(gw: Gateway, prep: Prepared) -> Run:
    """Queue the request, wait for a slot, and wait until the worker has its memory."""
    assert gw.scheduler is not None
    sched = gw.scheduler
    now = time.monotonic()
    job = Job(
        rid=prep.rid,
        prompt_tokens=len(prep.tokens),
        max_tokens=prep.max_tokens,
        arrived_s=now,
        allow_shrink=prep.req.allow_shrink,
    )
    sched.submit_nowait(job)
    try:
        dispatch = await job.future
    except asyncio.CancelledError:
        sched.withdraw(job)
        if job.future.done() and not job.future.cancelled() and job.future.exception() is None:
            d = job.future.result()
            d.worker.release_slot(prep.rid)
            sched.finished(prep.rid, d, "cancelled")
        raise
    msg = {
        "rid": prep.rid,
        "tokens": prep.tokens,
        "max_tokens": dispatch.max_tokens,
        "temperature": prep.req.temperature,
        "top_p": prep.req.top_p,
        "seed": prep.seed,
        "stop": list(prep.req.stop),
        "json_schema": prep.json_schema,
        "kv_tokens": dispatch.kv_tokens,
        "reserve_bytes": dispatch.reserve_bytes,
    }
    run = Run(prep, gw, job, dispatch, now, dispatch.worker.generate(msg))
    try:
        ev = await run.next_event()  # "started": the device granted the memory
        if ev.get("ev") != "started":
            raise WorkerFailed(f"unexpected worker event {ev.get('ev')!r}")
        sched.confirmed(prep.rid)
    except BaseException as exc:
        run.outcome = "severe" if isinstance(exc, WorkerFailed) else "cancelled"
        await run.close()
        raise
    return run


async def collect(run: Run) -> None:
    """Drive a run to its end (non-stream)."""
    try:
        while True:
            ev = await run.next_event()
            if ev["ev"] == "token":
                run.text.append(ev["text"])
                if ev["id"] >= 0:
                    run.completion_tokens += 1
            elif ev["ev"] == "done":
                run.finish_reason = ev["finish_reason"]
                run.outcome = "ok"
                return
    except SpilloverError:
        run.outcome = "severe"
        raise
    finally:
        await run.close()


def tool_calls_from(run: Run) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` from the constrained output of a forced tool call."""
    if run.prep.req.forced_tool is None:
        return None
    raw = "".join(run.text)
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise WorkerFailed(
            f"the tool call was cut off before it was complete "
            f"(finish_reason={run.finish_reason}); raise max_tokens"
        ) from exc
    return [
        {
            "id": tool_call_id(run.prep.rid, 0),
            "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])},
        }
    ]
