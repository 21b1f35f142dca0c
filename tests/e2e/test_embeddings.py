"""The embeddings service beside chat on one (sim) device: the OpenAI and Ollama shapes, one
device budget, failover at request boundaries, idempotency, cancel and recovery."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from spillover.config import load_config
from spillover.core.embed_memory import EmbedMemoryModel
from spillover.core.profiles import device_bytes
from spillover.engine.embedder import EmbedTokenizer, default_embed_model_dir, read_embed_model_info
from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess
from tests.e2e.helpers import replay_after_sigkill, wait_for, while_hung

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
LONG_TEXT = "lorem ipsum dolor sit amet " * 50  # about 450 tokens: big activations, slow (~10 s a chunk)
MEDIUM_TEXT = "lorem ipsum dolor sit amet " * 10  # about 90 tokens
PARAPHRASES = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Quarterly tax filings are due in April."]


def _service(gw: GatewayProcess, name: str = "bge-small-en") -> dict[str, Any]:
    return next(s for s in gw.status()["services"] if s["name"] == name)


def _service_worker(gw: GatewayProcess, lane: str) -> dict[str, Any]:
    return next(w for w in _service(gw)["workers"] if w["lane"] == lane)


def _vectors(doc: dict[str, Any]) -> np.ndarray:
    rows = []
    for d in doc["data"]:
        e = d["embedding"]
        rows.append(np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else np.array(e))
    return np.array(rows, dtype=np.float32)


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "sim:1024"], services=("chat", "embeddings")) as g:
        yield g


def test_openai_client_embeddings_and_a_paraphrase_scores_higher(gw: GatewayProcess) -> None:
    """The official client's embeddings.create (base64 by default, and float) returns
    normalised 384-d vectors; a paraphrase is closer than an unrelated sentence."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model="bge-small-en", input=PARAPHRASES)
    v = np.array([d.embedding for d in got.data])
    assert v.shape == (3, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] + 0.2 and sim[0, 1] > sim[1, 2] + 0.2
    assert got.usage.prompt_tokens == got.usage.total_tokens > 3 * 2
    floats = client.embeddings.create(model="bge-small", input=PARAPHRASES, encoding_format="float")
    assert np.array_equal(np.array([d.embedding for d in floats.data], dtype=np.float32), v.astype(np.float32))
    assert floats.model == "bge-small-en"


def test_models_lists_every_service_with_its_kind_and_aliases(gw: GatewayProcess) -> None:
    """/v1/models lists chat and embeddings once each, with kind and aliases."""
    data = gw.get("/v1/models")["data"]
    assert [(m["id"], m["spillover"]["kind"], m["spillover"]["aliases"]) for m in data] == [
        ("smollm2-135m-instruct", "chat", ["smollm2"]),
        ("bge-small-en", "embeddings", ["bge-small"]),
    ]


