"""A gateway whose start fails on what the operator gave says so in one line and exits 2:
no uvicorn traceback, nothing left running, the state folder free for the next start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def serve(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "spillover.cli", "serve", "--port", "0", "--state-dir", str(state)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "content",
    [b"not a model\n", b"GGUF\x03\x00\x00\x00" + b"\xff" * 40],  # not GGUF at all; a GGUF head cut short
)
def test_a_model_file_that_cannot_be_loaded_is_one_line_and_exit_2(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    got = serve(tmp_path / "state", "--chat-only", "--model", str(bad))
    assert got.returncode == 2, got.stderr[-3000:]
    line = f"spillover could not start: chat model 'bad': {bad} cannot be served ("  # named by its file
    assert line in got.stderr and "Traceback" not in got.stderr, got.stderr[-3000:]


def test_a_second_chat_model_that_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "second.gguf"
    bad.write_bytes(b"x" * 100)
    config = tmp_path / "c.toml"
    config.write_text(f'[[services]]\nname = "second"\nkind = "chat"\npath = "{bad}"\n')
    got = serve(tmp_path / "state", "--config", str(config), "--gpu", "sim:1024")
    assert got.returncode == 2, got.stderr[-3000:]
    assert f"chat model 'second': {bad} cannot be served" in got.stderr and "Traceback" not in got.stderr
    # what the start had made was undone: the state folder is free again (a held one is refused
    # before any model is read), so the same start fails the same way
    again = serve(tmp_path / "state", "--config", str(config), "--gpu", "sim:1024")
    assert again.returncode == 2 and f"chat model 'second': {bad} cannot be served" in again.stderr, again.stderr


def _broken_copy(src: str, dest: Path, name: str, content: bytes) -> Path:
    """The packaged model folder ``src`` with its file ``name`` replaced by ``content``."""
    dest.mkdir()
    for f in Path(src).iterdir():
        (dest / f.name).symlink_to(f)
    (dest / name).unlink(missing_ok=True)
    (dest / name).write_bytes(content)
    return dest


@pytest.mark.parametrize(
    ("kind", "name", "content"),
    [
        ("embeddings", "config.json", b'{"hidden_size": 384,'),  # JSON cut short
        ("embeddings", "config.json", b'{"hidden_size": 384}'),  # keys missing
        ("transcription", "model.bin", b"\x06\x00\x00\x00\x0bWhisperSpec"),  # its table cut short
        ("transcription", "model.bin", b"\x06\x00\x00\x00\x03\x00BERT\x01\x00\x00\x00"),  # not Whisper
    ],
)
def test_a_service_model_that_cannot_be_read_is_named_in_one_line(
    tmp_path: Path, kind: str, name: str, content: bytes
) -> None:
    from spillover.engine.embedder import default_embed_model_dir
    from spillover.engine.whisper_meta import default_whisper_model_dir

    src = default_embed_model_dir() if kind == "embeddings" else default_whisper_model_dir()
    folder = _broken_copy(src, tmp_path / "model", name, content)
    config = tmp_path / "c.toml"
    config.write_text(f'[[services]]\nname = "mine"\nkind = "{kind}"\npath = "{folder}"\n')
    scope = [f"--without={k}" for k in ("embeddings", "transcription") if k != kind]
    got = serve(tmp_path / "state", "--config", str(config), "--gpu", "sim:1024", *scope)
    assert got.returncode == 2, got.stderr[-3000:]
    line = f"spillover could not start: {kind} service 'mine': {folder} cannot be served ("
    assert line in got.stderr and "Traceback" not in got.stderr, got.stderr[-3000:]


def test_a_service_whose_workers_cannot_load_refuses_at_once_and_chat_goes_on(tmp_path: Path) -> None:
    """A model.onnx that is not ONNX: the header the gateway reads is fine, so it starts, but
    each worker's load fails. A request is refused at once (503 model_load_failed, Retry-After)
    with each worker's failure, not after a queue timeout; /v1/status shows the failure; the
    chat model is untouched."""
    import httpx

    from spillover.engine.embedder import default_embed_model_dir
    from spillover.testing import GatewayProcess
    from tests.e2e.helpers import wait_for

    folder = _broken_copy(default_embed_model_dir(), tmp_path / "model", "model.onnx", b"not an onnx model")
    svc = {"name": "mine", "kind": "embeddings", "path": str(folder)}
    with GatewayProcess(
        ["--gpu", "sim:1024"], services=("chat", "embeddings"), config={"services": [svc]}, wait_all_workers=False
    ) as g:

        def rows() -> list[dict[str, object]]:
            return next(s for s in g.status()["services"] if s["name"] == "mine")["workers"]  # type: ignore[no-any-return]

        wait_for(lambda: all(w["start_failure"] for w in rows()) and len(rows()) == 2, 90, "both loads failed")
        r = httpx.post(g.url + "/v1/embeddings", json={"model": "mine", "input": "hello"}, timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and "cannot load the model" in error["message"], error
        assert "gpu worker: load_failed" in error["detail"] and "cpu worker: load_failed" in error["detail"]
        assert r.elapsed.total_seconds() < 5
        chat = {"model": "smollm2-135m-instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(g.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_a_chat_model_whose_engine_aborts_loading_it_is_refused_with_why(tmp_path: Path) -> None:
    """A GGUF that llama.cpp reads (the gateway starts) but aborts loading in full: this
    pinned build's ``GGML_ASSERT(buffer)`` on ``gguf_arch``'s deci, whose padded V cache has a
    layer of no size. Both workers die of SIGABRT at every start. A request is refused at once
    with 503 ``model_load_failed`` naming the abort, not "The GPU is full", and /v1/status says
    why the model is unavailable."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from spillover.config import default_model_path
    from spillover.testing import GatewayProcess
    from spillover.testing.gguf_arch import write_arch
    from tests.e2e.helpers import wait_for

    model = write_arch(tmp_path / "deci.gguf", default_model_path(), "deci")
    body = {"model": "deci", "prompt": "hi", "max_tokens": 2}
    with GatewayProcess(["--gpu", "sim:1024", "--model", str(model), "--chat-only"], wait_all_workers=False) as g:
        # Sent while the workers first start: they wait for them, then are refused with why
        # once the last one's start has failed (they got "The GPU is full" when the failure
        # was kept only after the death was told).
        with ThreadPoolExecutor(3) as pool:
            early = list(pool.map(lambda _: httpx.post(g.url + "/v1/completions", json=body, timeout=60), range(3)))
        for r in early:
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed", r.text
        wait_for(lambda: all(w["start_failure"] for w in g.status()["workers"]), 90, "both loads aborted")
        for w in g.status()["workers"]:
            assert "(SIGABRT): ggml-backend.cpp" in w["start_failure"] and "GGML_ASSERT" in w["start_failure"], w
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and "GPU is full" not in error["message"], error
        assert "chat model 'deci' has no worker that can start (gpu worker: exited:" in error["detail"], error
        assert error["detail"].count("GGML_ASSERT(buffer) failed") == 2, error
        assert r.elapsed.total_seconds() < 5
        ollama = httpx.post(g.url + "/api/generate", json={"model": "deci", "prompt": "hi", "raw": True}, timeout=30)
        assert ollama.status_code == 503 and "GGML_ASSERT" in ollama.json()["detail"], ollama.text  # Ollama's shape
        # its own error first: a model without a chat template is a 400 a retry cannot mend
        chat = httpx.post(
            g.url + "/v1/chat/completions", json={"model": "deci", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported", chat.text
        status = g.status()
        assert status["mode"] == "unavailable" and any("GGML_ASSERT" in why for why in status["reasons"]), status
        assert status["services"][0]["why"] == "model_load_failed"
        assert all(w["restarts"] >= 1 for w in status["workers"]), status["workers"]  # each failed start is retried
        refused = 'spillover_requests_total{outcome="rejected",reason="model_load_failed",route="none"}'
        assert float(httpx.get(g.url + "/metrics").text.split(refused)[1].split()[0]) == 5


def test_a_second_ctrl_c_stops_the_gateway_and_its_workers_at_once(tmp_path: Path) -> None:
    """Ctrl-C twice with a long answer streaming: uvicorn skips its shutdown event then, and the
    gateway's stop still runs: the process exits and no worker is left running."""
    import os
    import signal
    import threading
    import time

    import httpx

    from spillover.testing import GatewayProcess

    with GatewayProcess(["--gpu", "sim:1024"]) as g:
        pids = [w["pid"] for w in g.status()["workers"]]
        assert pids and all(pids)
        body = {
            "model": "smollm2-135m-instruct",
            "stream": True,
            "max_tokens": 400,
            "messages": [{"role": "user", "content": "Tell a long story."}],
        }
        started = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", g.url + "/v1/chat/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(60)
        assert g.proc is not None
        g.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        g.proc.send_signal(signal.SIGINT)
        assert g.proc.wait(timeout=30) == 0, g.tail()

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True

        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], g.tail()
