"""Gateway overhead vs. bare llama-cpp-python: same model, same prompt, same threads.

Prints decode tokens/s of both and their ratio (target >= 0.97), streaming and non-streaming,
and the latency of a 1-token completion through each (median of >= 20), measured in one run
with the two interleaved.

    .venv/bin/python -m benchmarks.serve_overhead [--rounds 20] [--latency-n 25] [--threads 1,2]
        [--concurrency 1] [--stream-coalesce-ms MS]

Each (threads, concurrency) cell is measured separately. Bare: ``concurrency`` llama contexts
(``Llama`` objects) generating at once, one Python thread each; gateway: a GPU worker with
``concurrency`` slots and as many clients at once. Throughput is the total decoded tokens over
the span from the first token to the last (stream), or completion tokens over the wall time
(non-stream), so both sides pay the same contention. On a 2-core machine with the sim device,
engine threads and the gateway share the cores: at threads = cores the gateway's own CPU per
token is taken from the engine. The ratio is the median of the rounds' own ratios (bare and
gateway measured back to back in each round, the side that goes first alternating from round
to round, so an even number of rounds measures each order equally), printed with their
range. The default is 20 rounds a cell: the rounds' own ratios spread over 0.76-1.10 on these
shared cores, and a median of 6 moved by about 4 % from one run to the next (0.963 and 0.971 for
the same cell on the same commit, 2026-12-07), as much as the target's margin. The streaming
client reads the socket itself (``_common.sse_token_times``): it is the
measuring instrument, and the bare engine has none. Each cell also prints the CPU a streamed
token takes over the stream rounds: in the gateway process (its idle loops included), in the
streaming client, and in the GPU worker beside the bare engine's own (``StreamCost``). The
gateway sends a stream's tokens as ``[server].stream_coalesce_ms`` groups them (the default),
so the stream figures count tokens from the answer's usage, not frames."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import psutil

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import SseRun, at_once, cpu_s, median, sse_token_times
from spillover.config import ServerConfig, default_model_path
from spillover.engine.llamacpp import load_llama_cpp
from spillover.testing import GatewayProcess

PROMPT = "Here is a long list of numbers, counting up: 1, 2, 3, 4, 5, 6, 7,"


def bare_run(llm: Any, tokens: list[int], n: int) -> tuple[float, list[float]]:
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


def span_tps(runs: list[tuple[list[float], int]]) -> float:
    """Tokens after each run's first, over the span from the first first-token to the last
    token; a run is (the arrival times of its texts, its tokens): a streamed frame may carry
    several tokens (``SseRun``), a bare run's times are one per token."""
    runs = [(ts, n) for ts, n in runs if len(ts) > 1]
    if not runs:
        return float("nan")
    start = min(ts[0] for ts, _ in runs)
    end = max(ts[-1] for ts, _ in runs)
    return sum(n - 1 for _, n in runs) / (end - start)


G = TypeVar("G")
B = TypeVar("B")


def back_to_back(gateway_first: bool, gateway: Callable[[], G], bare: Callable[[], B]) -> tuple[G, B]:
    """Measure both sides, one right after the other, the gateway first when asked:
    (the gateway's result, the bare engine's)."""
    if gateway_first:
        got = gateway()
        return got, bare()
    base = bare()
    return gateway(), base


def wall_tps(runs: list[tuple[float, float, int]]) -> float:
    """Completion tokens over the wall time from the first request sent to the last answer."""
    return sum(n for _, _, n in runs) / (max(t1 for _, t1, _ in runs) - min(t0 for t0, _, _ in runs))


