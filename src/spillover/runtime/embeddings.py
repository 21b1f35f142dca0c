"""The embeddings service: a ``runtime.service.DeviceService`` whose requests are lists of
wrapped token ids and whose answer is one ``Vectors`` event.

Rules (beside the service's own):

1. A request's device bytes are ``core.embed_memory``'s prediction for its input lengths
   and the service's batch size; its weights are the ONNX file's.
2. The same inputs give the same vectors on every worker (``engine.embedder`` rule 2), so
   a failover replays them whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spillover.core.embed_memory import EmbedMemoryModel
from spillover.engine.embedder import chunks
from spillover.errors import WorkerFailed
from spillover.runtime.events import Progress, RequestEvent, Vectors
from spillover.runtime.service import DeviceService, ServiceStatistics, StallSteps

if TYPE_CHECKING:
    from spillover.engine.embedder import EmbedModelInfo, EmbedTokenizer

__all__ = ["EmbedResult", "EmbeddingsService", "ServiceStatistics"]


ATTENTION_TOKENS = 64  # the padded length at which an encoder token costs twice a short one's (below)


def chunk_units(chunk: list[list[int]]) -> float:
    """What one encoder run of ``chunk`` costs, in units the GPU's measured rate times (the stall
    bound, ``runtime.service`` rule 3): its inputs, padded to the longest (``length``), times
    ``length * (1 + length / ATTENTION_TOKENS)``: a token's cost grows with the padded length
    (attention, activations). On the sim here (ONNX Runtime on a CPU thread): 100 us a token up
    to 64 tokens, 140 at 128, 190 at 256, 300 at 510, so a unit costs 35-80 us, the long ones
    least: a rate measured on short inputs over-counts long ones (a bound errs long)."""
    if not chunk:
        return 0.0
    length = max(len(ids) for ids in chunk)
    return len(chunk) * length * (1 + length / ATTENTION_TOKENS)


class _Chunks(StallSteps):
    """An embeddings request's steps: the worker says ``Progress`` after each chunk but the last."""

    def __init__(self, inputs: list[list[int]], size: int) -> None:
        super().__init__(chunk_units(inputs[:size]))
        self._inputs, self._size = inputs, size

    def after(self, ev: RequestEvent) -> None:
        if isinstance(ev, Progress):
            self.units = chunk_units(self._inputs[ev.done : ev.done + self._size])


@dataclass(frozen=True)
class EmbedResult:
    """A finished request's vectors and where they were computed."""

    data: bytes  # n x dim float32, little-endian
    n: int
    dim: int
    lane: str
    reason: str
    attempts: int
    prompt_tokens: int


class EmbeddingsService(DeviceService):
    """One ``[[services]]`` entry of kind ``embeddings``."""

    kind = "embeddings"
    op = "embed"

    info: EmbedModelInfo | None = None
    tokenizer: EmbedTokenizer | None = None
    memory: EmbedMemoryModel | None = None

    async def load_model(self) -> None:
        from spillover.engine.embedder import EmbedTokenizer, default_embed_model_dir, read_embed_model_info

        self.model_dir = self.cfg.path or await asyncio.to_thread(default_embed_model_dir)
        self.info = await asyncio.to_thread(read_embed_model_info, self.model_dir, self.name)
        self.tokenizer = await asyncio.to_thread(EmbedTokenizer, self.model_dir)
        self.memory = EmbedMemoryModel(self.info, fragmentation_ratio=self.gw.cfg.admission.fragmentation_ratio)

    def weights_bytes(self) -> int:
        return self.memory.weights_bytes() if self.memory else 0

    def probe_bytes(self) -> int:
        return self.memory.request_bytes([16], 1) if self.memory else 0

    def spec_fields(self) -> dict[str, Any]:
        return {"n_ctx": self.info.max_tokens if self.info else 512, "batch_size": self.cfg.batch_size}

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        assert self.tokenizer is not None
        return self.tokenizer.encode(texts)

    initial_stall_rate = 0.0005  # GPU seconds a unit (``chunk_units``) until measured: 5 times the sim's here
    stall_overhead_units = 64.0  # a request's fixed cost: about 3 ms on the sim here (a 1-input query's)

    def stall_units(self, msg: dict[str, Any], work: float) -> float:
        inputs, size = msg["inputs"], max(1, int(msg["batch_size"]))
        return sum(chunk_units(inputs[a:b]) for a, b in chunks(inputs, size))

    def stall_steps(self, msg: dict[str, Any], work: float) -> StallSteps:
        return _Chunks(msg["inputs"], max(1, int(msg["batch_size"])))

    def predicted_bytes(self, inputs: list[list[int]]) -> int:
        assert self.memory is not None
        return self.memory.request_bytes([len(ids) for ids in inputs], self.cfg.batch_size)

    async def embed(
        self,
        rid: str,
        inputs: list[list[int]],
        *,
        attempt: int,
        on_move: Callable[[str, dict[str, Any]], Awaitable[None]],
    ) -> EmbedResult:
        """Compute ``inputs`` (wrapped ids) on whichever lane takes them (the service's rules)."""
        got = await self.serve(
            rid,
            {"inputs": inputs, "batch_size": self.cfg.batch_size},
            nbytes=self.predicted_bytes(inputs),
            work=1.0,
            attempt=attempt,
            on_move=on_move,
        )
        vectors = next((p for p in got.parts if isinstance(p, Vectors)), None)
        if vectors is None:
            raise WorkerFailed(f"the {got.lane} worker ended without vectors", retry_after_s=1.0)
        prompt_tokens = sum(len(i) for i in inputs)
        return EmbedResult(vectors.data, vectors.n, vectors.dim, got.lane, got.reason, got.attempts, prompt_tokens)
