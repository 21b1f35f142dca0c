"""The drill's mixed-service scenarios: chat, the embeddings and the transcription service on
one device budget.

``embedding_burst``: a burst of large embedding batches holds the device while a long chat
arrives; chat admission sees the burst's reservation in the one ledger and routes the chat to
the CPU lane before any allocation fails. ``service_demotion``: another tenant leaves room for
a long chat only if the idle batch service's weights go; the chat demotes the service (its
weights are unloaded) and runs on the GPU, an embeddings request meanwhile is served on the
service's CPU path flagged ``demoted``, and the service is promoted back once the room has
lasted ``promote_after_s``. ``transcription_burst``: long transcriptions hold the device
while a long chat arrives; the chat goes to the CPU lane (or demotes the idle embeddings
service) before any allocation fails, and every transcription ends with the text a quiet
GPU gives. ``transcription_gpu_kill``: the transcription GPU worker is SIGKILLed mid-file;
the request is replayed whole on its CPU replica with the same text. All check that the
device never refused an allocation.

The room figures are chosen for the default models (SmolLM2-135M chat, bge-small-en
embeddings); each scenario records what it set so a report reader can see the arithmetic.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spillover.testing.audio import speech_of

if TYPE_CHECKING:
    from spillover.drill.runner import Drill

__all__ = ["MIXED_SCENARIOS"]

MIB = 1024 * 1024
EMB_LONG = "lorem ipsum dolor sit amet " * 50  # about 450 tokens an input: large activations
EMB_SHORT = "The cat sits on the mat."
CHAT_LONG = {"prompt": "The quick brown fox jumps over the lazy dog. " * 60, "max_tokens": 120, "temperature": 0}
# Room left beside a burst: a short chat fits (about 51 MiB predicted), the long one (about 117 MiB) does not.
BURST_ROOM_MIB = 60
# Room a tenant leaves: under the long chat's need, but over it once the embeddings weights
# (about 47 MiB predicted) are unloaded.
DEMOTION_ROOM_MIB = 90
# Three files of this: two on the GPU (about 194 MiB predicted each), one on the CPU path. A
# file must outlast [admission].delay_max_s (2 s) by far: the long chat may wait that long for
# room, and takes the GPU when a file ends (30 s of audio took 2.2 s on a fast machine: the
# chat then waited and fitted, and the check failed though the gateway did as it should).
TRANSCRIBE_BURST_S = 90.0
BURST_FILES = 3
TRANSCRIBE_KILL_S = 40.0  # long enough that a kill half a second in lands mid-file


def _gpu_service(d: Drill, scenario: str, kind: str) -> dict[str, Any] | None:
    """The first service of ``kind`` with a GPU worker, or None (recorded: the scenario is skipped)."""
    for svc in d.client.status().get("services", []):
        if svc.get("kind") == kind and any(w["lane"] == "gpu" for w in svc.get("workers", [])):
            return dict(svc)
    d.rec.write("info", scenario=scenario, op=0, note=f"skipped: no {kind} service with a GPU worker")
    return None


def _squeeze(d: Drill, scenario: str) -> None:
    """Cut the device to what the ledger holds now plus ``BURST_ROOM_MIB`` (a short chat
    fits, the long one does not), and wait until the gateway has read it."""
    ledger = d.client.status()["device"]["ledger"]
    cap = ledger["predicted_bytes"] + ledger["margin_bytes"] + BURST_ROOM_MIB * MIB
    d.sim().set_capacity(cap)
    d.rec.write("fault", scenario=scenario, kind="capacity", capacity_bytes=cap)
    # The gateway has read the new capacity (as it would a tenant's allocation) before the chat comes.
    d.wait(functools.partial(_capacity_seen, d, cap), 10)


def _restore(d: Drill, scenario: str, full: int) -> None:
    d.sim().set_capacity(full)
    d.rec.write("fault", scenario=scenario, kind="capacity_restored", capacity_bytes=full)


def _service(d: Drill, name: str) -> dict[str, Any]:
    return next(s for s in d.client.status()["services"] if s["name"] == name)


def _promoted_since(d: Drill, name: str, promotions: int) -> bool:
    row = _service(d, name)
    return bool(row["promotions"] > promotions and not row["demoted"])


def _capacity_seen(d: Drill, capacity_bytes: int) -> bool:
    return bool(d.client.status()["device"]["ledger"]["capacity_bytes"] == capacity_bytes)


def _alloc_failures(d: Drill) -> tuple[int, int]:
    """Allocation failures the device reported, and those its workers (every service's) saw."""
    st = d.client.status()
    workers = st["workers"] + [w for s in st.get("services", []) for w in s.get("workers", [])]
    return int((st.get("device") or {}).get("alloc_failures", 0)), sum(int(w.get("alloc_failures", 0)) for w in workers)


def _cosine(a: list[float] | None, b: list[float] | None) -> float:
    if not a or not b or len(a) != len(b):
        return 0.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def _embed(d: Drill, scenario: str, name: str, model: str, inputs: list[str]) -> dict[str, Any]:
    return d.client.op(scenario, name, {"model": model, "input": inputs}, path="/v1/embeddings")


def _background(fn: Callable[[], dict[str, Any]]) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """Run one operation in a thread; its outcome lands in the list."""
    out: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def embedding_burst(d: Drill, n: int) -> None:
    """A burst of large embedding batches on the GPU pushes a long chat to the CPU lane."""
    svc = _gpu_service(d, "embedding_burst", "embeddings")
    if svc is None:
        return
    model = svc["name"]
    for i in range(n):
        d.await_gpu()
        ref = _embed(d, "embedding_burst", f"reference-{i}", model, [EMB_LONG])
        before = _alloc_failures(d)
        full = d.sim().snapshot().capacity_bytes
        burst, out = _background(functools.partial(_embed, d, "embedding_burst", f"burst-{i}", model, [EMB_LONG] * 24))
        try:
            d.wait(lambda: _service(d, model)["reserved_bytes"] > 0, 60)  # the burst holds its bytes on the GPU
            _squeeze(d, "embedding_burst")
            chat = d.client.op("embedding_burst", f"long-chat-{i}", CHAT_LONG)
            d.expect("embedding_burst", "long chat routed to cpu", chat.get("route") == "cpu", chat.get("headers"))
        finally:
            burst.join(300)
            _restore(d, "embedding_burst", full)
        got = out[0] if out else {}
        d.expect("embedding_burst", "burst served on the gpu", got.get("route") == "gpu", got.get("headers"))
        same = _cosine(got.get("embedding0"), ref.get("embedding0"))
        d.expect("embedding_burst", "same input, same vector (cosine >= 0.9999)", same >= 0.9999, round(same, 6))
        after = _alloc_failures(d)
        d.expect("embedding_burst", "no allocation failure", after == before, f"{before} -> {after}")


def service_demotion(d: Drill, n: int) -> None:
    """Interactive chat demotes the idle batch service under pressure; it is promoted back."""
    svc = _gpu_service(d, "service_demotion", "embeddings")
    if svc is None:
        return
    model = svc["name"]
    if svc.get("priority") != "batch":
        d.rec.write("info", scenario="service_demotion", op=0, note=f"skipped: {model} is not a batch service")
        return
    for i in range(n):
        d.await_gpu()
        before = _alloc_failures(d)
        start = _service(d, model)
        demotions, promotions = svc_counts = (start["demotions"], start["promotions"])
        with d.tenant(leave_mib=DEMOTION_ROOM_MIB):
            chat, out = _background(functools.partial(d.client.op, "service_demotion", f"chat-{i}", CHAT_LONG))
            try:
                d.wait(lambda: _service(d, model)["demoted"], 60)
                e = _embed(d, "service_demotion", f"while-demoted-{i}", model, [EMB_SHORT])
                reason = (e.get("headers") or {}).get("x-spillover-reason")
                d.expect(
                    "service_demotion",
                    "embeddings served on its cpu path while demoted",
                    e.get("route") == "cpu" and reason == "demoted",
                    e.get("headers"),
                )
            finally:
                chat.join(300)
            got = out[0] if out else {}
            d.expect("service_demotion", "long chat ran on the gpu", got.get("route") == "gpu", got.get("headers"))
        d.wait(functools.partial(_promoted_since, d, model, promotions), 120)
        row = _service(d, model)
        d.expect("service_demotion", "demoted once", row["demotions"] == demotions + 1, svc_counts)
        d.expect(
            "service_demotion",
            "ladder journaled with its reasons",
            [x["event"] for x in row["ladder"][-2:]] == ["demoted", "promoted"],
            row["ladder"][-2:],
        )
        after = _alloc_failures(d)
        d.expect("service_demotion", "no allocation failure", after == before, f"{before} -> {after}")


def _transcribe(d: Drill, scenario: str, name: str, model: str, audio: bytes) -> dict[str, Any]:
    return d.client.op(
        scenario, name, {"model": model}, path="/v1/audio/transcriptions", files={"file": ("drill.wav", audio)}
    )


def _gpu_row(d: Drill, name: str) -> dict[str, Any]:
    return next(w for w in _service(d, name)["workers"] if w["lane"] == "gpu")


def _charged(d: Drill) -> bool:
    """Every byte the ledger has granted is on the device (workers have charged them)."""
    st = d.client.status()
    return bool(d.sim().snapshot().used_bytes >= st["device"]["ledger"]["predicted_bytes"])


def transcription_burst(d: Drill, n: int) -> None:
    """Long transcriptions on the GPU push a long chat to the CPU lane (or demote embeddings)."""
    svc = _gpu_service(d, "transcription_burst", "transcription")
    if svc is None:
        return
    model = svc["name"]
    audio = speech_of(TRANSCRIBE_BURST_S)
    for i in range(n):
        d.await_gpu()
        ref = _transcribe(d, "transcription_burst", f"reference-{i}", model, audio)
        before = _alloc_failures(d)
        demotions = sum(int(s.get("demotions", 0)) for s in d.client.status()["services"])
        full = d.sim().snapshot().capacity_bytes
        burst = [
            _background(functools.partial(_transcribe, d, "transcription_burst", f"burst-{i}-{k}", model, audio))
            for k in range(BURST_FILES)
        ]
        try:
            # The burst holds its bytes: every GPU slot taken and charged on the device (a
            # capacity cut before a dispatched file's worker charged it would be a surprise
            # tenant, answered by a failover, not the pressure this scenario is about).
            d.wait(lambda: _gpu_row(d, model)["busy"] >= min(BURST_FILES, _gpu_row(d, model)["slots"]), 60)
            d.wait(functools.partial(_charged, d), 10)
            _squeeze(d, "transcription_burst")
            chat = d.client.op("transcription_burst", f"long-chat-{i}", CHAT_LONG)
            demoted = sum(int(s.get("demotions", 0)) for s in d.client.status()["services"]) > demotions
            d.expect(
                "transcription_burst",
                "long chat routed to cpu (or the embeddings service demoted for it)",
                chat.get("route") == "cpu" or (chat.get("route") == "gpu" and demoted),
                chat.get("headers"),
            )
        finally:
            for t, _ in burst:
                t.join(600)
            _restore(d, "transcription_burst", full)
        got = [out[0] if out else {} for _, out in burst]
        d.expect(
            "transcription_burst",
            "every transcription answered with the reference text",
            all(g.get("status") == 200 and g.get("text") == ref.get("text") for g in got),
            [(g.get("route"), g.get("status")) for g in got],
        )
        after = _alloc_failures(d)
        d.expect("transcription_burst", "no allocation failure", after == before, f"{before} -> {after}")


def transcription_gpu_kill(d: Drill, n: int) -> None:
    """SIGKILL of the transcription GPU worker mid-file: replayed on the CPU with the same text."""
    svc = _gpu_service(d, "transcription_gpu_kill", "transcription")
    if svc is None:
        return
    model = svc["name"]
    audio = speech_of(TRANSCRIBE_KILL_S)
    for i in range(n):
        d.await_gpu()
        ref = _transcribe(d, "transcription_gpu_kill", f"reference-{i}", model, audio)
        t, out = _background(functools.partial(_transcribe, d, "transcription_gpu_kill", f"killed-{i}", model, audio))
        try:
            gpu = d.wait(lambda: (w := _gpu_row(d, model))["busy"] and w, 60)
            time.sleep(0.5)  # mid-file: a few segments decoded, none delivered
            d.rec.write(
                "fault", scenario="transcription_gpu_kill", kind="sigkill", pid=gpu["pid"], expect_recovery=True
            )
            os.kill(int(gpu["pid"]), signal.SIGKILL)
        finally:
            t.join(600)
        got = out[0] if out else {}
        headers = got.get("headers") or {}
        d.expect(
            "transcription_gpu_kill",
            "replayed on the cpu replica, flagged",
            got.get("route") == "cpu" and str(headers.get("x-spillover-reason", "")).startswith("failover:"),
            headers,
        )
        d.expect("transcription_gpu_kill", "same text as the reference", got.get("text") == ref.get("text"),
                 (got.get("text") or "")[:80])  # fmt: skip


MIXED_SCENARIOS = {
    "embedding_burst": embedding_burst,
    "service_demotion": service_demotion,
    "transcription_burst": transcription_burst,
    "transcription_gpu_kill": transcription_gpu_kill,
}
