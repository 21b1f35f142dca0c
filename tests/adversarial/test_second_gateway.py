"""One gateway per state folder: a second ``spillover serve`` on it exits at once, naming the
folder and the holder's pid, and the first one's GPU worker, device and running requests are
untouched. The lock goes with its holder, so a killed gateway never blocks a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from spillover.config import Config, ServerConfig, load_config
from spillover.runtime import statelock
from spillover.testing import GatewayProcess, free_port
from tests.e2e.helpers import COUNT_PROMPT, ready_worker, stream

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from spillover.runtime import statelock\n"
    "statelock.acquire(Path(sys.argv[1]))\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture()
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that holds ``tmp_path``'s lock until it is killed."""
    with subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
        proc.kill()


def test_lock_held_elsewhere_is_refused_at_once_with_folder_and_pid(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    """Taking a folder another process holds raises StateDirBusy at once, naming the folder,
    the lock file and the holder's pid."""
    t0 = time.monotonic()
    with pytest.raises(statelock.StateDirBusy) as err:
        statelock.acquire(tmp_path)
    assert time.monotonic() - t0 < 1.0
    assert err.value.pid == holder.pid
    msg = str(err.value)
    assert str(tmp_path.resolve()) in msg and f"pid {holder.pid}" in msg and "gateway.lock" in msg


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    """SIGKILL of the holder frees the folder (its stale pid file does not block), and the new
    holder's pid replaces it."""
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    assert (tmp_path / "gateway.lock").read_text().strip() == str(holder.pid)
    lock = statelock.acquire(tmp_path)
    try:
        assert (tmp_path / "gateway.lock").read_text().strip() == str(os.getpid())
    finally:
        lock.release()


def test_lock_is_counted_within_one_process(tmp_path: Path) -> None:
    """The CLI's hold and the gateway's hold share one lock: the folder stays locked until the
    last release, then another process can take it."""
    first = statelock.acquire(tmp_path)
    second = statelock.acquire(tmp_path)
    assert second is first
    first.release()
    probe = [sys.executable, "-c", HOLD.replace("time.sleep(120)", ""), str(tmp_path)]
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode != 0, "still locked"
    second.release()
    assert not first.held
    assert subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip() == "locked"


def test_default_state_dir_is_the_users_data_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a state_dir the folder is $XDG_DATA_HOME/spillover (a relative XDG value is
    ignored, as the spec says), else ~/.local/share/spillover: never the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert ServerConfig().state_dir == ""
    assert load_config().state_path() == tmp_path / "data" / "spillover"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")
    assert Config().state_path() == tmp_path / "home" / ".local" / "share" / "spillover"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert Config().state_path() == tmp_path / "home" / ".local" / "share" / "spillover"
    assert load_config(overrides={"server": {"state_dir": "mine"}}).state_path() == tmp_path / "mine"


@pytest.mark.e2e
def test_second_gateway_on_the_same_state_dir_exits_and_leaves_the_first_alone() -> None:
    """While the first gateway streams a request on its GPU worker, a second ``spillover
    serve`` on its state folder exits non-zero within seconds, naming the folder and the
    first's pid; the first's GPU worker, device epoch and stream are untouched and it still
    serves."""
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1"]) as gw:
        assert gw.proc is not None
        gpu_pid = ready_worker(gw, "gpu")["pid"]
        epoch = gw.status()["device"]["epoch"]
        second: dict[str, object] = {}

        def start_second(n: int) -> None:
            if n != 1:
                return
            t0 = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "spillover.cli", "serve", "--port", str(free_port())]
                + ["--state-dir", gw.state_dir, "--gpu", "sim:1024"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            second.update(rc=done.returncode, err=done.stderr + done.stdout, took_s=time.monotonic() - t0)

        body = {"prompt": COUNT_PROMPT, "max_tokens": 48, "temperature": 0}
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            got = stream(c, "/v1/completions", body, on_token=start_second)
            assert second, "the second gateway was started during the stream"
            assert second["rc"] != 0, second
            assert float(second["took_s"]) < 20, second  # python start-up on a busy machine; no model load
            err = str(second["err"])
            assert str(Path(gw.state_dir).resolve()) in err and f"pid {gw.proc.pid}" in err, err
            assert got["status"] == 200 and got["done"] and got["error"] is None, got
            assert all(sp["route"] == "gpu" and sp["attempts"] == 1 for sp in got["spillover"]), got["spillover"]
            w = gw.worker("gpu")
            assert w["state"] == "ready" and w["pid"] == gpu_pid, w
            assert gw.status()["device"]["epoch"] == epoch, "the sim device was not reset"
            r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-spillover-route"] == "gpu", r.text
        assert (Path(gw.state_dir) / "gateway.lock").read_text().strip() == str(gw.proc.pid)
