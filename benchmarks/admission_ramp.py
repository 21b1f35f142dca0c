"""Concurrency ramp on a sim GPU of fixed capacity: how close admission gets to the oracle.

The oracle knows the truth: the device's capacity, the bytes the GPU worker holds for its
weights, and the bytes each request really charges; it fits floor((capacity - weights) /
footprint) requests at once. spillover's figure is the peak number of requests it held on
the GPU at once (the ledger's peak of live request reservations) over a ramp of concurrent
load; everything that did not fit must go to the CPU lane, with zero GPU allocation
failures.

    .venv/bin/python -m benchmarks.admission_ramp [--fit 6] [--levels 1,2,4,6,8,10,12]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import httpx

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import at_once
from spillover.config import default_model_path
from spillover.core.memory import MemoryModel
from spillover.engine.gguf_meta import read_model_spec
from spillover.engine.llama_engine import Tokenizer
from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess

MIB = 1024 * 1024
PROMPT = "Write a short poem about the sea."
MAX_TOKENS = 48
MARGIN_MIB = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", type=int, default=6, help="requests the device is sized to hold")
    ap.add_argument("--levels", default="1,2,4,6,8,10,12")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    model = default_model_path()
    spec = read_model_spec(model)
    mm = MemoryModel(spec)
    n_prompt = len(Tokenizer(model).tokenize(PROMPT, special=False))
    fp = mm.request_footprint(n_prompt, MAX_TOKENS).total_bytes
    weights = mm.weights_bytes()
    cap_mib = -(-(weights + MARGIN_MIB * MIB + a.fit * fp + fp // 2) // MIB)
    args = [
        "--gpu",
        f"sim:{cap_mib}",
        "--margin-mib",
        str(MARGIN_MIB),
        "--gpu-slots",
        str(max(levels)),
        "--gpu-ctx",
        "512",
        "--gpu-threads",
        "1",
        "--cpu-slots",
        "1",
        "--cpu-ctx",
        "2048",
    ]
    routes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    per_level = []
    with GatewayProcess(args) as gw, httpx.Client(base_url=gw.url, timeout=300) as c:
        st = gw.status()
        gpu_pid = gw.worker("gpu")["pid"]
        capacity = st["device"]["ledger"]["capacity_bytes"]
        held = SimDevice(gw.state_dir).snapshot().used_by_pid(gpu_pid)
        oracle = (capacity - held) // fp
        oracle_margin = (capacity - held - MARGIN_MIB * MIB) // fp
        for level in levels:
            got: list[str] = []

            def one(got: list[str] = got) -> None:
                r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
                got.append(r.headers.get("x-spillover-route", "?") if r.status_code == 200 else f"http{r.status_code}")
                reasons[r.headers.get("x-spillover-reason", "?")] += 1

            at_once([one] * level)
            cnt = Counter(got)
            routes.update(cnt)
            per_level.append((level, cnt["gpu"], cnt["cpu"], sum(v for k, v in cnt.items() if k not in ("gpu", "cpu"))))
        st = gw.status()
        peak = st["device"]["ledger"]["peak_requests"]
        dev_failures = st["device"]["alloc_failures"]
        worker_failures = gw.worker("gpu")["alloc_failures"]
    offered_max = max(levels)
    target = min(oracle, offered_max)
    print(
        f"sim capacity {capacity / MIB:.0f} MiB, GPU worker weights {held / MIB:.1f} MiB, "
        f"request footprint {fp / MIB:.2f} MiB ({n_prompt}+{MAX_TOKENS} tokens), margin {MARGIN_MIB} MiB"
    )
    print(f"{'level':>6}{'gpu':>6}{'cpu':>6}{'err':>6}")
    for level, g, cpu, err in per_level:
        print(f"{level:6d}{g:6d}{cpu:6d}{err:6d}")
    print(f"oracle max concurrent that fits:        {oracle} (respecting the margin: {oracle_margin})")
    print(f"spillover peak concurrent on GPU:       {peak}")
    print(
        f"ratio admitted/oracle:                  {peak / target:.3f} (target >= 0.95: "
        f"{'MET' if peak / target >= 0.95 else 'NOT MET'})"
    )
    print(
        f"GPU allocation failures:                {dev_failures} on the device, "
        f"{worker_failures} in the worker "
        f"(target 0: {'MET' if dev_failures == 0 and worker_failures == 0 else 'NOT MET'})"
    )
    print(f"routes over the ramp: {dict(routes)}; reasons: {dict(reasons)}")
    ok = peak / target >= 0.95 and dev_failures == 0 and worker_failures == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
