"""A second chat model at once: two GGUF services on one (sim) device, one budget.

The second model is a small random-weight llama written from SmolLM2's vocabulary with no
chat template, so it serves completions only (a chat request for it is a 400 naming
/v1/completions). Each model has its own lanes and workers; both GPU workers charge the one
ledger, and the second model's load is a reservation that waits for room."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from spillover.config import default_model_path
from spillover.core.memory import MemoryModel
from spillover.engine.gguf_meta import read_model_spec
from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess
from spillover.testing.gguf_factory import TinyLlamaSpec, write_tiny_llama
from tests.e2e.helpers import replay_after_sigkill, wait_for

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
MAIN = "smollm2-135m-instruct"
SECOND = "tiny-base"
PROMPT = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(
        Path(tmp_path_factory.mktemp("second")) / "tiny-base.gguf",
        default_model_path(),
        TinyLlamaSpec(n_layers=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_ctx_train=2048, name=SECOND),
        chat_template=False,
    )


def _config(tiny: Path) -> dict[str, Any]:
    second = {"name": SECOND, "kind": "chat", "path": str(tiny), "aliases": ["tiny"], "gpu_slots": 1, "cpu_slots": 1}
    return {"services": [second]}


@pytest.fixture(scope="module")
def gw(tiny: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        ["--gpu", "sim:1024", "--gpu-slots", "1"], services=("chat", "embeddings"), config=_config(tiny)
    ) as g:
        yield g


def _row(st: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in st["services"] if s["name"] == name)


def test_both_models_are_listed_and_served_on_the_gpu(gw: GatewayProcess) -> None:
    """/v1/models and /api/tags list both chat models; each answers under its own name, on
    its own GPU worker; the second model's alias resolves to it."""
    with httpx.Client(base_url=gw.url, timeout=120) as cl:
        models = {m["id"]: m["spillover"] for m in cl.get("/v1/models").json()["data"]}
        assert models[MAIN]["kind"] == models[SECOND]["kind"] == "chat" and models[SECOND]["aliases"] == ["tiny"]
        assert {m["name"] for m in cl.get("/api/tags").json()["models"]} == {MAIN, SECOND}
        for asked, served in ((MAIN, MAIN), (SECOND, SECOND), ("tiny", SECOND)):
            r = cl.post("/v1/completions", json={**PROMPT, "model": asked})
            assert r.status_code == 200, r.text
            assert r.headers["x-spillover-model"] == served and r.json()["model"] == served
            assert r.headers["x-spillover-route"] == "gpu", r.headers
        chat = cl.post(
            "/v1/chat/completions",
            json={"model": MAIN, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert chat.status_code == 200 and chat.json()["model"] == MAIN
        ps = {m["name"]: m for m in cl.get("/api/ps").json()["models"]}
        assert ps[SECOND]["spillover"]["placement"] == "gpu" and ps[SECOND]["size_vram"] > 0


def test_a_chat_request_for_a_model_without_a_template_is_a_400_naming_completions(gw: GatewayProcess) -> None:
    with httpx.Client(base_url=gw.url, timeout=60) as cl:
        r = cl.post("/v1/chat/completions", json={"model": SECOND, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_supported" and "/v1/completions" in err["message"]
        assert cl.post("/api/show", json={"model": SECOND}).json()["capabilities"] == ["completion"]


def test_one_device_budget_holds_both_models(gw: GatewayProcess) -> None:
    """Both GPU workers' weights are in the one ledger (each row says what it holds; together
    they are everything the ledger holds), and the sim device charged exactly those."""
    st = gw.status()
    main, second = _row(st, MAIN), _row(st, SECOND)
    ledger = st["device"]["ledger"]
    assert second["weights_bytes"] > 0 and second["device_bytes"] == second["weights_bytes"]
    assert main["device_bytes"] > 0 and main["device_bytes"] + second["device_bytes"] == ledger["predicted_bytes"]
    assert {w["lane"] for w in second["workers"]} == {"gpu", "cpu"}
    assert all(w["state"] == "ready" for w in second["workers"])
    assert SimDevice(gw.state_dir).snapshot().used_bytes == ledger["predicted_bytes"]


def test_each_model_has_its_own_lanes(gw: GatewayProcess) -> None:
    """A request for the second model preferring the CPU runs on its own CPU worker (its
    replica: same GGUF), flagged degraded, while the first model's lanes are untouched."""
    with httpx.Client(base_url=gw.url, timeout=120) as cl:
        r = cl.post("/v1/completions", json={**PROMPT, "model": SECOND, "spillover": {"prefer": "cpu"}})
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "cpu", r.text
        assert r.headers["x-spillover-degraded"] == "1" and r.json()["model"] == SECOND
        first = cl.post("/v1/completions", json={**PROMPT, "model": MAIN}).json()
        ref = cl.post("/v1/completions", json={**PROMPT, "model": SECOND}).json()
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]  # an exact replica: the same greedy text
    assert first["choices"][0]["text"] != ref["choices"][0]["text"]  # two different models
    st = gw.status()
    lanes = {lane["lane"]: lane for lane in _row(st, SECOND)["lanes"]}
    assert lanes["cpu"]["admitted_total"] == 1 and lanes["gpu"]["admitted_total"] >= 1  # its own lanes
    assert {w["worker_id"] for w in _row(st, SECOND)["workers"]} == {f"{SECOND}-gpu", f"{SECOND}-cpu"}


def test_a_second_model_load_that_does_not_fit_waits_and_serves_on_its_cpu(tiny: Path) -> None:
    """Room for the first model only: the second model's GPU load waits (never attempted, no
    allocation failure) and its requests are served on its CPU lane; once room appears it
    loads and serves on the GPU."""
    main_weights, second_weights = (  # the GPU weights each worker charges the sim device
        MemoryModel(read_model_spec(str(p))).weights_bytes() for p in (default_model_path(), tiny)
    )
    capacity_mib = (main_weights + 32 * MIB + second_weights // 2) // MIB
    # a 32-token batch: the first model's smallest request (7 MiB) fits in the room left, so its
    # resident runs (at 512 it would need 53 MiB, and the profile would be cpu: core.profiles)
    config = _config(tiny) | {"gpu_lane": {"n_batch_tokens": 32}}
    with GatewayProcess(
        ["--gpu", f"sim:{capacity_mib}", "--gpu-slots", "1"],
        services=True,
        config=config,
        wait_all_workers=False,
    ) as g:
        wait_for(lambda: _row(g.status(), SECOND)["load_waiting"], 90, "the second model's load waiting")
        wait_for(
            lambda: all(w["state"] == "ready" for w in g.status()["workers"] if w["worker_id"] in ("gpu0", "cpu0")),
            90,
            "the first model ready",
        )
        wait_for(
            lambda: next(w for w in _row(g.status(), SECOND)["workers"] if w["lane"] == "cpu")["state"] == "ready",
            90,
            "the second model's CPU worker ready",
        )
        r = httpx.post(g.url + "/v1/completions", json={**PROMPT, "model": SECOND}, timeout=120)
        assert r.status_code == 200 and r.headers["x-spillover-route"] == "cpu", r.text
        gpu = next(w for w in _row(g.status(), SECOND)["workers"] if w["lane"] == "gpu")
        assert gpu["starts"] == 0  # never attempted
        # its row says what it waits for, not only "stopped"
        assert gpu["state"] == "stopped", gpu
        assert gpu["waiting"] == f"room on the device for its {second_weights} bytes of weights", gpu
        SimDevice(g.state_dir).set_capacity((capacity_mib + 128) * MIB)
        wait_for(
            lambda: next(w for w in _row(g.status(), SECOND)["workers"] if w["lane"] == "gpu")["state"] == "ready",
            90,
            "loaded once room appeared",
        )
        r = httpx.post(g.url + "/v1/completions", json={**PROMPT, "model": SECOND}, timeout=120)
        assert r.headers["x-spillover-route"] == "gpu", (r.headers.get("x-spillover-reason"), _row(g.status(), SECOND))
        st = g.status()
        assert st["device"]["alloc_failures"] == 0 and not _row(st, SECOND)["load_waiting"]
        assert all(w["waiting"] is None for w in _row(st, SECOND)["workers"])


def test_a_second_model_request_survives_a_gateway_sigkill(tiny: Path, tmp_path: Path) -> None:
    """Accepted for the second model, then SIGKILLed with the gateway: after a restart it is
    replayed once, on the second model (its journaled body names it), and its key answers."""
    body = {"model": SECOND, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    args = ["--gpu", "sim:1024", "--gpu-slots", "1"]
    g = GatewayProcess(
        args, state_dir=str(tmp_path / "state"), services=("chat", "embeddings"), config=_config(tiny)
    ).start()
    try:
        r = replay_after_sigkill(g, "/v1/completions", body, "second-survives")
        assert r.headers["idempotent-replayed"] == "true" and r.json()["model"] == SECOND
        assert g.status()["recovered"]["replayed"] == 1
    finally:
        g.stop()


def test_a_second_model_without_a_cpu_path(tiny: Path) -> None:
    """``cpu = "none"``: only a GPU worker; asking for the CPU is a 400 at once (not a wait
    for a lane nobody serves). Without a GPU such a model could serve nothing: the gateway
    refuses to start, loudly."""
    cfg = {"services": [{"name": SECOND, "kind": "chat", "path": str(tiny), "cpu": "none", "gpu_slots": 1}]}
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1"], services=("chat", "embeddings"), config=cfg) as g:
        assert [w["lane"] for w in _row(g.status(), SECOND)["workers"]] == ["gpu"]
        with httpx.Client(base_url=g.url, timeout=60) as cl:
            r = cl.post("/v1/completions", json={**PROMPT, "model": SECOND, "spillover": {"prefer": "cpu"}})
            assert r.status_code == 400 and "no CPU path" in r.json()["error"]["message"], r.text
            r = cl.post("/v1/completions", json={**PROMPT, "model": SECOND})
            assert r.status_code == 200 and r.headers["x-spillover-route"] == "gpu"
    bad = GatewayProcess(["--gpu", "none"], services=("chat", "embeddings"), config=cfg, ready_timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="could serve nothing"):
            bad.start()
    finally:
        bad.stop()
