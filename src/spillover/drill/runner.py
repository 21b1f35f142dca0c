"""Runs the drill: gateway, sampler, scenarios (with a progress bar), checker, report."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillover.drill.chaos import CHAOS_SCENARIOS
from spillover.drill.checker import Figures, check
from spillover.drill.client import DrillClient
from spillover.drill.recorder import Recorder
from spillover.drill.scenarios import NEGATIVE_CONTROLS, SCENARIOS
from spillover.engine.sim import MIB, SimDevice
from spillover.testing import GatewayProcess, tree_rss

__all__ = ["Drill", "DrillOptions", "run_drill"]

PROFILES = {"ci": 1, "full": 15, "chaos": 1}  # scale of each scenario's traffic
DRILL_CONFIG: dict[str, dict[str, Any]] = {
    "failover": {"stall_timeout_s": 3.0},
    "breaker": {"cooldown_s": 1.0, "cooldown_max_s": 3.0, "close_after_successes": 1},
    "device": {"host_budget_mib": 3072},
    "cpu_lane": {"queue_depth": 32},
    # A demoted batch service comes back after 3 s of room (30 s by default): the drill sees both moves.
    "admission": {"promote_after_s": 3.0},
}


@dataclass(frozen=True)
class DrillOptions:
    """What ``spillover drill`` was asked to do."""

    out: Path
    profile: str = "ci"
    scenarios: tuple[str, ...] = ()
    url: str | None = None
    state_dir: str | None = None
    gpu: str = "sim:1024"
    fallback_model: str | None = None  # a GGUF the own gateway's CPU lane serves instead of a replica


class Drill:
    """Shared context of the scenarios."""

    def __init__(
        self, client: DrillClient, rec: Recorder, state_dir: str | None, gateway: GatewayProcess | None
    ) -> None:
        self.client = client
        self.rec = rec
        self.state_dir = state_dir
        self.gateway = gateway
        self._refs: dict[tuple[str, int], str] = {}

    def sim(self) -> SimDevice:
        if self.state_dir is None:
            raise RuntimeError("fault injection needs the gateway's --state-dir")
        return SimDevice(self.state_dir)

    def wait(self, pred: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                v = pred()
                if v:
                    return v
            time.sleep(0.05)
        raise TimeoutError("drill: condition not reached")

    def expect(self, scenario: str, name: str, ok: bool, detail: Any = None) -> None:
        self.rec.write("assert", scenario=scenario, name=name, ok=bool(ok), detail=str(detail)[:300])

    def gpu_worker(self) -> dict[str, Any]:
        return next(w for w in self.client.status()["workers"] if w["lane"] == "gpu")

    def await_gpu(self, timeout_s: float = 90.0) -> None:
        """Wait until the GPU serves again (worker ready, breaker closed), probing a
        half-open breaker with tiny requests."""

        def serving() -> bool:
            st = self.client.status()
            if st["breaker"]["circuit"] == "half_open":
                self.client.http.post("/v1/completions", json={"prompt": "probe", "max_tokens": 2})
            st = self.client.status()
            gpu = next(w for w in st["workers"] if w["lane"] == "gpu")
            # Every service is back on the device too (loaded, not demoted): a fault injected
            # next (an allocation failure) meets the request it is meant for, not a load.
            services = all(
                not svc.get("demoted") and not svc.get("load_waiting")
                and all(w["state"] == "ready" for w in svc.get("workers", []) if w["lane"] == "gpu")
                for svc in st.get("services", [])
            )  # fmt: skip
            return bool(gpu["state"] == "ready" and st["breaker"]["circuit"] == "closed" and services)

        self.wait(serving, timeout_s)

    def reference(self, prompt: str, max_tokens: int) -> str:
        """The uninterrupted greedy output (computed once, on the GPU, no faults)."""
        key = (prompt, max_tokens)
        if key not in self._refs:
            self.await_gpu()
            r = self.client.http.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            )
            self._refs[key] = r.json()["choices"][0]["text"]
        return self._refs[key]

    def kill_gpu(self, scenario: str, reset: bool = False) -> int:
        pid = int(self.gpu_worker()["pid"])
        self.rec.write(
            "fault", scenario=scenario, kind="driver_reset" if reset else "sigkill", pid=pid, expect_recovery=True
        )
        if reset:
            self.sim().reset()
        else:
            os.kill(pid, signal.SIGKILL)
        return pid

    def kill_gpu_when_busy(self, scenario: str) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.gpu_worker()["busy"] >= 1:
                    self.kill_gpu(scenario)
                    return
            time.sleep(0.003)

    @contextlib.contextmanager
    def tenant(self, leave_mib: int) -> Iterator[None]:
        """Another service holds all but ``leave_mib`` of the device's headroom."""
        snap = self.sim().snapshot()
        margin = self.client.status()["device"]["ledger"]["margin_bytes"]
        hold = max(0, snap.capacity_bytes - margin - snap.used_bytes - leave_mib * MIB) // MIB
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spillover.cli",
                "tenant",
                "--state-dir",
                str(self.state_dir),
                "--mib",
                str(hold),
                "--name",
                "drill-tenant",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.rec.write("fault", kind="tenant_start", mib=hold)
        try:
            self.wait(
                lambda: self.client.status()["device"]["ledger"]["observed_bytes"] >= snap.used_bytes + hold * MIB, 20
            )
            yield
        finally:
            proc.terminate()
            proc.wait(10)
            self.rec.write("fault", kind="tenant_stop", mib=hold)


