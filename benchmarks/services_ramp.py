"""Mixed-service ramp on a sim GPU of fixed capacity: chat and embeddings share one budget.

Each level sends ``level`` chat requests and ``level // 2 + 1`` embedding batches at once
(32 inputs of about 90 tokens each). The oracle knows the truth: the device's capacity, the
weights the GPU workers hold (chat's, embeddings' and transcription's) and the margin; what is
left is the room requests can use.
spillover's figure is the peak of request bytes it held on the device at once (the ledger's
reservations, sampled every 20 ms), next to that room, and what did not fit must have run on
the CPU paths with zero GPU allocation failures.

    .venv/bin/python -m benchmarks.services_ramp [--levels 1,2,4,6,8] [--room-mib 160]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter

import httpx

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import at_once
from spillover.engine.sim import SimDevice
from spillover.testing import GatewayProcess

MIB = 1024 * 1024
PROMPT = "Write a short poem about the sea."
TEXT = "lorem ipsum dolor sit amet " * 10  # about 90 tokens
MARGIN_MIB = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,2,4,6,8")
    ap.add_argument("--room-mib", type=int, default=160, help="device room left for requests beside the weights")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    args = ["--gpu", "sim:4096", "--margin-mib", str(MARGIN_MIB), "--gpu-slots", str(max(levels)), "--gpu-ctx", "512"]
    routes: Counter[str] = Counter()
    per_level = []
    peak_request_bytes = 0
    with GatewayProcess(args, services=True) as gw, httpx.Client(base_url=gw.url, timeout=300) as c:
        weights = gw.status()["device"]["ledger"]["predicted_bytes"]
        capacity = weights + (MARGIN_MIB + a.room_mib) * MIB
        SimDevice(gw.state_dir).set_capacity(capacity)
        while gw.status()["device"]["ledger"]["capacity_bytes"] != capacity:
            time.sleep(0.05)
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak_request_bytes
            while not stop.is_set():
                led = gw.status()["device"]["ledger"]
                peak_request_bytes = max(peak_request_bytes, led["predicted_bytes"] - weights)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for level in levels:
            got: list[str] = []

            def chat(got: list[str] = got) -> None:
                r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0})
                got.append(("chat-" + r.headers.get("x-spillover-route", "?")) if r.status_code == 200 else "err")

            def embed(got: list[str] = got) -> None:
                r = c.post("/v1/embeddings", json={"model": "bge-small-en", "input": [TEXT] * 32})
                got.append(("emb-" + r.headers.get("x-spillover-route", "?")) if r.status_code == 200 else "err")

            at_once([chat] * level + [embed] * (level // 2 + 1))
            cnt = Counter(got)
            routes.update(cnt)
            per_level.append((level, cnt))
        stop.set()
        sampler.join()
        st = gw.status()
        dev_failures = st["device"]["alloc_failures"]
        worker_failures = sum(w["alloc_failures"] for w in st["workers"]) + sum(
            w["alloc_failures"] for s in st["services"] for w in s.get("workers", [])
        )
    room = capacity - weights - MARGIN_MIB * MIB
    print(
        f"sim capacity {capacity / MIB:.0f} MiB: weights of the GPU workers {weights / MIB:.1f} MiB, "
        f"margin {MARGIN_MIB} MiB, room for requests {room / MIB:.0f} MiB"
    )
    print(f"{'level':>6}  {'chat gpu/cpu':>13}  {'embeddings gpu/cpu':>19}  {'errors':>6}")
    for level, cnt in per_level:
        print(
            f"{level:6d}  {cnt['chat-gpu']:>6}/{cnt['chat-cpu']:<6}  {cnt['emb-gpu']:>9}/{cnt['emb-cpu']:<9}  "
            f"{cnt['err']:>6}"
        )
    use = peak_request_bytes / room
    print(f"oracle room for requests:          {room / MIB:.1f} MiB")
    print(f"spillover peak request bytes held: {peak_request_bytes / MIB:.1f} MiB ({use:.3f} of the room)")
    print(
        f"GPU allocation failures:           {dev_failures} on the device, {worker_failures} in the workers "
        f"(target 0: {'MET' if dev_failures == worker_failures == 0 else 'NOT MET'})"
    )
    print(f"routes over the ramp: {dict(routes)}")
    ok = dev_failures == 0 and worker_failures == 0 and routes["err"] == 0 and peak_request_bytes <= room
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
