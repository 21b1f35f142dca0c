"""Run a real ``spillover serve`` as a child process on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from spillover.runtime.devices import tree_rss

__all__ = ["GatewayProcess", "free_port", "tree_rss"]


def to_toml(cfg: dict[str, Any]) -> str:
    """Sections of scalar settings as TOML, a list of them as an array of tables
    (``[[services]]``): all spillover's config needs."""
    lines = []
    for section, values in cfg.items():
        for table in values if isinstance(values, list) else [values]:
            lines.append(f"[[{section}]]" if isinstance(values, list) else f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess:
    """``with GatewayProcess(["--gpu", "sim:512"]) as gw: gw.url ...``

    By default the gateway serves its chat model alone (``--chat-only``), so a test's device
    budget is the chat model's; ``services=True`` serves the configured ``[[services]]``
    too (by default the bge-small-en embeddings service and the whisper-tiny.en transcription
    service), as ``spillover serve`` does; a tuple of kinds serves only those kinds' services.

    Set ``GatewayProcess.log_archive`` to a folder to keep every gateway's log there.
    ``module`` is what ``python -m`` runs with the ``serve`` command line (a benchmark's
    profiled launcher, ``benchmarks._profiled_serve``, takes the same one).
    """

    log_archive: Path | None = None
    module: str = "spillover.cli"

    def __init__(
        self,
        args: list[str] | None = None,
        *,
        state_dir: str | None = None,
        ready_timeout_s: float = 120.0,
        log_path: str | None = None,
        config: dict[str, Any] | None = None,
        port: int | None = None,
        api_key: str | None = None,
        services: bool | tuple[str, ...] = False,
        wait_all_workers: bool = True,
    ) -> None:
        self.wait_all_workers = wait_all_workers  # False: start() returns once the gateway answers
        kinds = ("chat", "embeddings", "transcription")
        scope = (
            ["--chat-only"]
            if not services
            else [f"--without={k}" for k in kinds if k not in services]
            if isinstance(services, tuple)
            else []
        )
        self.args = list(args or []) + (["--api-key", api_key] if api_key else []) + scope
        self.api_key = api_key  # sent by get()/status() when the gateway requires one
        self.config = config
        self._tmp = None if state_dir else tempfile.TemporaryDirectory(prefix="spillover-")
        self.state_dir = state_dir or (self._tmp.name if self._tmp else "")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        self.log_path = log_path or os.path.join(self.state_dir, "gateway.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"<GatewayProcess {self.url} pid={self.proc.pid if self.proc else None}>"

    def start(self) -> GatewayProcess:
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        extra: list[str] = []
        if self.config:
            path = Path(self.state_dir) / "config.toml"
            path.write_text(to_toml(self.config))
            extra = ["--config", str(path)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                self.module,
                "serve",
                "--port",
                str(self.port),
                "--state-dir",
                self.state_dir,
                *extra,
                *self.args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.wait_ready(all_workers=self.wait_all_workers)
        return self

    def wait_ready(self, timeout_s: float | None = None, *, all_workers: bool = True) -> dict[str, Any]:
        """Wait until /ready is 200 (and, by default, every worker is ready)."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}: {self.tail()}")
            try:
                st: dict[str, Any] = self.get("/v1/status")
                last = st
                workers = st["workers"] + [w for svc in st.get("services", []) for w in svc.get("workers", [])]
                if not all_workers or all(w["state"] == "ready" for w in workers):
                    return st
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready: {last} {self.tail()}")

    def get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=10) as r:
            return json.loads(r.read())

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("/v1/status")
        return result

    def restart(self) -> GatewayProcess:
        """Start again on the same state folder and port (after ``kill9``)."""
        return self.start()

    def worker(self, lane: str) -> dict[str, Any]:
        """The status entry of the first worker of a lane."""
        return next(w for w in self.status()["workers"] if w["lane"] == lane)

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as fh:
            data = fh.read()
            return data[-n:].decode("utf-8", "replace")
        return ""

    def kill9(self) -> None:
        """SIGKILL the gateway (its workers notice their closed channel and exit)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.log_archive is not None and os.path.exists(self.log_path):
            self.log_archive.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log_path, self.log_archive / f"gateway-{self.port}.log")
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
