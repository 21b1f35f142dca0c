"""Gateway overhead vs. bare llama-cpp-python: same model, same prompt, same threads.

Prints decode tokens/s of both and their ratio (target >= 0.97 at concurrency 1), and the
latency of a 1-token completion through each (median of >= 20), measured in one run with
the two interleaved.

    .venv/bin/python -m benchmarks.serve_overhead [--rounds 5] [--latency-n 25] [--threads 1,2]

Each thread count is measured separately (bare and gateway with the same llama.cpp
threads). On a 2-core machine with the sim device, engine threads and the gateway share
the cores: with 2 engine threads the gateway's own CPU per token is taken from the engine.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from benchmarks._common import median, sse_token_times
from spillover.config import default_model_path
from spillover.testing import GatewayProcess

PROMPT = "Here is a long list of numbers, counting up: 1, 2, 3, 4, 5, 6, 7,"


def bare_run(llm, tokens: list[int], n: int) -> tuple[float, list[float]]:
    """Greedy-generate up to n tokens; (t_start, per-token times)."""
    llm.reset()
    t0 = time.perf_counter()
    times = []
    for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if tok == llm.token_eos():
            break
        llm.detokenize([tok])
        times.append(time.perf_counter())
        if len(times) >= n:
            break
    return t0, times


def decode_tps(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--latency-n", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2", help="comma-separated llama.cpp thread counts")
    a = ap.parse_args()
    for threads in [int(x) for x in a.threads.split(",")]:
        measure(a, threads)
    return 0


def measure(a: argparse.Namespace, threads: int) -> None:
    from llama_cpp import Llama

    model = default_model_path()
    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    args = ["--gpu", "sim:2048", "--gpu-slots", "1", "--gpu-threads", str(threads), "--cpu-threads", "1"]
    bare_tps, gw_tps, bare_lat, gw_lat, bare_e2e, gw_e2e = [], [], [], [], [], []
    body = {"prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0}
    with GatewayProcess(args) as gw, httpx.Client(base_url=gw.url, timeout=120) as c:
        sse_token_times(c, "/v1/completions", body)  # warm-up
        bare_run(llm, tokens, a.tokens)
        for _ in range(a.rounds):
            _, bt = bare_run(llm, tokens, a.tokens)
            bare_tps.append(decode_tps(bt))
            _, gt, hdr = sse_token_times(c, "/v1/completions", body)
            assert hdr["x-spillover-route"] == "gpu", hdr
            gw_tps.append(decode_tps(gt))
            t0, bt = bare_run(llm, tokens, a.tokens)
            bare_e2e.append(len(bt) / (bt[-1] - t0))
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            r.raise_for_status()
            gw_e2e.append(r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t0))
        for _ in range(a.latency_n):
            t0, bt = bare_run(llm, tokens, 1)
            bare_lat.append(bt[-1] - t0)
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            gw_lat.append(time.perf_counter() - t0)
    bt, gt = median(bare_tps), median(gw_tps)
    bl, gl = median(bare_lat) * 1000, median(gw_lat) * 1000
    print(f"model: {model.rsplit('/', 1)[-1]}  threads: {threads}  concurrency: 1")
    print(f"{'':28}{'bare':>10}{'gateway':>10}{'ratio':>8}")
    print(f"{'decode tok/s (median of ' + str(a.rounds) + ')':28}{bt:10.1f}{gt:10.1f}{gt / bt:8.3f}")
    be, ge = median(bare_e2e), median(gw_e2e)
    print(f"{'non-stream tok/s (median)':28}{be:10.1f}{ge:10.1f}{ge / be:8.3f}")
    print(f"{'1-token latency ms (med ' + str(a.latency_n) + ')':28}{bl:10.1f}{gl:10.1f}{gl / bl:8.3f}")
    print(f"added latency of a 1-token completion: {gl - bl:.1f} ms (median)")
    for name, ratio in (("stream decode", gt / bt), ("non-stream", ge / be)):
        print(f"target: {name} ratio >= 0.97 -> {'MET' if ratio >= 0.97 else 'NOT MET'} ({ratio:.3f})")
    print()


if __name__ == "__main__":
    sys.exit(main())
