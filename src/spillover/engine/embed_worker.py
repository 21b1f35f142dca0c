"""The embeddings worker: one ONNX Runtime encoder session serving ``embed`` ops.

Gateway -> worker::

    {"op": "embed", "rid", "inputs": [[id, ...], ...], "batch_size", "reserve_bytes"}

Worker -> gateway (besides ``ready``, ``pong`` and ``fatal``, as for chat)::

    {"ev": "started", "rid"}                   its device memory is granted
    {"ev": "progress", "rid", "done"}          a chunk is done and more follow (``done`` inputs so far)
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

import argparse
import base64
import time
from typing import Any

from spillover.engine.worker import Channel, UnaryWorker, _error

__all__ = ["EmbedWorker"]


class EmbedWorker(UnaryWorker):
    """An embeddings worker (``--kind embeddings``). A cancel stops its request inside the
    encoder run (ONNX Runtime's ``RunOptions.terminate``), not at the next chunk: a chunk of
    long inputs can take longer than the gateway waits for a cancelled request's end, after
    which it takes the worker for hung."""

    request_op = "embed"

    def __init__(self, args: argparse.Namespace, chan: Channel) -> None:
        super().__init__(args, chan)
        self._stops: dict[str, Any] = {}  # each running request's RunOptions, by id (under ``_active_lock``)

    def stop_now(self, rid: str) -> None:
        if (run_options := self._stops.get(rid)) is not None:
            run_options.terminate = True

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
        import onnxruntime as ort  # type: ignore[import-untyped]

        from spillover.engine.embedder import chunks

        inputs = [[int(t) for t in ids] for ids in msg["inputs"]]
        batch_size = max(1, int(msg.get("batch_size") or self.args.batch_size))
        self.chan.send({"ev": "started", "rid": rid})
        t0 = time.monotonic()
        parts = []
        run_options = ort.RunOptions()
        with self._active_lock:
            self._stops[rid] = run_options
        try:
            for start, stop in chunks(inputs, batch_size):
                if (end := self.between_steps(rid, "encoder")) is not None:
                    return end
                try:
                    parts.append(model.embed(inputs[start:stop], batch_size, run_options))
                except Exception:
                    if rid in self.cancelled:  # stopped inside the run (``stop_now``)
                        return _error(rid, "cancelled", "cancelled")
                    raise
                self.progress += stop - start
                if stop < len(inputs):  # the gateway's stall bound covers one chunk at a time
                    self.chan.send({"ev": "progress", "rid": rid, "done": stop})
        finally:
            with self._active_lock:
                self._stops.pop(rid, None)
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
