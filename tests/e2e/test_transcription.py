"""The transcription service beside chat on one (sim) device: OpenAI's audio API through the
official client, every response format, bad audio, failover at the request boundary,
idempotency, deadlines, cancellation, the CPU path when the device is full, and a gateway
SIGKILL. The spoken clip is ``spillover.testing.audio``'s (espeak-ng, made once)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess
from spillover.testing.audio import SPOKEN_WORDS, speech_clip, speech_of
from tests.e2e.helpers import wait_for, while_hung

pytestmark = pytest.mark.e2e

CLIP = speech_clip()
WORDS = SPOKEN_WORDS


def _long_clip(repeats: int) -> bytes:
    """The clip ``repeats`` times over, with a second of silence between: a longer WAV."""
    return speech_of(repeats * 6.874)


def _service(gw: GatewayProcess) -> dict[str, Any]:
    return next(s for s in gw.status()["services"] if s["kind"] == "transcription")


def _worker(gw: GatewayProcess, lane: str) -> dict[str, Any]:
    return next(w for w in _service(gw)["workers"] if w["lane"] == lane)


def _post(gw: GatewayProcess, data: dict[str, Any], content: bytes, **kw: Any) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/audio/transcriptions",
        data={"model": "whisper-1", **data},
        files={"file": ("clip.wav", content, "audio/wav")},
        timeout=300,
        **kw,
    )


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "sim:1024"], services=("chat", "transcription")) as g:
        yield g


def test_the_openai_client_transcribes_the_clip_in_every_format(gw: GatewayProcess) -> None:
    """audio.transcriptions.create: the text holds the spoken words; srt and vtt are valid
    subtitle files; verbose_json has segments and, when asked, words; json carries the
    spillover object."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    plain = client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", CLIP))
    text = plain.text.lower()
    assert all(w in text for w in WORDS), plain.text
    raw = client.audio.transcriptions.with_raw_response.create(model="whisper-tiny.en", file=CLIP)
    assert raw.headers["x-spillover-route"] == "gpu" and raw.headers["x-spillover-degraded"] == "0"
    assert raw.parse().text == plain.text
    sp = httpx.Response(200, content=raw.http_response.content).json()["spillover"]
    assert sp["route"] == "gpu" and sp["model"] == "whisper-tiny.en" and sp["attempts"] == 1

    as_text = client.audio.transcriptions.create(model="whisper-1", file=CLIP, response_format="text")
    assert str(as_text).strip() == plain.text

    srt = str(client.audio.transcriptions.create(model="whisper-1", file=CLIP, response_format="srt"))
    cues = [c for c in srt.strip().split("\n\n") if c]
    stamp = r"(\d\d):(\d\d):(\d\d),(\d\d\d)"
    last = -1.0
    for n, cue in enumerate(cues, start=1):
        lines = cue.split("\n")
        assert lines[0] == str(n)
        m = re.fullmatch(f"{stamp} --> {stamp}", lines[1])
        assert m, lines[1]
        g = [int(x) for x in m.groups()]
        start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
        end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
        assert last <= start < end and lines[2:]
        last = start
    assert "quick brown fox" in srt.lower()

    vtt = str(client.audio.transcriptions.create(model="whisper-1", file=CLIP, response_format="vtt"))
    assert vtt.startswith("WEBVTT\n\n")
    assert re.search(r"^\d\d:\d\d:\d\d\.\d\d\d --> \d\d:\d\d:\d\d\.\d\d\d$", vtt, re.M)

    verbose = client.audio.transcriptions.create(
        model="whisper-1",
        file=CLIP,
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert verbose.language == "english" and 5.5 < verbose.duration < 6.5
    assert verbose.segments and verbose.segments[0].start == 0.0
    assert verbose.words and any(w.word.strip().lower().startswith("fox") for w in verbose.words)
    assert all(a.start <= b.start for a, b in zip(verbose.words, verbose.words[1:], strict=False))


@pytest.mark.parametrize(
    ("content", "data", "status", "param", "fragment"),
    [
        (b"this is not audio at all", {}, 400, "file", "not audio"),
        (b"", {}, 400, "file", "empty"),
        (CLIP[: len(CLIP) // 2], {}, 400, "file", "truncated"),
        (CLIP, {"response_format": "mp3"}, 400, "response_format", "response_format"),
        (CLIP, {"temperature": "2"}, 400, "temperature", "temperature"),
        (CLIP, {"language": "de"}, 400, "language", "English-only"),
        (CLIP, {"timestamp_granularities[]": "word"}, 400, "timestamp_granularities[]", "verbose_json"),
        (CLIP, {"stream": "maybe"}, 400, "stream", "stream"),
        (CLIP, {"stream": "true", "response_format": "vtt"}, 400, "stream", "stream"),
        (CLIP, {"bogus": "1"}, 400, "bogus", "unknown field"),
        (CLIP, {"model": "nope"}, 404, "model", "nope"),
        (CLIP, {"model": "smollm2"}, 400, "model", "/v1/chat/completions"),
    ],
)
def test_bad_audio_and_bad_fields_get_a_clear_openai_error(
    gw: GatewayProcess, content: bytes, data: dict[str, Any], status: int, param: str, fragment: str
) -> None:
    r = _post(gw, data, content)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment.lower() in err["message"].lower(), err


def test_a_missing_file_a_json_body_and_translation_are_refused(gw: GatewayProcess) -> None:
    """No file part is a 400 naming 'file'; a JSON body is a 415 naming the form type; the
    English-only model cannot translate (400 model_not_supported)."""
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": "whisper-1"}, files={"x": ("a", b"b")})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("file", "x")
    r = httpx.post(gw.url + "/v1/audio/transcriptions", json={"model": "whisper-1"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/audio/translations", data={"model": "whisper-1"}, files={"file": ("a.wav", CLIP)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    # Round 31: two file parts (a form Starlette cannot read) named no field; as every bad upload, 'file'.
    two = [("file", ("a.wav", CLIP)), ("file", ("b.wav", CLIP))]
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": "whisper-1"}, files=two)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text


def _variant(i: int) -> bytes:
    """The clip with its last sample changed: the same audio, other bytes (another upload)."""
    b = bytearray(CLIP)
    b[-1] ^= 1 + i
    return bytes(b)


def test_no_upload_is_left_behind_by_a_refusal_a_replay_or_an_answer(gw: GatewayProcess) -> None:
    """Each upload is stored before its request is checked: a request refused after that
    (a bad field, a bad header, a deadline it cannot meet), a key's stored answer and a
    request answered leave no file behind (they were left until the 24 h sweep)."""
    uploads = Path(gw.state_dir) / "uploads"

    def left(content: bytes) -> bool:
        return (uploads / hashlib.sha256(content).hexdigest()).exists()

    refused = [
        ({"response_format": "xml"}, {}),
        ({"language": "klingon"}, {}),
        ({}, {"Idempotency-Key": "has space"}),
        ({}, {"X-Spillover-Deadline-Ms": "abc"}),
        ({}, {"X-Spillover-Deadline-Ms": "1"}),  # a deadline no lane can meet: 503
    ]
    for i, (data, headers) in enumerate(refused):
        r = _post(gw, data, _variant(i), headers=headers)
        assert r.status_code in (400, 503), r.text
        assert not left(_variant(i)), (data, headers)
    key = {"Idempotency-Key": f"uploads-{time.monotonic_ns()}"}
    first = _post(gw, {}, _variant(9), headers=key)
    assert first.status_code == 200 and not left(_variant(9))
    again = _post(gw, {}, _variant(9), headers=key)
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert not left(_variant(9))


def test_a_body_cut_short_is_told_as_such(gw: GatewayProcess) -> None:
    """A multipart body that ends inside its file part (a Content-Length shorter than the
    body) is told as such, naming 'file' (it was "'file' is required")."""
    cut = (
        b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
        b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + CLIP[:5000]
    )
    r = httpx.post(
        gw.url + "/v1/audio/transcriptions",
        content=cut,
        headers={"Content-Type": "multipart/form-data; boundary=xyz"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    assert "closing boundary" in r.json()["error"]["message"], r.text


def test_a_hung_gpu_is_a_stall_replayed_on_cpu_and_its_worker_restarted() -> None:
    """A GPU that hangs holds a transcription only until the stall bound (a few times the
    clip's expected time at the GPU's measured speed, at least ``[failover].stall_timeout_s``),
    not ``request_timeout_s``: its worker is killed and restarted, and the CPU path answers the
    same text. Its own gateway: a short bound, and a hang no other test may see."""
    with GatewayProcess(
        ["--gpu", "sim:1024"], services=("chat", "transcription"), config={"failover": {"stall_timeout_s": 3.0}}
    ) as g:
        ref = _post(g, {}, CLIP)
        assert ref.headers["x-spillover-route"] == "gpu", ref.text
        pid = _worker(g, "gpu")["pid"]
        r, took = while_hung(g, lambda: _post(g, {}, CLIP))
        assert r.status_code == 200, r.text
        assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-reason"] == "failover:stall"
        assert 3.0 <= took < 120, took
        assert r.json()["text"] == ref.json()["text"]
        wait_for(lambda: (w := _worker(g, "gpu"))["state"] == "ready" and w["pid"] != pid, 90, "a new gpu worker")


def test_a_gpu_that_hangs_mid_file_is_caught_within_a_window_not_the_files_length() -> None:
    """Round 70: the stall bound covered all the audio after the last segment, so a device that
    hung early in a long file held it for minutes (305 s in a 600 s file). The worker now says
    each 30 s window begun (``engine.transcribe_worker`` rule 4), and a wait covers one window:
    here at most ``4 x`` the GPU's seconds for 30 s of audio, not for the 270 s left."""
    long_clip = speech_of(300.0)
    with GatewayProcess(
        ["--gpu", "sim:1024"], services=("chat", "transcription"), config={"failover": {"stall_timeout_s": 3.0}}
    ) as g:
        ref = _post(g, {}, CLIP)  # the GPU's speed, measured
        assert ref.headers["x-spillover-route"] == "gpu", ref.text
        pid = _worker(g, "gpu")["pid"]
        got: list[httpx.Response] = []
        t = threading.Thread(target=lambda: got.append(_post(g, {}, long_clip)))
        t.start()
        on_gpu = lambda: any(r["route"] == "gpu" for r in g.status()["running"]) or None  # noqa: E731
        wait_for(on_gpu, 30, "the file running on the GPU")
        time.sleep(2.0)  # its first windows decoded (the whole file takes the GPU about 11 s here)
        dev = SimDevice(g.state_dir)
        dev.set_hang(True)
        hung_at = time.monotonic()
        try:
            wait_for(lambda: _worker(g, "gpu")["pid"] != pid or None, 60, "the hung GPU worker killed")
            caught_s = time.monotonic() - hung_at
        finally:
            dev.set_hang(False)
        t.join(180)
        assert got and got[0].status_code == 200, got
        assert got[0].headers["x-spillover-reason"] == "failover:stall", got[0].headers
        assert caught_s < 20.0, caught_s  # a window's bound; the audio left took about 50 s before


def test_idempotency_key_replays_the_same_bytes_and_another_file_is_422(gw: GatewayProcess) -> None:
    first = _post(gw, {"response_format": "verbose_json"}, CLIP, headers={"Idempotency-Key": "tx-1"})
    again = _post(gw, {"response_format": "verbose_json"}, CLIP, headers={"Idempotency-Key": "tx-1"})
    other = _post(gw, {"response_format": "verbose_json"}, _long_clip(2), headers={"Idempotency-Key": "tx-1"})
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    doc = httpx.get(f"{gw.url}/v1/requests/{first.headers['x-spillover-request-id']}").json()
    assert doc["state"] == "completed" and doc["kind"] == "transcription"


def test_a_deadline_the_service_cannot_meet_is_refused_at_once_with_the_eta(gw: GatewayProcess) -> None:
    """Refused at once with the ETA to retry by, while a lane's speed is still a guess (here the
    CPU replica's: no request ran there yet), so "never" cannot be said."""
    t0 = time.monotonic()
    r = _post(gw, {}, _long_clip(4), headers={"X-Spillover-Deadline-Ms": "50"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    assert float(r.headers["retry-after"]) >= 1 and time.monotonic() - t0 < 10
    assert r.headers["x-should-retry"] == "true"


def test_a_deadline_the_file_alone_overruns_is_refused_and_not_retried() -> None:
    """Round 70: a deadline no retry can meet (the file alone, at the lane's measured speed,
    nothing ahead) was a retryable 503 with Retry-After: the openai SDK retried a 1 ms deadline
    for 50 s. Now it says not to retry, and the SDK raises at once. A CPU-only gateway: its one
    lane's speed measured by a first request."""
    with GatewayProcess(["--gpu", "none"], services=("chat", "transcription")) as g:
        first = _post(g, {}, CLIP)
        assert first.status_code == 200 and first.headers["x-spillover-route"] == "cpu", first.text
        r = _post(g, {}, _long_clip(4), headers={"X-Spillover-Deadline-Ms": "50"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"
        assert r.headers["x-spillover-reason"] == "deadline_exceeded" and "alone" in r.json()["error"]["detail"]
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="x")  # default max_retries=2
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            client.audio.transcriptions.create(
                model="whisper-1", file=("clip.wav", _long_clip(4)), extra_headers={"X-Spillover-Deadline-Ms": "1"}
            )
        assert e.value.status_code == 503 and time.monotonic() - t0 < 5  # no retries


def test_a_gpu_fault_mid_transcription_replays_on_cpu_with_the_same_text(gw: GatewayProcess) -> None:
    """An OOM between two segments on the GPU worker: the request is replayed whole on the
    CPU replica at its boundary (nothing was delivered) and gives the same text."""
    audio = _long_clip(4)
    ref = _post(gw, {"response_format": "verbose_json"}, audio)
    assert ref.status_code == 200 and ref.headers["x-spillover-route"] == "gpu"
    assert len(ref.json()["segments"]) >= 3
    out: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _post(gw, {"response_format": "verbose_json"}, audio)))
    t.start()
    wait_for(lambda: _worker(gw, "gpu")["busy"] >= 1, 60, "running on the gpu")
    SimDevice(gw.state_dir).fail_running(1)
    t.join(240)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-degraded"] == "1"
    assert r.headers["x-spillover-reason"] == "failover:oom"
    assert r.json()["spillover"]["attempts"] == 2
    assert r.json()["text"] == ref.json()["text"]
    assert [s["text"] for s in r.json()["segments"]] == [s["text"] for s in ref.json()["segments"]]


def test_delete_of_a_running_transcription_ends_it_cancelled(gw: GatewayProcess) -> None:
    """DELETE stops a long transcription: 409 request_cancelled, journaled cancelled, and its
    slot and device bytes come back."""
    out: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _post(gw, {}, _long_clip(8))))
    t.start()
    running = wait_for(lambda: gw.status()["running"], 60, "running")
    rid = running[0]["rid"]
    wait_for(lambda: _service(gw)["running"] >= 1, 60, "on a worker")
    assert httpx.delete(f"{gw.url}/v1/requests/{rid}", timeout=60).status_code == 200
    t.join(120)
    r = out["r"]
    assert r.status_code == 409 and r.json()["error"]["code"] == "request_cancelled"
    assert r.headers["x-should-retry"] == "false"
    rec = httpx.get(f"{gw.url}/v1/requests/{rid}").json()
    assert rec["state"] == "cancelled"
    # the answer says where it ran, as its record does (round 33: the 409 said route none)
    assert rec["route"] in ("gpu", "cpu") and r.headers["x-spillover-route"] == rec["route"], (rec, r.headers)
    wait_for(lambda: _service(gw)["running"] == 0 and _service(gw)["reserved_bytes"] == 0, 30, "lease back")
    # Counted with the reason it ran where it ran, as a cancelled chat request is (round 31: "none").
    metrics = httpx.get(f"{gw.url}/metrics").text.splitlines()
    cancelled = [line for line in metrics if line.startswith('spillover_requests_total{outcome="cancelled"')]
    assert cancelled and not [line for line in cancelled if 'reason="none"' in line], cancelled


def test_a_long_file_while_the_gpu_is_full_goes_to_the_cpu_path_before_any_allocation_fails(
    gw: GatewayProcess,
) -> None:
    """Another tenant leaves less room than a long file's predicted bytes: the request is
    routed to the CPU replica, flagged degraded; nothing was refused by the device."""
    sim = SimDevice(gw.state_dir)
    wait_for(lambda: _worker(gw, "gpu")["state"] == "ready" and _service(gw)["running"] == 0, 60, "idle")
    before = sim.snapshot().alloc_failures
    snap = sim.snapshot()
    margin = gw.status()["device"]["ledger"]["margin_bytes"]
    room = 40 * 1024 * 1024  # under any transcription's prediction (the 30 s window alone is ~94 MiB)
    assert sim.allocate("tenant", snap.capacity_bytes - snap.used_bytes - margin - room, owner="test-tenant")
    try:
        time.sleep(0.5)  # the gateway reads the device (every 100 ms)
        r = _post(gw, {}, _long_clip(3))
        assert r.status_code == 200, r.text
        assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-degraded"] == "1"
        assert all(w in r.json()["text"].lower() for w in WORDS)
    finally:
        sim.free("tenant")
    assert sim.snapshot().alloc_failures == before


def test_a_model_load_that_does_not_fit_serves_on_the_cpu_path_flagged_degraded() -> None:
    """With no room for the Whisper weights beside chat, its GPU load waits (never an OOM)
    and transcriptions are answered on the CPU replica, flagged degraded with the reason."""
    # sim:200: chat's resident runs (its short requests fit) and leaves less than Whisper's 111 MB
    with GatewayProcess(["--gpu", "sim:200"], services=("chat", "transcription"), wait_all_workers=False) as g:
        wait_for(lambda: _worker(g, "cpu")["state"] == "ready" and _service(g)["load_waiting"], 90, "cpu only")
        r = _post(g, {}, CLIP)
        assert r.status_code == 200, r.text
        assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-degraded"] == "1"
        assert r.json()["spillover"]["degraded"] is True and r.headers["x-spillover-reason"]
        assert all(w in r.json()["text"].lower() for w in WORDS)
        assert g.status()["device"]["alloc_failures"] == 0 and _worker(g, "gpu")["starts"] == 0


def test_an_upload_over_the_limit_is_refused_while_it_is_read() -> None:
    """max_upload_mib = 1: a 3 MiB upload is a 413 (with or without Content-Length), and
    audio longer than max_audio_s is a 413 naming 'file'."""
    svc = {"name": "whisper-tiny.en", "kind": "transcription", "aliases": ["whisper-1"], "gpu": False,
           "max_upload_mib": 1, "max_audio_s": 8.0}  # fmt: skip
    with GatewayProcess(["--gpu", "none"], services=("chat", "transcription"), config={"services": [svc]}) as g:
        big = b"\0" * (3 * 1024 * 1024)
        r = _post(g, {}, big)
        assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text  # as every audio error

        def chunks() -> Iterator[bytes]:
            boundary = b"--xyz\r\n"
            yield boundary + b'Content-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
            yield boundary + b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
            for _ in range(48):
                yield b"\0" * 65536
            yield b"\r\n--xyz--\r\n"

        r = httpx.post(
            g.url + "/v1/audio/transcriptions",
            content=chunks(),
            headers={"Content-Type": "multipart/form-data; boundary=xyz"},
            timeout=60,
        )
        assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text
        r = _post(g, {}, _long_clip(2))
        assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text
        ok = _post(g, {}, CLIP)
        assert ok.status_code == 200 and ok.headers["x-spillover-route"] == "cpu"


def test_a_transcription_survives_a_gateway_sigkill(tmp_path: Path) -> None:
    """Accepted then SIGKILLed with the gateway: after a restart it is replayed from the
    stored upload and its key answers the journaled transcript."""
    g = GatewayProcess(["--gpu", "sim:1024"], state_dir=str(tmp_path / "s"), services=("chat", "transcription"))
    g.start()
    try:
        audio = _long_clip(4)

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the gateway dies under it
                _post(g, {}, audio, headers={"Idempotency-Key": "survive-tx"})

        threading.Thread(target=send, daemon=True).start()
        wait_for(lambda: g.status()["running"], 60, "running")
        g.kill9()
        g.restart()

        def finished() -> httpx.Response | None:
            r = _post(g, {}, audio, headers={"Idempotency-Key": "survive-tx"})
            return r if r.status_code == 200 else None

        r: httpx.Response = wait_for(finished, 240, "replayed")
        assert r.headers["idempotent-replayed"] == "true"
        assert all(w in r.json()["text"].lower() for w in WORDS)
        assert g.status()["recovered"]["replayed"] == 1
    finally:
        g.stop()


def _sse(body: bytes) -> list[Any]:
    out: list[Any] = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_stream_sends_segments_as_decoded_and_replays_the_same_bytes(gw: GatewayProcess) -> None:
    """stream=true: OpenAI's transcript.text.delta events (one per segment), then
    transcript.text.done with the whole text and the spillover object, then [DONE]; the
    openai client reads them; a retry with the key gets the same bytes."""
    audio = _long_clip(3)
    whole = _post(gw, {}, audio).json()["text"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    events = list(client.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(deltas) >= 3 and len(done) == 1
    assert "".join(deltas).strip() == whole == done[0].text
    first = _post(gw, {"stream": "true"}, audio, headers={"Idempotency-Key": "tx-stream"})
    again = _post(gw, {"stream": "true"}, audio, headers={"Idempotency-Key": "tx-stream"})
    assert first.headers["content-type"].startswith("text/event-stream")
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    evs = _sse(first.content)
    assert evs[-1] == "[DONE]" and evs[-2]["type"] == "transcript.text.done"
    assert evs[-2]["spillover"]["route"] == "gpu" and evs[-2]["usage"]["seconds"] >= 20
    assert [e["segment"]["id"] for e in evs[:-2]] == list(range(len(evs) - 2))
    # the first delta carries the spillover object (DESIGN: in the first chunk), the others do not
    assert evs[0]["spillover"] == evs[-2]["spillover"] and not any("spillover" in e for e in evs[1:-2])
    r = _post(gw, {"stream": "true", "response_format": "srt"}, audio)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_a_gpu_fault_mid_stream_continues_on_cpu_without_repeating_a_segment(gw: GatewayProcess) -> None:
    """Segments of the first window were sent when the GPU worker hits an OOM: the CPU
    replica replays the file, its first segments equal those sent (same compute type), and
    the stream continues from the first new one: the whole text equals a quiet run's."""
    audio = _long_clip(12)  # about 82 s: three windows
    ref = _post(gw, {"response_format": "verbose_json"}, audio).json()
    received: list[Any] = []
    with httpx.stream(
        "POST",
        gw.url + "/v1/audio/transcriptions",
        data={"model": "whisper-1", "stream": "true"},
        files={"file": ("a.wav", audio)},
        timeout=300,
    ) as r:
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "gpu"
        armed = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            received.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if not armed:
                SimDevice(gw.state_dir).fail_running(1)  # the next segment boundary on the GPU fails
                armed = True
    deltas = [e for e in received if isinstance(e, dict) and e.get("type") == "transcript.text.delta"]
    done = next(e for e in received if isinstance(e, dict) and e.get("type") == "transcript.text.done")
    assert received[-1] == "[DONE]"
    assert [e["segment"]["id"] for e in deltas] == list(range(len(ref["segments"])))
    assert [e["delta"] for e in deltas] == [s["text"] for s in ref["segments"]]
    assert done["text"] == ref["text"]
    assert done["spillover"]["route"] == "cpu" and done["spillover"]["attempts"] == 2
    assert done["spillover"]["reason"] == "failover:oom"
    # the spillover object in the first delta, and again in the first one after the failover
    told = [(i, e["spillover"]) for i, e in enumerate(deltas) if "spillover" in e]
    assert [(sp["route"], sp["attempts"], sp["degraded"]) for _, sp in told] == [("gpu", 1, False), ("cpu", 2, True)]
    assert told[0][0] == 0 and told[1][1] == done["spillover"], told
    # round 23: the journal and /metrics said the stream's first reason ("fits"), and stream false
    rec = httpx.get(f"{gw.url}/v1/requests/{r.headers['x-spillover-request-id']}", timeout=30).json()
    assert (rec["route"], rec["reason"], rec["stream"]) == ("cpu", "failover:oom", True), rec
    assert rec["history"][-1]["reason"] == "failover:oom"
    running = [(h["route"], h["attempt"]) for h in rec["history"] if h["to"] == "running"]
    assert running == [("gpu", 1), ("cpu", 2)], rec["history"]  # each attempt's RUNNING names its lane
    metrics = httpx.get(f"{gw.url}/metrics", timeout=30).text
    assert 'spillover_requests_total{outcome="completed",reason="failover:oom",route="cpu"}' in metrics


def test_a_stream_that_ends_in_an_error_has_openais_error_shape_and_done(gw: GatewayProcess) -> None:
    """A DELETE mid-stream: after the segments sent, one error event in OpenAI's shape
    (``error.code``, what openai-python reads) and then ``[DONE]``, as a chat stream ends (it
    was ``{"error": {"error": {...}}}`` with no ``[DONE]``)."""
    received: list[Any] = []
    with httpx.stream(
        "POST",
        gw.url + "/v1/audio/transcriptions",
        data={"model": "whisper-1", "stream": "true"},
        files={"file": ("a.wav", _long_clip(12))},
        timeout=300,
    ) as r:
        assert r.status_code == 200
        rid = r.headers["x-spillover-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                received.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if len(received) == 1:
                    assert httpx.delete(f"{gw.url}/v1/requests/{rid}", timeout=60).status_code == 200
    assert received[0]["type"] == "transcript.text.delta" and received[-1] == "[DONE]", received
    assert received[-2]["error"]["code"] == "request_cancelled" and received[-2]["error"]["message"], received
    assert httpx.get(f"{gw.url}/v1/requests/{rid}").json()["state"] == "cancelled"


def test_ollama_show_of_a_transcription_service_is_a_404_in_ollamas_shape(gw: GatewayProcess) -> None:
    """Ollama has no transcription model kind: /api/show of the service (by its id, an alias or
    with Ollama's default tag) is a 404 in Ollama's shape that names the route which serves it;
    the chat model is shown."""
    for name in ("whisper-tiny.en", "whisper-1", "whisper-tiny.en:latest"):
        r = httpx.post(gw.url + "/api/show", json={"model": name})
        assert r.status_code == 404 and r.json()["code"] == "model_not_found", (name, r.text)
        assert "/v1/audio/transcriptions" in r.json()["error"], r.text
    assert httpx.post(gw.url + "/api/show", json={"model": "smollm2-135m-instruct:latest"}).status_code == 200
