"""Ollama's API on the same port, driven by the official ``ollama`` client (real model)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pydantic
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import ready_worker

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "sim:1024"]) as g:
        yield g


@pytest.fixture()
def client(gw: GatewayProcess) -> Iterator[ollama.Client]:
    c = ollama.Client(host=gw.url, timeout=120)
    yield c
    c._client.close()


def test_chat_streamed_and_not_give_the_same_greedy_answer(client: ollama.Client) -> None:
    """chat(stream=False) and the streamed chat agree token for token; only the last part is
    done, with its reason and counts."""
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert whole.done and whole.message.content and whole.eval_count == 12 and whole.prompt_eval_count
    parts = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason == "length" and not any(p.done for p in parts[:-1])


def test_generate_with_system_and_raw(client: ollama.Client) -> None:
    """generate() applies the chat template (with system); raw=True continues the bare prompt."""
    r = client.generate(model=MODEL, prompt="Name a color.", system="Answer in one word.", options=GREEDY)
    assert r.done and r.response
    raw = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 4})
    assert raw.response is not None and "5" in raw.response


class Pet(pydantic.BaseModel):
    name: str
    species: str


def test_structured_format_follows_the_schema(client: ollama.Client) -> None:
    """format=<JSON schema> returns JSON that validates against it; format='json' an object."""
    r = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        format=Pet.model_json_schema(),
        options={"temperature": 0, "num_predict": 60},
    )
    assert Pet.model_validate_json(r.message.content or "")
    j = client.generate(
        model=MODEL, prompt="A JSON object about a cat:", format="json", options={"temperature": 0, "num_predict": 40}
    )
    assert (j.response or "").lstrip().startswith("{")


def test_list_ps_show_and_version_describe_what_is_served(gw: GatewayProcess, client: ollama.Client) -> None:
    """list() names the model; ps() says where it is loaded (GPU worker and CPU replica, with
    the bytes each holds now); show() gives its template; version() answers."""
    ready_worker(gw, "gpu")
    ready_worker(gw, "cpu")
    models = client.list().models
    assert [m.model for m in models] == [MODEL] and models[0].details and models[0].details.quantization_level == "Q4_1"
    ps = client.ps().models
    # the CPU replica counts what its readiness mode holds now (nothing on_demand, the default's
    # pick here), as the host-RAM guard does; before, a fixed model and context whatever it held
    replica = gw.status()["services"][0]["cpu_readiness"]
    assert len(ps) == 1 and ps[0].size_vram and ps[0].size == ps[0].size_vram + replica["host_bytes"]
    assert replica["host_bytes"] == 0 if replica["holding"] == "on_demand" else replica["host_bytes"] > 0, replica
    sp = client._client.get("/api/ps").json()["models"][0]["spillover"]  # the client drops extras
    # the GPU worker serves; the CPU replica beside it is a second copy, not a split of the model
    assert sp["placement"] == "gpu" and {w["lane"] for w in sp["workers"]} == {"gpu", "cpu"}
    assert next(w["size"] for w in sp["workers"] if w["lane"] == "cpu") == replica["host_bytes"]
    shown = client.show(MODEL)
    assert shown.template and "im_start" in shown.template
    assert client._client.get("/api/version").json()["version"]


def test_errors_come_in_ollama_shape(gw: GatewayProcess, client: ollama.Client) -> None:
    """An unknown model, a refused option and embed with the chat model raise the client's
    ResponseError with the status and a message (embeddings: tests/e2e/test_embeddings.py)."""
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=ASK)
    assert e.value.status_code == 404 and "smollm2" in str(e.value.error)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=ASK, options={"num_gpu": 1})
    assert e.value.status_code == 400 and "num_gpu" in str(e.value.error)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input="hello")
    assert e.value.status_code == 400 and "send it to /api/chat" in str(e.value.error)  # Ollama's route (round 68)
    with pytest.raises(ollama.ResponseError) as e:  # an option's error names it where Ollama's body has it
        client.chat(model=MODEL, messages=ASK, options={"temperature": -1})
    assert (
        e.value.status_code == 400
        and httpx.post(
            f"{gw.url}/api/chat", json={"model": MODEL, "messages": ASK, "options": {"temperature": -1}}
        ).json()["param"]
        == "options.temperature"
    )
    # /api/show reads its body as every route does: bounded (it buffered any size, for any time)
    big = httpx.post(f"{gw.url}/api/show", content=b" " * (2 << 20), headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["code"] == "payload_too_large", big.text
    bad = httpx.post(f"{gw.url}/api/show", content=b"{", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"], bad.text
    # answers made outside the routes are in Ollama's shape under /api/ too: no route, a wrong
    # method, a Host the guard refuses (each was OpenAI's {"error": {...}})
    for r, status, code in [
        (httpx.post(f"{gw.url}/api/pull", json={"model": MODEL}), 404, "not_found"),
        (httpx.get(f"{gw.url}/api/chat"), 405, "method_not_allowed"),
        (httpx.get(f"{gw.url}/api/tags", headers={"Host": "evil.example"}), 403, "forbidden_host"),
    ]:
        assert r.status_code == status and isinstance(r.json()["error"], str), r.text
        assert r.json()["code"] == code and r.headers["x-spillover-request-id"], r.text
    assert isinstance(httpx.get(f"{gw.url}/v1/nope").json()["error"], dict)  # OpenAI's shape there


def test_an_ollama_request_is_journaled_and_flags_its_route(gw: GatewayProcess) -> None:
    """/api/chat goes through the request service: X-Spillover headers, a spillover object
    on the last NDJSON line, and a journaled completed request whose stored answer is what
    was sent."""
    body = {"model": MODEL, "messages": ASK, "stream": False, "options": GREEDY}
    r = httpx.post(f"{gw.url}/api/chat", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["x-spillover-route"] in ("gpu", "cpu")
    rid = r.headers["x-spillover-request-id"]
    doc = httpx.get(f"{gw.url}/v1/requests/{rid}", timeout=30).json()
    assert doc["state"] == "completed" and doc["response"] == json.loads(r.content)
    streamed = httpx.post(f"{gw.url}/api/chat", json={**body, "stream": True}, timeout=120)
    assert streamed.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in streamed.text.splitlines()]
    sp = lines[-1]["spillover"]
    assert lines[-1]["done"] and sp["route"] == streamed.headers["x-spillover-route"]
    assert sp["degraded"] is (sp["route"] != "gpu") and sp["request_id"] == streamed.headers["x-spillover-request-id"]


def test_a_load_request_is_answered_at_once_and_runs_nothing(gw: GatewayProcess, client: ollama.Client) -> None:
    """Ollama's load requests (the ollama CLI's preload): chat with no messages, generate
    with an empty prompt. Done at once with ``done_reason: "load"``, nothing journaled or run
    (chat answered 400, generate ran an open-ended generation)."""

    def journaled() -> int:
        db = sqlite3.connect(Path(gw.state_dir) / "journal.sqlite3")
        try:
            return int(db.execute("SELECT count(*) FROM requests").fetchone()[0])
        finally:
            db.close()

    before = journaled()
    chat = client.chat(model=MODEL, messages=[])
    gen = client.generate(model=MODEL, prompt="")
    streamed = list(client.generate(model=MODEL, stream=True))
    assert chat.done and chat.done_reason == "load" and chat.message.content == ""
    assert gen.done and gen.done_reason == "load" and gen.response == "" and not gen.eval_count
    assert len(streamed) == 1 and streamed[0].done_reason == "load"
    stop = httpx.post(f"{gw.url}/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=30).json()
    assert stop["done_reason"] == "unload" and "stays loaded" in stop["spillover"]["notice"]  # `ollama stop`
    assert client.chat(model=MODEL, messages=[], keep_alive="0s").done_reason == "unload"
    assert journaled() == before
    with pytest.raises(ollama.ResponseError) as e:  # an unknown model is still a 404
        client.chat(model="nope", messages=[])
    assert e.value.status_code == 404
    for refused in ({"num_gpu": 1}, {"bogus": 1}):  # checked as a run's are (they were answered "load")
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=MODEL, messages=[], options=refused)
        assert e.value.status_code == 400 and next(iter(refused)) in str(e.value.error)
