"""The embeddings worker: one ONNX Runtime encoder session serving ``embed`` ops.

Gateway -> worker::

    {"op": "embed", "rid", "inputs": [[id, ...], ...], "batch_size", "reserve_bytes"}

Worker -> gateway (besides ``ready``, ``pong`` and ``fatal``, as for chat)::

    {"ev": "started", "rid"}                   its device memory is granted
    {"ev": "vectors", "rid", "n", "dim", "data"}  every vector: base64 of float32 little-endian rows
    {"ev": "done", "rid", "finish_reason": "stop", "prompt_tokens", "completion_tokens": 0, "timings"}
    {"ev": "error", "rid", "kind", "message"}  alloc_failed | oom | engine | cancelled

Inputs arrive already wrapped (``[CLS] ids [SEP]``) and are computed in chunks of
``batch_size`` in order (``engine.embedder``, rule 2), so a replay on another worker gives
the same vectors. On a ``sim`` device the reservation is charged before the first chunk, an
injected running fault hits between chunks (``oom``), a hang stops progress between chunks,
and a driver reset ends the process, as for chat.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from spillover.engine.worker import UnaryWorker, _error

__all__ = ["EmbedWorker"]


class EmbedWorker(UnaryWorker):
    """An embeddings worker (``--kind embeddings``)."""

    request_op = "embed"

    def model_fingerprint(self) -> dict[str, str]:
        from pathlib import Path

        from spillover.engine.llama_engine import file_digest

        digest = file_digest(f"{self.args.model}/model.onnx", cache_dir=Path(self.args.state_dir))
        return {
            "model": digest[:16],
            "batch_size": str(self.args.batch_size),
            "backend": "cuda" if self.kind == "cuda" else "cpu",
        }

    def load_model(self) -> Any:
        from spillover.engine.embedder import Embedder

        device = self.args.device if self.kind == "cuda" else "cpu"
        return Embedder(self.args.model, n_threads=self.args.n_threads, device=device)

    def probe(self, model: Any) -> None:
        from spillover.engine.embedder import EmbedTokenizer

        model.embed([EmbedTokenizer(self.args.model).wrap([])], 1)  # an empty text: [CLS] [SEP]

    def compute(self, model: Any, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        from spillover.engine.embedder import chunks

        inputs = [[int(t) for t in ids] for ids in msg["inputs"]]
        batch_size = max(1, int(msg.get("batch_size") or self.args.batch_size))
        self.chan.send({"ev": "started", "rid": rid})
        t0 = time.monotonic()
        parts = []
        for start, stop in chunks(inputs, batch_size):
            while self.hang.is_set() and rid not in self.cancelled:
                time.sleep(0.01)
            if rid in self.cancelled:
                return _error(rid, "cancelled", "cancelled")
            if self.sim is not None and self.oom_armed.is_set() and self.sim.take_running_fault():
                return _error(rid, "oom", "device out of memory in the encoder")
            parts.append(model.embed(inputs[start:stop], batch_size))
            self.progress += stop - start
        vectors = np.concatenate(parts, axis=0).astype("<f4", copy=False)
        self.chan.send(
            {
                "ev": "vectors",
                "rid": rid,
                "n": int(vectors.shape[0]),
                "dim": int(vectors.shape[1]),
                "data": base64.b64encode(vectors.tobytes()).decode("ascii"),
            }
        )
        total = time.monotonic() - t0
        return {
            "ev": "done",
            "rid": rid,
            "finish_reason": "stop",
            "prompt_tokens": sum(len(ids) for ids in inputs),
            "completion_tokens": 0,
            "timings": {"prefill_s": round(total, 6), "total_s": round(total, 6)},
        }
