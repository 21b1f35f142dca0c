"""Execution profiles side by side: the same workload on the resident GPU profile, the split
profile and the CPU profile, each through a real gateway with real workers.

Columns, per profile:

- device MiB: the peak the device held during the workload (the sim ledger's own reading);
- host MiB: the peak resident memory of the gateway and all its workers;
- prefill tok/s and decode tok/s: median over ``--n`` greedy streams of the same prompt
  (prompt tokens / time to first token; tokens after the first / time from first to last);
- recover ms: from a SIGKILL of the worker that served the workload (the GPU or split worker;
  the CPU worker in the cpu profile) to the first token of a request sent at that moment
  (sent again every 50 ms while it is refused: the cpu profile has nothing else to serve it);
- back s: until that worker is ready again;
- ramp: the device's capacity is stepped down to 75 %, 50 % and 25 % of its size, three
  requests at each step; where they were served (and errors), in order (run before the kill).

Profiles: ``gpu`` runs on a sim device large enough for the whole model; ``split`` on one too
small for it (``--split``: the largest split that fits, planned by the memory model); ``cpu``
has no device.

On ``sim`` the device's compute is the CPU's, so prefill and decode speeds compare nothing
real there (the three profiles run the same CPU kernels): only the memory and recovery
columns mean something. On ``cuda:N`` (``--gpu cuda:0``) every column is real.

    .venv/bin/python -m benchmarks.profiles [--n 5] [--gpu sim] [--small-mib 160] [--large-mib 1024]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

import httpx

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import median, sse_token_times
from spillover.engine.sim import SimDevice
from spillover.runtime.devices import tree_rss
from spillover.testing import GatewayProcess

PROMPT = "Explain in a few sentences why the sky looks blue during the day, and why sunsets look red:"
BODY = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0}
CONFIG = {"supervisor": {"restart_backoff_initial_s": 0.05, "restart_backoff_max_s": 0.05}}
MIB = 1024 * 1024


class Peaks:
    """Samples the gateway tree's RSS and the sim device's used bytes until stopped."""

    def __init__(self, gw: GatewayProcess, sim: SimDevice | None) -> None:
        self.gw, self.sim = gw, sim
        self.host = self.device = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        assert self.gw.proc is not None
        while not self._stop.is_set():
            self.host = max(self.host, tree_rss(self.gw.proc.pid))
            if self.sim is not None:
                self.device = max(self.device, self.sim.snapshot().used_bytes)
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def device_worker(gw: GatewayProcess, lane: str) -> dict[str, Any]:
    return next(w for w in gw.status()["workers"] if w["lane"] == lane)


def wait_ready(gw: GatewayProcess, lane: str, not_pid: int | None = None, timeout_s: float = 120) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        w = device_worker(gw, lane)
        if w["state"] == "ready" and w["pid"] != not_pid:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{lane} worker not back")


def workload(c: httpx.Client, n: int, prompt_tokens: int) -> tuple[float, float, list[str]]:
    prefill, decode, routes = [], [], []
    for _ in range(n):
        run = sse_token_times(c, "/v1/completions", BODY)
        routes.append(run.headers.get("x-spillover-route", "?"))
        if run.times:
            prefill.append(prompt_tokens / (run.times[0] - run.t0))
        if len(run.times) > 1:
            decode.append(run.decode_tps())
    return median(prefill), median(decode), routes


def recover(gw: GatewayProcess, c: httpx.Client, lane: str) -> tuple[float, float]:
    """SIGKILL the lane's worker; ms to the first token of a request sent then (refused
    requests are sent again every 50 ms), s until the worker is back."""
    pid = int(device_worker(gw, lane)["pid"])
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    first_ms = float("nan")
    while time.perf_counter() - t0 < 120:
        try:
            times = sse_token_times(c, "/v1/completions", {**BODY, "max_tokens": 4}).times
        except httpx.HTTPStatusError:  # nothing could serve it yet (503): ask again
            time.sleep(0.05)
            continue
        first_ms = (times[0] - t0) * 1000 if times else float("nan")
        break
    wait_ready(gw, lane, not_pid=pid)
    return first_ms, time.perf_counter() - t0


def ramp(gw: GatewayProcess, c: httpx.Client, sim: SimDevice | None) -> str:
    if sim is None:
        return "n/a (no device)"
    full = sim.snapshot().capacity_bytes
    out = []
    for share in (0.75, 0.5, 0.25):
        sim.set_capacity(int(full * share))
        got = []
        for _ in range(3):
            r = c.post("/v1/completions", json={**BODY, "max_tokens": 8})
            got.append(r.headers.get("x-spillover-route", "?") if r.status_code == 200 else f"E{r.status_code}")
        out.append(f"{int(share * 100)}%:" + ",".join(got))
    sim.set_capacity(full)
    return " ".join(out)


def run(profile: str, args: argparse.Namespace) -> dict[str, Any]:
    gpu = args.gpu if args.gpu != "sim" else None
    argv = {
        "gpu": ["--gpu", gpu or f"sim:{args.large_mib}"],
        "split": ["--gpu", gpu or f"sim:{args.small_mib}", "--split"],
        "cpu": ["--gpu", "none"],
    }[profile]
    with GatewayProcess(argv, config=CONFIG) as gw, httpx.Client(base_url=gw.url, timeout=300) as c:
        st = gw.status()
        plan = st["services"][0]["profile"]
        sim = SimDevice(gw.state_dir) if st["device"] and st["device"]["simulated"] else None
        lane = {"gpu": "gpu", "split": "split", "cpu": "cpu"}[profile]
        warm = c.post("/v1/completions", json=BODY)
        prompt_tokens = warm.json()["usage"]["prompt_tokens"]
        peaks = Peaks(gw, sim)
        prefill, decode, routes = workload(c, args.n, prompt_tokens)
        peaks.stop()
        ramped = ramp(gw, c, sim)  # before the kill: a breaker opened by it would route the ramp
        first_ms, back_s = recover(gw, c, lane)
        return {
            "profile": profile,
            "layers": plan.get("split_layers") if profile == "split" else ("all" if profile == "gpu" else 0),
            "served": ",".join(sorted(set(routes))),
            "device_mib": peaks.device / MIB,
            "host_mib": peaks.host / MIB,
            "prefill": prefill,
            "decode": decode,
            "recover_ms": first_ms,
            "back_s": back_s,
            "ramp": ramped,
            "why": plan.get("why", ""),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5, help="streams per profile (median)")
    ap.add_argument("--gpu", default="sim", help="sim (default) or cuda:N")
    ap.add_argument("--small-mib", type=int, default=160, help="sim capacity of the split profile")
    ap.add_argument("--large-mib", type=int, default=1024, help="sim capacity of the gpu profile")
    args = ap.parse_args()
    rows = [run(p, args) for p in ("gpu", "split", "cpu")]
    print(
        f"{'profile':8} {'layers':>6} {'served':>7} {'device MiB':>10} {'host MiB':>9} {'prefill tok/s':>13} "
        f"{'decode tok/s':>12} {'recover ms':>10} {'back s':>7}  ramp (75/50/25 % of the device)"
    )
    for r in rows:
        print(
            f"{r['profile']:8} {r['layers']!s:>6} {r['served']:>7} {r['device_mib']:10.1f} {r['host_mib']:9.1f} "
            f"{r['prefill']:13.1f} {r['decode']:12.1f} {r['recover_ms']:10.0f} {r['back_s']:7.2f}  {r['ramp']}"
        )
    for r in rows:
        print(f"  {r['profile']}: {r['why']}")
    if args.gpu == "sim":
        print(
            "note: on the sim device compute runs on the CPU, so the prefill and decode columns compare the same "
            "CPU kernels; only the device, host, recover and ramp columns mean something here."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