def test_token_arrays_give_the_same_vectors_as_their_text(gw: GatewayProcess) -> None:
    """Token ids of the model's own vocabulary (no [CLS]/[SEP]) embed like the text they spell."""
    tok = EmbedTokenizer(default_embed_model_dir())
    ids = tok.encode(PARAPHRASES[:2])
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        text = c.post("/v1/embeddings", json={"model": "bge-small-en", "input": PARAPHRASES[:2]}).json()
        arrays = c.post("/v1/embeddings", json={"model": "bge-small-en", "input": ids}).json()
        single = c.post("/v1/embeddings", json={"model": "bge-small-en", "input": ids[0]}).json()
    assert np.array_equal(_vectors(text), _vectors(arrays))
    assert len(single["data"]) == 1 and single["usage"]["prompt_tokens"] == len(ids[0]) + 2


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "nope", "input": "x"}, 404, "model", "model_not_found"),
        ({"model": "smollm2", "input": "x"}, 400, "model", "model_not_supported"),
        ({"model": "bge-small-en"}, 400, "input", None),
        ({"model": "bge-small-en", "input": ""}, 400, "input", None),
        ({"model": "bge-small-en", "input": []}, 400, "input", None),
        ({"model": "bge-small-en", "input": [[]]}, 400, "input", None),
        ({"model": "bge-small-en", "input": [1, "a"]}, 400, "input", None),
        ({"model": "bge-small-en", "input": [True]}, 400, "input", None),
        ({"model": "bge-small-en", "input": [[1, 2, 99999]]}, 400, "input", None),
        ({"model": "bge-small-en", "input": [-1]}, 400, "input", None),
        ({"model": "bge-small-en", "input": ["x"] * 257}, 400, "input", None),
        ({"model": "bge-small-en", "input": "word " * 600}, 400, "input", "context_length_exceeded"),
        ({"model": "bge-small-en", "input": "x", "dimensions": 128}, 400, "dimensions", None),
        ({"model": "bge-small-en", "input": "x", "encoding_format": "hex"}, 400, "encoding_format", None),
        ({"model": "bge-small-en", "input": "x", "user": 5}, 400, "user", None),
        ({"model": "bge-small-en", "input": "x", "frobnicate": 1}, 400, "frobnicate", None),
        ({"model": "bge-small-en", "input": "x", "encoding_format": 0}, 400, "encoding_format", None),
        ({"model": "bge-small-en", "input": "x", "dimensions": 384.0}, 400, "dimensions", None),
    ],
)
def test_bad_embeddings_requests_get_a_clear_openai_error(
    gw: GatewayProcess, body: dict[str, Any], status: int, param: str, code: str | None
) -> None:
    """Each malformed request is refused before anything runs, naming the field."""
    r = httpx.post(gw.url + "/v1/embeddings", json=body, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (status, param), err
    if code is not None:
        assert err["code"] == code
    assert r.headers["x-should-retry"] == "false"


def test_a_lone_surrogate_is_a_400_not_a_500(gw: GatewayProcess) -> None:
    """Text with a lone surrogate (valid JSON, not valid Unicode) is refused naming the field."""
    raw = '{"model": "bge-small-en", "input": ["ok", "\\ud800"]}'
    r = httpx.post(gw.url + "/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_a_text_with_no_tokens_is_embedded_as_cls_sep_not_refused(gw: GatewayProcess) -> None:
    """Whitespace (a chunker's blank piece) has no WordPiece tokens: it is the [CLS] [SEP]
    vector, as sentence-transformers gives, and does not fail the batch it is in."""
    blank = httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": ["a", "  \n\t"]})
    ids = httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": [[]]})
    assert blank.status_code == 200, blank.text
    assert ids.status_code == 400  # an empty token list is the client's own mistake
    none = httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": ["a", "\u200b"]}).json()
    assert np.array_equal(_vectors(blank.json())[1], _vectors(none)[1])  # the same batch shape: the same vector


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": 5, "input": "x"}, "model", "'model' must be a non-empty string naming a served model, not 5"),
        ({"input": "x"}, "model", "'model' is required"),
        (
            {"model": "bge-small-en", "input": "x", "dimensions": "384"},
            "dimensions",
            'must be an integer (384), not "384"',
        ),
        (
            {"model": "bge-small-en", "input": "x", "dimensions": True},
            "dimensions",
            "must be an integer (384), not true",
        ),
    ],
)
def test_a_field_of_the_wrong_type_is_told_so(gw: GatewayProcess, body: dict[str, Any], param: str, says: str) -> None:
    """Round 31: ``"model": 5`` was answered "'model' is required", and a ``dimensions`` string or
    boolean "not supported except its own size (384)"."""
    r = httpx.post(gw.url + "/v1/embeddings", json=body, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, param) and says in err["message"], err


def test_dimensions_equal_to_the_model_size_is_accepted(gw: GatewayProcess) -> None:
    """``dimensions`` naming the model's own size is honoured as a no-op."""
    r = httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": "x", "dimensions": 384})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def test_idempotency_key_replays_the_same_bytes(gw: GatewayProcess) -> None:
    """The same key and body answer byte-identically from the journal; another body is 422."""
    body = {"model": "bge-small-en", "input": PARAPHRASES}
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        first = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "emb-1"})
        again = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "emb-1"})
        other = c.post("/v1/embeddings", json={**body, "input": "x"}, headers={"Idempotency-Key": "emb-1"})
        doc = c.get(f"/v1/requests/{first.headers['x-spillover-request-id']}").json()
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert doc["state"] == "completed" and doc["route"] in ("gpu", "cpu")


