"""llama.cpp through llama-cpp-python: loading, chat templates, tokenizing and generating.

One ``Engine`` holds one model; each slot is its own llama context (weights are mmap'ed,
so slots share them). The gateway uses a vocab-only ``Tokenizer`` to count prompt tokens
before admission, so both workers see the very same token ids.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillover.engine.textstream import StopScanner

__all__ = ["Engine", "GenerateParams", "Step", "Tokenizer", "fingerprint_parts"]


def _llama_cls() -> Any:
    import llama_cpp

    return llama_cpp.Llama


class Tokenizer:
    """Vocab-only view of a GGUF: chat template, tokenize, special tokens."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._llm = _llama_cls()(model_path=model_path, vocab_only=True, verbose=False)
        meta: dict[str, str] = dict(self._llm.metadata)
        self.metadata = meta
        self.chat_template = meta.get("tokenizer.chat_template", "")
        arch = meta.get("general.architecture", "llama")
        self.n_ctx_train = int(meta.get(f"{arch}.context_length", "2048"))
        self._lock = threading.Lock()
        eos_id = self._llm.token_eos()
        bos_id = self._llm.token_bos()
        self.eos_token = self._piece(eos_id) if eos_id >= 0 else ""
        self.bos_token = self._piece(bos_id) if bos_id >= 0 else ""

    def _piece(self, token_id: int) -> str:
        return bytes(self._llm.detokenize([token_id], special=True)).decode("utf-8", "replace")

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """Apply the model's own chat template (Jinja2, sandboxed)."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        if not self.chat_template:
            return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
        fmt = Jinja2ChatFormatter(template=self.chat_template, eos_token=self.eos_token, bos_token=self.bos_token)
        result = fmt(messages=messages, tools=tools)  # type: ignore[arg-type]
        return str(result.prompt)

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids for ``text`` (BOS added when the model asks for it)."""
        with self._lock:
            return list(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=special))

    def vocab_digest(self) -> str:
        """A hash of the whole vocabulary (token pieces in id order)."""
        h = hashlib.sha256()
        n = self._llm.n_vocab()
        for i in range(n):
            h.update(bytes(self._llm.detokenize([i], special=True)))
            h.update(b"\0")
        return h.hexdigest()


def file_digest(path: str, cache_dir: Path | None = None) -> str:
    """sha256 of a model file, cached by (path, size, mtime) in ``cache_dir``."""
    p = Path(path)
    st = p.stat()
    key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cache = cache_dir / f"digest-{key}.txt" if cache_dir else None
    if cache is not None and cache.is_file():
        return cache.read_text().strip()
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(digest)
    return digest


def fingerprint_parts(
    model_path: str, tok: Tokenizer, backend: str, cache_dir: Path | None, n_batch: int = 512
) -> dict[str, str]:
    """The compatibility and numerics parts of a worker's fingerprint."""
    import llama_cpp

    compat = {
        "model_sha256": file_digest(model_path, cache_dir),
        "vocab_sha256": tok.vocab_digest(),
        "chat_template_sha256": hashlib.sha256(tok.chat_template.encode()).hexdigest(),
        "quantization": tok.metadata.get("general.file_type", ""),
    }
    numerics = {
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "backend": backend,
        "n_batch": str(n_batch),
    }
    return {
        "compat": hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16],
        "numerics": hashlib.sha256(json.dumps(numerics, sort_keys=True).encode()).hexdigest()[:16],
        **compat,
        **numerics,
    }


