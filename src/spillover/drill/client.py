"""The drill's client: every operation is recorded (invoke, then ok / fail / info)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from spillover.drill.recorder import Recorder

__all__ = ["DrillClient"]

SIGNAL_HEADERS = (
    "x-spillover-request-id",
    "x-spillover-route",
    "x-spillover-degraded",
    "x-spillover-reason",
    "x-spillover-model",
    "x-spillover-limits",
    "x-spillover-attempts",
    "retry-after",
    "idempotent-replayed",
)


class DrillClient:
    """Sends OpenAI-shaped requests and records a Jepsen-style history."""

    def __init__(self, url: str, rec: Recorder, timeout_s: float = 300.0) -> None:
        self.url = url
        self.rec = rec
        self.http = httpx.Client(base_url=url, timeout=timeout_s)
        self.seen_ids: set[str] = set()

    def close(self) -> None:
        self.http.close()

    def status(self) -> dict[str, Any]:
        return dict(self.http.get("/v1/status", timeout=10).json())

    def op(
        self,
        scenario: str,
        name: str,
        body: dict[str, Any],
        *,
        path: str = "/v1/completions",
        stream: bool = False,
        key: str | None = None,
        reference: str | None = None,
        on_token: Any = None,
        headers: dict[str, str] | None = None,
        files: dict[str, tuple[str, bytes]] | None = None,
    ) -> dict[str, Any]:
        """Run one operation; returns its outcome record. With ``files`` the body is sent as
        multipart form fields beside them (the audio API)."""
        op = self.rec.next_op()
        key = key or f"drill-{op}"
        self.rec.write("invoke", scenario=scenario, op=op, name=name, stream=stream, key=key)
        t0 = time.monotonic()
        res: dict[str, Any] = {"scenario": scenario, "op": op, "name": name, "key": key}
        hdrs = {"Idempotency-Key": key, **(headers or {})}
        try:
            if stream:
                res |= self._stream(path, body, hdrs, on_token, t0)
            else:
                if files is not None:
                    r = self.http.post(path, data=body, files=files, headers=hdrs)
                else:
                    r = self.http.post(path, json=body, headers=hdrs)
                res |= self._headers(r.headers) | {"status": r.status_code}
                data = r.json()
                if r.status_code == 200 and "choices" not in data and "data" not in data:  # a transcript
                    sp = data.get("spillover") or {}
                    res |= {
                        "text": data.get("text"),
                        "attempts": sp.get("attempts"),
                        "degraded_body": sp.get("degraded"),
                        "model_fallback": False,
                    }
                elif r.status_code == 200 and "choices" not in data:  # an embeddings answer
                    sp = data.get("spillover") or {}
                    rows = data.get("data") or []
                    res |= {
                        "vectors": len(rows),
                        # The first vector, to compare with a reference (the same input, any lane).
                        "embedding0": [round(x, 7) for x in rows[0]["embedding"]] if rows else None,
                        "attempts": sp.get("attempts"),
                        "degraded_body": sp.get("degraded"),
                        "model_fallback": False,
                    }
                elif r.status_code == 200:
                    sp = data.get("spillover") or {}
                    choice = data["choices"][0]
                    res |= {
                        "text": choice.get("text")
                        if "text" in choice
                        else (choice.get("message") or {}).get("content"),
                        "tokens": data.get("usage", {}).get("completion_tokens"),
                        "attempts": sp.get("attempts"),
                        "degraded_body": sp.get("degraded"),
                        "model_fallback": bool(sp.get("fallback")),
                        "tool_calls": (choice.get("message") or {}).get("tool_calls"),
                    }
                else:
                    res |= {"error_code": (data.get("error") or {}).get("code"), "error": data.get("error")}
        except httpx.HTTPError as exc:
            res |= {"error": f"{type(exc).__name__}: {exc}"}
            return self.rec.write("info", **res, latency_s=round(time.monotonic() - t0, 4))
        res["latency_s"] = round(time.monotonic() - t0, 4)
        if res.get("request_id"):
            self.seen_ids.add(res["request_id"])
        if reference is not None:
            res["reference_text"] = reference
        res["stream"] = stream
        kind = "ok" if res.get("status") == 200 and not res.get("error") else "fail"
        return self.rec.write(kind, **res)

    @staticmethod
    def _headers(h: httpx.Headers) -> dict[str, Any]:
        got = {k: h.get(k) for k in SIGNAL_HEADERS if h.get(k) is not None}
        return {
            "headers": got,
            "request_id": h.get("x-spillover-request-id") or None,
            "route": h.get("x-spillover-route"),
            "header_route": h.get("x-spillover-route"),
            "degraded_header": h.get("x-spillover-degraded"),
        }

    def _stream(
        self, path: str, body: dict[str, Any], hdrs: dict[str, str], on_token: Any, t0: float
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"text": "", "frames": 0}  # frames with text: a frame may carry several tokens
        with self.http.stream("POST", path, json={**body, "stream": True}, headers=hdrs) as r:
            out |= self._headers(r.headers) | {"status": r.status_code}
            if r.status_code != 200:
                r.read()
                err = r.json().get("error") or {}
                return out | {"error_code": err.get("code"), "error": err}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    return out | {"error_code": ev["error"].get("code"), "error": ev["error"]}
                if "spillover" in ev:
                    sp = ev["spillover"]
                    out |= {
                        "route": sp["route"],
                        "attempts": sp.get("attempts"),
                        "degraded_body": sp["degraded"],
                        "model_fallback": bool(sp.get("fallback")),
                    }
                for ch in ev.get("choices", []):
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        if out["frames"] == 0:
                            out["ttft_s"] = round(time.monotonic() - t0, 4)
                        out["text"] += piece
                        out["frames"] += 1
                        if on_token is not None:
                            on_token(out["frames"])
        return out

    def finals(self) -> None:
        """Ask the journal for the last word on every request id seen."""
        for rid in sorted(self.seen_ids):
            try:
                r = self.http.get(f"/v1/requests/{rid}", timeout=30)
                state = r.json().get("state") if r.status_code == 200 else None
            except httpx.HTTPError:
                state = None
            self.rec.write("final", request_id=rid, state=state, accepted=state is not None)