def test_ollama_embed_and_the_ollama_client(gw: GatewayProcess) -> None:
    """/api/embed answers the ollama client with the same vectors as /v1/embeddings, list()
    names both services, and `ollama stop` of either is answered as Ollama's."""
    import ollama

    client = ollama.Client(host=gw.url, timeout=60)
    try:
        got = client.embed(model="bge-small", input=PARAPHRASES)
        tagged = client.embed(model="bge-small-en:latest", input=PARAPHRASES[0])  # Ollama's default tag
        listed = [m.model for m in client.list().models]
        with pytest.raises(ollama.ResponseError) as e:
            client.embed(model="nope", input="x")
        # what list() names, show() and ps() describe too (show() was a 404, ps() left it out)
        shown = [client.show(name) for name in ("bge-small-en", "bge-small", "bge-small-en:latest")]
        legacy = client.embeddings(model="bge-small", prompt=PARAPHRASES[0])  # /api/embeddings: it was a 404
        running = {m.model: m for m in client.ps().models}
        # `ollama stop` of each model ps() lists (round 69: the embeddings model's was a 400)
        stopped = {name: client.generate(model=name, prompt="", keep_alive=0).done_reason for name in running}
    finally:
        client._client.close()
    ref = httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": PARAPHRASES}).json()
    assert np.array_equal(np.array(got.embeddings, dtype=np.float32), _vectors(ref))
    one = httpx.post(gw.url + "/v1/embeddings", json={"model": "bge-small-en", "input": PARAPHRASES[0]}).json()
    assert np.array_equal(np.array(legacy.embedding, dtype=np.float32), _vectors(one)[0])  # the same one input
    assert np.array_equal(np.array(tagged.embeddings[0], dtype=np.float32), _vectors(one)[0])
    assert e.value.status_code == 404
    assert listed == ["smollm2-135m-instruct", "bge-small-en"]
    assert all(s.capabilities == ["embedding"] and s.modelinfo["bert.embedding_length"] == 384 for s in shown)
    assert stopped == {"smollm2-135m-instruct": "unload", "bge-small-en": "unload"}, stopped
    bge = running["bge-small-en"]
    row = next(r for r in gw.status()["services"] if r["name"] == "bge-small-en")
    assert bge.size_vram and bge.size >= bge.size_vram, bge  # its GPU worker holds its weights
    assert {w["lane"] for w in row["workers"] if w["state"] == "ready"} >= {"gpu"}, row


def test_delete_of_a_running_embeddings_request_ends_it_cancelled(gw: GatewayProcess) -> None:
    """DELETE stops a long request inside its encoder run, not at the next chunk of inputs
    (a chunk of 32 inputs of about 450 tokens takes seconds here): the DELETE answers the
    terminal state, the client 409 request_cancelled, and the worker is not taken for hung."""
    body = {"model": "bge-small-en", "input": [MEDIUM_TEXT * 5] * 64}
    out: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=gw.url, timeout=300) as c:
        t = threading.Thread(
            target=lambda: out.setdefault("r", httpx.post(gw.url + "/v1/embeddings", json=body, timeout=120))
        )
        t.start()
        wait_for(lambda: _service_worker(gw, "gpu")["busy"] >= 1, 30, "running on the gpu")
        pid = _service_worker(gw, "gpu")["pid"]
        rid = gw.status()["running"][0]["rid"]
        time.sleep(0.5)  # inside its first chunk
        d = c.delete(f"/v1/requests/{rid}")
        assert d.status_code == 200 and d.json()["state"] == "cancelled", d.text
        t.join(60)
        r = out["r"]
        assert r.status_code == 409 and r.json()["error"]["code"] == "request_cancelled"
        assert r.headers["x-should-retry"] == "false"
        rec = c.get(f"/v1/requests/{rid}").json()
        assert rec["state"] == "cancelled" and (rec["route"], r.headers["x-spillover-route"]) == ("gpu", "gpu")
    wait_for(lambda: _service(gw)["running"] == 0 and _service(gw)["reserved_bytes"] == 0, 30, "lease back")
    time.sleep(6)  # past the gateway's wait for a cancelled request's end: the worker was never killed
    assert _service_worker(gw, "gpu")["pid"] == pid and _service_worker(gw, "gpu")["state"] == "ready"