@dataclass(frozen=True)
class GenerateParams:
    """Sampling parameters of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    json_schema: str | None = None


@dataclass(frozen=True)
class Step:
    """One generated token and the text it releases."""

    token_id: int
    text: str


class Engine:
    """A loaded model with up to ``slots`` independent llama contexts.

    With ``lazy`` a slot's context is created on its first use and then kept, so host
    memory grows with the concurrency actually reached (the CPU lane's host-RAM guard
    decides how far); free slots that already have a context are handed out first.
    """

    def __init__(
        self,
        model_path: str,
        *,
        slots: int,
        n_ctx: int,
        n_threads: int,
        n_batch: int,
        n_gpu_layers: int = 0,
        lazy: bool = False,
    ) -> None:
        self.model_path = model_path
        self.n_ctx = n_ctx
        self._params = {
            "model_path": model_path,
            "n_ctx": n_ctx,
            "n_threads": n_threads,
            "n_threads_batch": n_threads,
            "n_batch": n_batch,
            "n_gpu_layers": n_gpu_layers,
            "verbose": False,
        }
        self._slots: list[Any] = [None] * slots
        if not lazy:
            self._slots = [self._create() for _ in range(slots)]
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def _create(self) -> Any:
        return _llama_cls()(**self._params)

    @property
    def slots(self) -> int:
        """Number of slots."""
        return len(self._slots)

    @property
    def contexts(self) -> int:
        """Slots whose llama context exists."""
        return sum(1 for s in self._slots if s is not None)

    def acquire_slot(self) -> int | None:
        """Take a free slot index (one with a context first), or None."""
        with self._lock:
            if not self._free:
                return None
            ready = [i for i in self._free if self._slots[i] is not None]
            pick = ready[0] if ready else self._free[0]
            self._free.remove(pick)
            return pick

    def release_slot(self, slot: int) -> None:
        """Give a slot back."""
        with self._lock:
            self._free.append(slot)

    def generate(
        self,
        slot: int,
        prompt_tokens: list[int],
        params: GenerateParams,
        *,
        kv_tokens: int,
        should_stop: Callable[[], bool],
        prefix: list[int] | None = None,
    ) -> Iterator[Step | str]:
        """Yield ``Step`` per new token, then the finish reason.

        Finish reasons: ``stop`` | ``length`` | ``cancelled`` | ``diverged``.

        ``prefix`` continues a generation whose first tokens were already delivered: the
        prompt is evaluated exactly as in an uninterrupted run (one batched eval), then
        each prefix token alone, as the original decode did. At each step the greedy
        choice is checked against the delivered token; any difference ends with
        ``diverged`` before a single new token is produced. Only greedy requests may be
        continued (the gateway checks).
        """
        import llama_cpp
        import numpy as np

        if self._slots[slot] is None:
            self._slots[slot] = self._create()
        llm = self._slots[slot]
        prefix = list(prefix or [])
        limit = min(kv_tokens, self.n_ctx)
        budget = min(params.max_tokens, limit - len(prompt_tokens))
        if budget <= len(prefix):
            yield "length"
            return
        grammar = (
            llama_cpp.LlamaGrammar.from_json_schema(params.json_schema, verbose=False)  # type: ignore[attr-defined]
            if params.json_schema
            else None
        )
        llm.reset()  # no KV prefix reuse: it made seeded sampling irreproducible
        llm.set_seed(params.seed)
        greedy = params.temperature <= 0
        scanner = StopScanner(stops=params.stop)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        history: list[int] = list(prompt_tokens)
        start = prompt_tokens
        if prefix:
            llm.eval(prompt_tokens)
            n_vocab = llm.n_vocab()
            for i, tok in enumerate(prefix):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
                if int(np.argmax(logits)) != tok:
                    yield "diverged"
                    return
                scanner.feed(bytes(llm.detokenize([tok], prev_tokens=history, special=False)))
                history.append(tok)
                if i < len(prefix) - 1:
                    llm.eval([tok])
            start = [prefix[-1]]
        produced = len(prefix)
        gen = llm.generate(
            start,
            top_k=1 if greedy else 0,
            top_p=1.0 if greedy else params.top_p,
            min_p=0.0,
            typical_p=1.0,
            temp=0.0 if greedy else params.temperature,
            repeat_penalty=1.0,
            reset=not prefix,
            grammar=grammar,
        )
        try:
            for token in gen:
                if should_stop():
                    yield "cancelled"
                    return
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    tail = scanner.finish()
                    if tail:
                        yield Step(-1, tail)
                    yield "stop"
                    return
                piece = bytes(llm.detokenize([token], prev_tokens=history, special=False))
                history.append(token)
                produced += 1
                text = scanner.feed(piece)
                yield Step(token, text)
                if scanner.stopped:
                    yield "stop"
                    return
                if produced >= budget:
                    tail = scanner.finish()
                    if tail:
                        yield Step(-1, tail)
                    yield "length"
                    return
        finally:
            gen.close()
