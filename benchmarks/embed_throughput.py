"""Embeddings throughput through the gateway vs the bare runtime: same model, same threads.

For each batch size, one request of ``batch`` inputs (sentences of about ``--words`` words)
is timed through ``POST /v1/embeddings`` (the official openai client, base64, as it sends
by default) and through a bare ``Embedder`` in this process (ONNX Runtime, same threads,
same chunking), interleaved round by round. Prints inputs/s of each, their ratio (target
>= 0.95 at batch 32) and checks the vectors are identical.

    .venv/bin/python -m benchmarks.embed_throughput [--rounds 7] [--batches 1,8,32] [--threads 1]

On the sim device the "GPU" worker computes on the CPU like the bare runtime, so the ratio
is the gateway's own cost: HTTP, validation, journal (fsync), queueing, the worker channel
and base64 framing. The gateway runs with ``--chat-only`` off (chat, embeddings and transcription loaded),
and the chat model and transcription are idle.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import median
from spillover.engine.embedder import Embedder, EmbedTokenizer, default_embed_model_dir
from spillover.testing import GatewayProcess


def sentences(n: int, words: int, salt: int) -> list[str]:
    base = "the quick brown fox jumps over the lazy dog while rain falls on the quiet town".split(" ")  # noqa: SIM905
    return [" ".join(base[(i + j + salt) % len(base)] for j in range(words)) + f" {salt}-{i}" for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--words", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import openai

    model_dir = default_embed_model_dir()
    tok = EmbedTokenizer(model_dir)
    bare = Embedder(model_dir, n_threads=a.threads)
    ok = True
    # The service's workers use [[services]].n_threads (default 1): --threads must match it.
    with GatewayProcess(["--gpu", "sim:2048"], services=True) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        print(f"bge-small-en, {a.threads} thread(s), {a.words}-word inputs, median of {a.rounds} rounds")
        print(f"{'batch':>5} {'bare in/s':>10} {'gateway in/s':>13} {'ratio':>7} {'route':>6} identical")
        for batch in [int(x) for x in a.batches.split(",")]:
            client.embeddings.create(model="bge-small-en", input=sentences(batch, a.words, 999))  # warm-up
            bare.embed([tok.wrap(ids) for ids in tok.encode(sentences(batch, a.words, 998))], 32)
            b_rates, g_rates, same, routes = [], [], True, set()
            for r in range(a.rounds):
                texts = sentences(batch, a.words, r)
                t0 = time.perf_counter()
                ref = bare.embed([tok.wrap(ids) for ids in tok.encode(texts)], 32)
                b_rates.append(batch / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                raw = client.embeddings.with_raw_response.create(model="bge-small-en", input=texts)
                got = raw.parse()
                g_rates.append(batch / (time.perf_counter() - t0))
                routes.add(raw.headers["x-spillover-route"])
                same = same and np.array_equal(np.array([d.embedding for d in got.data], dtype=np.float32), ref)
            ratio = median(g_rates) / median(b_rates)
            print(
                f"{batch:>5} {median(b_rates):>10.1f} {median(g_rates):>13.1f} {ratio:>7.3f} "
                f"{'/'.join(sorted(routes)):>6} {same}"
            )
            if batch == 32 and ratio < 0.95:
                ok = False
            ok = ok and same
    print("target: ratio >= 0.95 at batch 32, identical vectors:", "MET" if ok else "NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