def test_an_answer_the_journal_cannot_take_is_not_sent_and_its_key_gets_it_after(gw: GatewayProcess) -> None:
    """The disk fills while an embeddings request runs: its vectors are ready but not durable,
    so they are not sent (round 16: a gateway killed before the write re-ran it, and its key
    gave a second answer): 503 ``journal_unavailable``, resumable; once the disk has room the
    kept answer is journaled and its Idempotency-Key answers it."""
    from spillover.runtime.journal import set_disk_full

    journal = Path(gw.state_dir) / "journal.sqlite3"
    body = {"model": "bge-small-en", "input": [MEDIUM_TEXT * 2] * 48}
    out: dict[str, httpx.Response] = {}
    headers = {"Idempotency-Key": "embed-not-durable"}
    with httpx.Client(base_url=gw.url, timeout=300) as c:
        t = threading.Thread(
            target=lambda: out.setdefault(
                "r", httpx.post(gw.url + "/v1/embeddings", json=body, headers=headers, timeout=120)
            )
        )
        t.start()
        wait_for(lambda: _service(gw)["running"] >= 1, 30, "running")
        set_disk_full(journal, True)
        try:
            t.join(120)
            r = out["r"]
            assert r.status_code == 503 and r.json()["error"]["code"] == "journal_unavailable", r.text[:300]
            assert "could not be made durable" in r.json()["error"]["detail"]
        finally:
            set_disk_full(journal, False)
        wait_for(lambda: gw.status()["journal_pending_outcomes"] == 0, 20, "outcome written")
        again = c.post("/v1/embeddings", json=body, headers=headers)
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true", again.text[:300]
        assert len(again.json()["data"]) == 48
        assert again.headers["x-spillover-request-id"] == r.headers["x-spillover-request-id"]


def test_an_answer_too_large_for_the_journal_is_sent_and_its_key_says_it_was_not_kept() -> None:
    """Round 17: an answer larger than the journal keeps in one row (a 1 MiB journal, 256
    vectors as JSON floats, 2 MB) could never be made durable: its client got 503 and the answer
    never came, and its key, once the outcome was written without it, replayed an empty 200.
    It is sent (its state is journaled, with why the answer was not kept), and its key answers
    410 ``answer_not_kept``: not a second run, not an empty answer."""
    with GatewayProcess(
        ["--gpu", "sim:1024"], services=("chat", "embeddings"), config={"journal": {"max_mib": 1}}
    ) as g:
        body = {"model": "bge-small-en", "input": [f"text number {i}" for i in range(256)]}
        headers = {"Idempotency-Key": "too-large"}
        with httpx.Client(base_url=g.url, timeout=120) as c:
            r = c.post("/v1/embeddings", json=body, headers=headers)
            assert r.status_code == 200 and len(r.json()["data"]) == 256, r.text[:300]
            assert len(r.content) > 1024 * 1024  # more than the whole journal
            rid = r.headers["x-spillover-request-id"]
            rec = c.get(f"/v1/requests/{rid}").json()
            assert rec["state"] == "completed" and "answer not kept" in rec["reason"], rec
            again = c.post("/v1/embeddings", json=body, headers=headers)
            assert again.status_code == 410 and again.json()["error"]["code"] == "answer_not_kept", again.text
            assert again.headers["x-spillover-request-id"] == rid and again.headers["x-should-retry"] == "false"
            small = c.post("/v1/embeddings", json={**body, "input": "one"}, headers={"Idempotency-Key": "small"})
            assert (
                c.post("/v1/embeddings", json={**body, "input": "one"}, headers={"Idempotency-Key": "small"}).content
                == small.content
            )


def test_a_client_that_goes_away_stops_its_request_resumable(gw: GatewayProcess) -> None:
    """A non-streamed request whose client leaves (a read timeout) is stopped, not run to
    its end for nobody: journaled resumable with 499 client_disconnected, its lease back."""
    body = {"model": "bge-small-en", "input": [MEDIUM_TEXT] * 256}

    def impatient() -> None:
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(gw.url + "/v1/embeddings", json=body, timeout=httpx.Timeout(60, read=1.5))

    t = threading.Thread(target=impatient)
    t.start()
    rid = wait_for(lambda: gw.status()["running"], 30, "running")[0]["rid"]
    t.join(60)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        doc = wait_for(lambda: (d := c.get(f"/v1/requests/{rid}").json())["state"] != "running" and d, 30, "its end")
    assert doc["state"] == "resumable_error" and doc["status_code"] == 499, doc
    assert doc["response"]["error"]["code"] == "client_disconnected", doc  # its stored answer
    wait_for(lambda: _service(gw)["running"] == 0 and _service(gw)["reserved_bytes"] == 0, 30, "lease back")