@dataclass
class StreamCost:
    """CPU seconds over the streaming rounds, to show where a streamed token's CPU goes: the
    gateway process (idle loops included: they run on the same cores), the streaming client
    (the benchmark's own reading threads), the GPU worker process, and the bare engine (this
    process during the bare rounds, nothing else running in it then)."""

    gateway_s: float = 0.0
    worker_s: float = 0.0
    client_s: float = 0.0
    tokens: int = 0
    bare_s: float = 0.0
    bare_tokens: int = 0

    @staticmethod
    def processes(gw: GatewayProcess) -> tuple[float, float]:
        """(gateway CPU s, GPU worker CPU s) so far."""
        assert gw.proc is not None
        p = psutil.Process(gw.proc.pid)
        workers = [k for k in p.children(recursive=True) if "gpu0" in " ".join(k.cmdline())]
        return cpu_s(p), sum(cpu_s(k) for k in workers)

    def add_gateway(self, gw: GatewayProcess, before: tuple[float, float], tokens: int) -> None:
        after = self.processes(gw)
        self.gateway_s += after[0] - before[0]
        self.worker_s += after[1] - before[1]
        self.tokens += tokens

    def report(self) -> None:
        if not self.tokens or not self.bare_tokens:
            return
        us = 1e6 / self.tokens
        gw, client = self.gateway_s * us, self.client_s * us
        worker_ms, bare_ms = self.worker_s * us / 1000, 1000 * self.bare_s / self.bare_tokens
        print(
            f"CPU a streamed token: gateway {gw:.0f} us (idle loops included), client {client:.0f} us;"
            f" GPU worker {worker_ms:.1f} ms vs bare engine {bare_ms:.1f} ms"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds per cell; the side measured first alternates")
    ap.add_argument("--latency-n", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2", help="comma-separated llama.cpp thread counts")
    ap.add_argument("--concurrency", default="1", help="comma-separated numbers of requests at once")
    ap.add_argument(
        "--stream-coalesce-ms",
        type=float,
        default=None,
        help="the gateway's [server].stream_coalesce_ms (default: the config's default)",
    )
    a = ap.parse_args()
    for threads in [int(x) for x in a.threads.split(",")]:
        for conc in [int(x) for x in a.concurrency.split(",")]:
            measure(a, threads, conc)
    return 0


def measure(a: argparse.Namespace, threads: int, conc: int) -> None:
    Llama = load_llama_cpp().Llama  # loads as the workers do (the AMX guard)
    model = default_model_path()
    llms = [
        Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
        for _ in range(conc)
    ]
    tokens = llms[0].tokenize(PROMPT.encode(), add_bos=True, special=False)
    args = ["--gpu", "sim:4096", "--gpu-slots", str(conc), "--gpu-threads", str(threads), "--cpu-threads", "1"]
    bare_tps, gw_tps, bare_lat, gw_lat, bare_e2e, gw_e2e = [], [], [], [], [], []
    cost = StreamCost()  # where the streamed tokens' CPU goes, over the stream rounds
    failures: list[str] = []  # gateway answers that were not a GPU completion (printed, left out)
    body = {"prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0}

    def bare_round(n: int) -> list[tuple[float, list[float]]]:
        out: list[tuple[float, list[float]]] = []
        at_once([lambda llm=llm: out.append(bare_run(llm, tokens, n)) for llm in llms])  # type: ignore[misc]
        return out

    # The CPU lane's canary (1 % of traffic served on the CPU by design) is off: a round with a
    # request served on the CPU is not a like-for-like round, and is left out.
    config: dict[str, Any] = {"cpu_lane": {"canary_ratio": 0.0}}
    if a.stream_coalesce_ms is not None:
        config["server"] = {"stream_coalesce_ms": a.stream_coalesce_ms}
    with GatewayProcess(args, config=config) as gw, httpx.Client(base_url=gw.url, timeout=300) as c:

        def gw_stream_round() -> list[SseRun]:
            out: list[SseRun] = []

            def one() -> None:
                c0 = time.thread_time()
                try:
                    run = sse_token_times(c, "/v1/completions", body)
                    cost.client_s += time.thread_time() - c0
                except httpx.HTTPStatusError as exc:
                    failures.append(f"stream {exc.response.status_code}: {exc.response.read()[:300]!r}")
                    return
                hdr = run.headers
                if hdr["x-spillover-route"] != "gpu":
                    failures.append(f"stream served on {hdr['x-spillover-route']}: {hdr.get('x-spillover-reason')}")
                    return
                out.append(run)

            before = cost.processes(gw)
            at_once([one] * conc)
            cost.add_gateway(gw, before, sum(r.tokens for r in out))
            return out

        def gw_plain_round() -> list[tuple[float, float, int]]:
            out: list[tuple[float, float, int]] = []

            def one() -> None:
                t0 = time.perf_counter()
                r = c.post("/v1/completions", json=body)
                if r.status_code != 200 or r.headers.get("x-spillover-route") != "gpu":
                    route, why = r.headers.get("x-spillover-route"), r.headers.get("x-spillover-reason")
                    failures.append(f"{r.status_code} {route} ({why}): {r.text[:300]}")
                    return
                out.append((t0, time.perf_counter(), r.json()["usage"]["completion_tokens"]))

            at_once([one] * conc)
            return out

        gw_stream_round()  # warm-up: every slot's context has decoded once
        bare_round(a.tokens)

        def bare_stream_round() -> list[tuple[float, list[float]]]:
            c0 = cpu_s(psutil.Process())
            runs = bare_round(a.tokens)
            cost.bare_s += cpu_s(psutil.Process()) - c0
            cost.bare_tokens += sum(len(ts) for _, ts in runs)
            return runs

        for i in range(a.rounds):
            # Which side runs first alternates from round to round: the second of a pair
            # found the cores warmer or busier (the other side's threads just stopped), so
            # a fixed order biased every round's ratio the same way.
            gateway_first = i % 2 == 1
            streams, bare_runs = back_to_back(gateway_first, gw_stream_round, bare_stream_round)
            if len(streams) == conc:  # a round with a failed request is not a like-for-like round
                bare_tps.append(span_tps([(ts, len(ts)) for _, ts in bare_runs]))
                gw_tps.append(span_tps([(r.times, r.tokens) for r in streams]))
            plain, bare_plain = back_to_back(gateway_first, gw_plain_round, lambda: bare_round(a.tokens))
            if len(plain) == conc:
                bare_e2e.append(wall_tps([(t0, ts[-1], len(ts)) for t0, ts in bare_plain]))
                gw_e2e.append(wall_tps(plain))
        for _ in range(a.latency_n if conc == 1 else 0):
            t0, bt = bare_run(llms[0], tokens, 1)
            bare_lat.append(bt[-1] - t0)
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            gw_lat.append(time.perf_counter() - t0)
    for llm in llms:
        llm.close()
    # The ratio is the median of each round's own ratio: a round measures the bare engine and
    # the gateway back to back, so a drift of the machine's speed between rounds (tens of per
    # cent on these shared cores) cancels out; the range shows the rounds' spread.
    stream_ratios = [g / b for b, g in zip(bare_tps, gw_tps, strict=True)]
    plain_ratios = [g / b for b, g in zip(bare_e2e, gw_e2e, strict=True)]
    window = ServerConfig().stream_coalesce_ms if a.stream_coalesce_ms is None else a.stream_coalesce_ms
    print(f"model: {model.rsplit('/', 1)[-1]}  threads: {threads}  concurrency: {conc}  stream_coalesce_ms: {window:g}")
    print(f"{'':34}{'bare':>10}{'gateway':>10}{'ratio':>8}  rounds' ratios")
    for name, b, g, ratios in (
        (f"decode tok/s (median of {len(stream_ratios)})", bare_tps, gw_tps, stream_ratios),
        (f"non-stream tok/s (median of {len(plain_ratios)})", bare_e2e, gw_e2e, plain_ratios),
    ):
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
        print(f"{name:34}{median(b):10.1f}{median(g):10.1f}{median(ratios):8.3f}  {spread}")
    cost.report()
    if bare_lat:
        bl, gl = median(bare_lat) * 1000, median(gw_lat) * 1000
        print(f"{'1-token latency ms (med ' + str(a.latency_n) + ')':34}{bl:10.1f}{gl:10.1f}{gl / bl:8.3f}")
        print(f"added latency of a 1-token completion: {gl - bl:.1f} ms (median)")
    for f in failures:
        print(f"left out (not a GPU completion): {f}")
    for name, ratio in (("stream decode", median(stream_ratios)), ("non-stream", median(plain_ratios))):
        print(f"target: {name} ratio >= 0.97 -> {'MET' if ratio >= 0.97 else 'NOT MET'} ({ratio:.3f})")
    print()


if __name__ == "__main__":
    sys.exit(main())