def _sampler(d: Drill, stop: threading.Event, gateway: GatewayProcess | None) -> None:
    seen: set[tuple[str, str]] = set()
    while not stop.is_set():
        with contextlib.suppress(Exception):
            st = d.client.status()
            rss = st["host"]["observed_rss_bytes"]
            if gateway is not None and gateway.proc is not None and gateway.proc.poll() is None:
                rss = tree_rss(gateway.proc.pid)
            gpu = next((w for w in st["workers"] if w["lane"] == "gpu"), None)
            d.rec.write(
                "sample",
                mode=st["mode"],
                ledger=(st.get("device") or {}).get("ledger"),
                lanes=[{k: lane[k] for k in ("lane", "depth", "oldest_age_s", "running")} for lane in st["lanes"]],
                breaker=(st.get("breaker") or {}).get("circuit"),
                host_rss=rss,
                host_budget=st["host"]["budget_bytes"],
                gpu_serving=bool(gpu and gpu["state"] == "ready" and st["breaker"]["circuit"] == "closed"),
                services=[
                    {"name": s["name"], "device_bytes": s.get("device_bytes", 0), "demoted": bool(s.get("demoted"))}
                    for s in st.get("services", [])
                ],
            )
            for dec in st["recent_decisions"]:
                k = (dec["rid"], dec["reason"])
                if k not in seen:
                    seen.add(k)
                    d.rec.write("decision", **dec)
        stop.wait(0.25)


def run_drill(opts: DrillOptions, progress: bool = True) -> tuple[int, dict[str, Figures]]:
    """Run the drill; returns (exit status, figures per scenario)."""
    from spillover.drill.report import write_report

    every = SCENARIOS | CHAOS_SCENARIOS
    names = list(opts.scenarios) or list(SCENARIOS) + (list(CHAOS_SCENARIOS) if opts.profile == "chaos" else [])
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"unknown scenario(s): {unknown}; choose from {list(every)}")
    scale = PROFILES[opts.profile]
    opts.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(opts.out / "history.jsonl")
    gateway: GatewayProcess | None = None
    state_dir = opts.state_dir
    if opts.url is None:
        fallback = ["--fallback-model", opts.fallback_model] if opts.fallback_model else []
        gateway = GatewayProcess(
            ["--gpu", opts.gpu, "--gpu-slots", "2", "--cpu-slots", "2", "--cpu-ctx", "2048", *fallback],
            config=DRILL_CONFIG,
            state_dir=str(opts.out / "gateway-state"),
            # every default service on one device, as `spillover serve` runs (transcription's
            # workers only when a transcription scenario runs: they cost two processes)
            services=True if any(n.startswith("transcription_") for n in names) else ("chat", "embeddings"),
        )
        gateway.start()
        state_dir = gateway.state_dir
    url = opts.url or (gateway.url if gateway else "")
    client = DrillClient(url, rec)
    d = Drill(client, rec, state_dir, gateway)
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(d, stop, gateway), daemon=True)
    sampler.start()
    errors: dict[str, str] = {}
    try:
        with _progress(progress, len(names)) as advance:
            for name in names:
                rec.write("scenario_start", scenario=name)
                try:
                    every[name](d, scale)
                except Exception as exc:  # a scenario that cannot finish is a failure, recorded
                    errors[name] = f"{type(exc).__name__}: {exc}"
                    rec.write("assert", scenario=name, name="scenario finished", ok=False, detail=errors[name])
                rec.write("scenario_end", scenario=name)
                advance(name)
        with contextlib.suppress(Exception):
            d.wait(lambda: client.status()["live_requests"] == 0, 120)
        _check_quiescence(d)
        client.finals()
    finally:
        stop.set()
        sampler.join(5)
        client.close()
        if gateway is not None:
            gateway.stop()
        rec.close()
    figures = {name: check(rec.history, name) for name in names}
    overall = check([r for r in rec.history if r.get("scenario") not in NEGATIVE_CONTROLS], None)
    overall.scenario = "overall"
    failed = [n for n, f in figures.items() if (not f.passed) != (n in NEGATIVE_CONTROLS)]
    caught = {n: not figures[n].passed for n in names if n in NEGATIVE_CONTROLS}
    write_report(opts.out, rec.history, figures, overall, caught, opts.profile)
    return (1 if failed or not overall.passed else 0), figures | {"overall": overall}


def _check_quiescence(d: Drill) -> None:
    """At the end of every profile: the gateway is at rest (no slot, reservation, live
    request, held key or unfinished journal row left)."""
    from spillover.testing.invariants import wait_quiescent

    journal = Path(d.state_dir) / "journal.sqlite3" if d.state_dir else None
    try:
        left = wait_quiescent(d.client.status, journal, timeout_s=60)
    except Exception as exc:  # an unreachable gateway is a failure too
        left = [f"{type(exc).__name__}: {exc}"]
    d.rec.write("assert", scenario="quiescence", name="invariants at rest", ok=not left, detail="; ".join(left))


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    if not enabled:
        yield lambda name: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("drill"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} {task.description}"),
        TimeElapsedColumn(),
    ) as p:
        task = p.add_task("starting", total=total)
        yield lambda name: p.update(task, advance=1, description=name)