def test_a_gpu_worker_kill_mid_request_replays_on_cpu_with_the_same_vectors(gw: GatewayProcess) -> None:
    """SIGKILL of the GPU embeddings worker mid-request: the request is replayed on the CPU
    path at its boundary and answers exactly the vectors a GPU run gives."""
    inputs = [f"{MEDIUM_TEXT} {i}" for i in range(256)]
    body = {"model": "bge-small-en", "input": inputs}
    with httpx.Client(base_url=gw.url, timeout=300) as c:
        ref = c.post("/v1/embeddings", json=body)
        assert ref.headers["x-spillover-route"] == "gpu"
        out: dict[str, httpx.Response] = {}
        t = threading.Thread(
            target=lambda: out.setdefault("r", httpx.post(gw.url + "/v1/embeddings", json=body, timeout=300))
        )
        t.start()
        wait_for(lambda: _service_worker(gw, "gpu")["busy"] >= 1, 30, "running on the gpu")
        time.sleep(0.3)
        os.kill(int(_service_worker(gw, "gpu")["pid"]), signal.SIGKILL)
        t.join(120)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-degraded"] == "1"
    assert r.headers["x-spillover-reason"].startswith("failover:")
    assert r.json()["spillover"]["attempts"] == 2
    assert np.array_equal(_vectors(r.json()), _vectors(ref.json()))
    wait_for(lambda: _service_worker(gw, "gpu")["state"] == "ready", 60, "gpu worker back")


def test_a_hung_gpu_is_a_stall_replayed_on_cpu_and_its_worker_restarted() -> None:
    """A GPU that hangs (no progress) holds an embeddings request only until the stall bound
    (``[failover].stall_timeout_s`` here, the request being small), not ``request_timeout_s``:
    the GPU worker is killed and restarted, and the request answers from the CPU path with the
    vectors the GPU gives. Its own gateway: a short bound, and a hang no other test may see."""
    body = {"model": "bge-small-en", "input": PARAPHRASES}
    config = {"failover": {"stall_timeout_s": 3.0}}
    with (
        GatewayProcess(["--gpu", "sim:1024"], services=("chat", "embeddings"), config=config) as g,
        httpx.Client(base_url=g.url, timeout=120) as c,
    ):
        ref = c.post("/v1/embeddings", json=body)
        assert ref.headers["x-spillover-route"] == "gpu", ref.text
        pid = _service_worker(g, "gpu")["pid"]
        r, took = while_hung(g, lambda: c.post("/v1/embeddings", json=body))
        assert r.status_code == 200, r.text
        assert r.headers["x-spillover-route"] == "cpu" and r.headers["x-spillover-reason"] == "failover:stall"
        assert 3.0 <= took < 60, took
        assert np.array_equal(_vectors(r.json()), _vectors(ref.json()))
        wait_for(
            lambda: (w := _service_worker(g, "gpu"))["state"] == "ready" and w["pid"] != pid, 90, "a new gpu worker"
        )
        events = [e for e in g.status()["events"] if "no progress: killing it" in str(e)]
        assert events, g.status()["events"]
        assert c.post("/v1/embeddings", json=body).headers["x-spillover-route"] == "gpu"


def _chat_model() -> Any:
    from spillover.core.memory import MemoryModel
    from spillover.engine.gguf_meta import read_model_spec

    cfg = load_config()
    return MemoryModel(read_model_spec(cfg.model_path()), n_batch=cfg.gpu_lane.n_batch_tokens)


def _weights_bytes() -> tuple[int, int]:
    """(chat, embeddings) weights the sim device is charged for, from the memory models."""
    return _chat_model().weights_bytes(), EmbedMemoryModel(
        read_embed_model_info(default_embed_model_dir())
    ).weights_bytes()


