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
    line = f"spillover could not start: chat model 'smollm2-135m-instruct': {bad} cannot be served ("
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