def test_an_embedding_burst_pushes_a_long_chat_to_cpu_before_any_allocation_fails() -> None:
    """With embeddings holding most of the device, a long chat request is routed to the CPU
    lane by admission (one budget), and the device never refuses an allocation."""
    d = default_embed_model_dir()
    emb = EmbedMemoryModel(read_embed_model_info(d))
    lengths = [len(ids) + 2 for ids in EmbedTokenizer(d).encode([LONG_TEXT])] * 32
    burst_bytes = emb.request_bytes(lengths, 32)
    chat_bytes = _chat_model().request_footprint(300, 100).total_bytes
    body = {"model": "bge-small-en", "input": [LONG_TEXT] * 40}
    with GatewayProcess(["--gpu", "sim:4096"], services=("chat", "embeddings")) as g:
        # Room for the loaded weights, one burst request and half of the chat request beside it.
        weights = g.status()["device"]["ledger"]["predicted_bytes"]
        capacity = weights + 32 * MIB + burst_bytes + chat_bytes // 2
        SimDevice(g.state_dir).set_capacity(capacity)
        wait_for(lambda: g.status()["device"]["ledger"]["capacity_bytes"] == capacity, 10, "capacity seen")
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(httpx.post(g.url + "/v1/embeddings", json=body, timeout=300)))
        t.start()
        wait_for(lambda: _service_worker(g, "gpu")["busy"] >= 1, 30, "burst on the gpu")
        chat = httpx.post(
            g.url + "/v1/chat/completions",
            json={
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Tell me about dragons. " * 50}],
                "max_tokens": 100,
                "temperature": 0,
            },
            timeout=300,
        )
        t.join(300)
        st = g.status()
    assert chat.status_code == 200, chat.text
    assert chat.headers["x-spillover-route"] == "cpu", chat.headers
    assert out and out[0].status_code == 200 and out[0].headers["x-spillover-route"] == "gpu"
    assert st["device"]["alloc_failures"] == 0
    assert all(w["alloc_failures"] == 0 for w in st["workers"] + st["services"][1]["workers"])


def _ready_but_waiting(g: GatewayProcess) -> bool:
    try:
        st = g.status()
    except OSError:
        return False
    svc = next(s for s in st["services"] if s["name"] == "bge-small-en")
    cpu = next(w for w in svc["workers"] if w["lane"] == "cpu")
    return bool(svc["load_waiting"]) and cpu["state"] == "ready" and all(w["state"] == "ready" for w in st["workers"])


def test_a_model_load_that_does_not_fit_waits_and_its_requests_go_to_cpu() -> None:
    """With no room for the embeddings weights, the GPU worker's load waits (never an OOM);
    requests are served on the CPU path; once room appears, it loads and serves on the GPU.
    The device holds chat's weights and its smallest request (a 32-token batch: 7 MiB; at 512,
    53 MiB, more than the embeddings weights) with 8 MiB to spare: chat's resident runs."""
    chat = dataclasses.replace(_chat_model(), n_batch=32)
    capacity_mib = (device_bytes(chat, 1, 1) + 32 * MIB + 8 * MIB) // MIB
    assert capacity_mib * MIB - 32 * MIB - chat.weights_bytes() < _weights_bytes()[1]  # no room for its weights
    with GatewayProcess(
        ["--gpu", f"sim:{capacity_mib}"],
        services=("chat", "embeddings"),
        config={"gpu_lane": {"n_batch_tokens": 32}},
        wait_all_workers=False,
    ) as g:
        wait_for(lambda: _ready_but_waiting(g), 90, "chat ready, embeddings load waiting")
        r = httpx.post(g.url + "/v1/embeddings", json={"model": "bge-small-en", "input": "hello"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "cpu"
        assert r.headers["x-spillover-reason"] == "gpu_unavailable"
        assert _service_worker(g, "gpu")["starts"] == 0  # never attempted
        SimDevice(g.state_dir).set_capacity((capacity_mib + 256) * MIB)
        wait_for(lambda: _service_worker(g, "gpu")["state"] == "ready", 60, "loaded once room appeared")
        r = httpx.post(g.url + "/v1/embeddings", json={"model": "bge-small-en", "input": "hello"}, timeout=60)
        assert r.headers["x-spillover-route"] == "gpu"
        assert g.status()["device"]["alloc_failures"] == 0


def test_an_embeddings_request_survives_a_gateway_sigkill(tmp_path: Any) -> None:
    """Accepted then SIGKILLed with the gateway: after a restart it is replayed once and its
    key answers the journaled vectors."""
    state = str(tmp_path / "state")
    body = {"model": "bge-small-en", "input": [MEDIUM_TEXT] * 256}
    g = GatewayProcess(["--gpu", "sim:1024"], state_dir=state, services=("chat", "embeddings")).start()
    try:
        r = replay_after_sigkill(g, "/v1/embeddings", body, "survive")
        assert r.headers["idempotent-replayed"] == "true"
        assert len(r.json()["data"]) == 256
        assert g.status()["recovered"]["replayed"] == 1
    finally:
        g.stop()


def test_an_idle_batch_service_is_demoted_for_interactive_chat_and_promoted_back() -> None:
    """The ladder's service step: a long chat request that does not fit beside the idle
    embeddings weights unloads them (journaled, counted, shown), runs on the GPU, embeddings
    meanwhile go to their CPU path (reason demoted), and once room has lasted the service is
    loaded back on the GPU."""
    import sqlite3

    emb_w = EmbedMemoryModel(read_embed_model_info(default_embed_model_dir())).weights_bytes()
    chat_bytes = _chat_model().request_footprint(300, 400).total_bytes
    config = {"admission": {"promote_after_s": 2.0, "promote_headroom_mib": 4}}
    with GatewayProcess(["--gpu", "sim:4096"], services=("chat", "embeddings"), config=config) as g:
        weights = g.status()["device"]["ledger"]["predicted_bytes"]
        # The chat request misses half of the embeddings weights' size.
        capacity = weights + 32 * MIB + chat_bytes - emb_w // 2
        SimDevice(g.state_dir).set_capacity(capacity)
        wait_for(lambda: g.status()["device"]["ledger"]["capacity_bytes"] == capacity, 10, "capacity seen")
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Tell me about dragons. " * 50}],
            "max_tokens": 400,
            "temperature": 0,
        }
        out: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: out.append(httpx.post(g.url + "/v1/chat/completions", json=body, timeout=300))
        )
        t.start()
        svc = wait_for(lambda: (s := _service(g))["demoted"] and s, 30, "demoted")
        assert svc["demotions"] == 1 and "interactive chat" in svc["ladder"][-1]["reason"]
        during = httpx.post(g.url + "/v1/embeddings", json={"model": "bge-small-en", "input": "hi"}, timeout=60)
        t.join(300)
        assert out[0].status_code == 200 and out[0].headers["x-spillover-route"] == "gpu", out[0].headers
        assert during.status_code == 200 and during.headers["x-spillover-route"] == "cpu"
        assert during.headers["x-spillover-reason"] == "demoted"
        back = wait_for(lambda: (s := _service(g))["promotions"] == 1 and not s["demoted"] and s, 60, "promoted")
        assert back["ladder"][-1]["event"] == "promoted"
        wait_for(lambda: _service_worker(g, "gpu")["state"] == "ready", 60, "reloaded")
        after = httpx.post(g.url + "/v1/embeddings", json={"model": "bge-small-en", "input": "hi"}, timeout=60)
        assert after.headers["x-spillover-route"] == "gpu"
        metrics = httpx.get(g.url + "/metrics").text
        assert 'spillover_service_ladder_events_total{event="demoted",service="bge-small-en"} 1.0' in metrics
        assert g.status()["device"]["alloc_failures"] == 0
        db = sqlite3.connect(f"{g.state_dir}/journal.sqlite3")
        try:
            events = [r[0] for r in db.execute("SELECT event FROM service_events ORDER BY seq")]
        finally:
            db.close()
        assert events == ["demoted", "promoted"]


def test_exact_count_embeddings_queue_sheds_k_before_accepting() -> None:
    """An embeddings service with one CPU slot and queue depth 2 (no GPU worker): 2 + 1 + k
    requests at once give exactly k 503s with Retry-After, each refused before acceptance
    (its id is unknown: a promised place is counted, so none races for the last one)."""
    q, c, k = 2, 1, 3
    svc = {"name": "bge-small-en", "gpu": False, "cpu_slots": c, "queue_depth": q}
    with GatewayProcess(["--gpu", "none"], services=("chat", "embeddings"), config={"services": [svc]}) as g:
        body = {"model": "bge-small-en", "input": [LONG_TEXT] * 4}
        results: list[httpx.Response] = []
        lock = threading.Lock()
        go = threading.Barrier(q + c + k)

        def one() -> None:
            with httpx.Client(base_url=g.url, timeout=300) as cl:
                go.wait()
                r = cl.post("/v1/embeddings", json=body)
                with lock:
                    results.append(r)

        ts = [threading.Thread(target=one) for _ in range(q + c + k)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        shed = [r for r in results if r.status_code == 503]
        assert len(shed) == k, [r.status_code for r in results]
        assert sum(r.status_code == 200 for r in results) == q + c
        for r in shed:
            assert r.json()["error"]["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
            rid = r.headers["x-spillover-request-id"]
            assert httpx.get(f"{g.url}/v1/requests/{rid}", timeout=10).status_code == 404
        assert _service(g)["shed"] == k
