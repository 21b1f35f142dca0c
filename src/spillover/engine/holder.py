"""What an embeddings or transcription worker keeps loaded between requests: its readiness.

A chat worker's ``Engine`` holds a model and a llama context per slot. A unary kind
(embeddings: an ONNX Runtime session; transcription: a CTranslate2 Whisper model) holds one
model that every slot shares and nothing per request, so its readiness has two states.

Rules:

1. ``warm`` and ``mmap`` keep the model loaded: with no per-request context they keep the
   same thing. ``on_demand`` keeps nothing; the model is loaded by the first request that
   needs it (``use``) and then kept, as a chat engine keeps it.
2. Its step timings are the chat engine's: ``load_ms`` (the model load, re-measured at every
   real load), ``ctx_ms`` (0: there is no context to open) and ``first_ms`` (a tiny request on
   a freshly loaded model, the probe, timed once at start: ``measure``).
3. ``set_readiness`` moves to a mode: ``warm``/``mmap`` load the model now when it is not
   loaded; ``on_demand`` drops it at once when no request uses it, else when the last one
   ends (no request loses its model mid-way).
4. Every change of what it holds is reported through ``on_change``, under the lock, so
   reports leave in the order of the changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["MODES", "ModelHolder", "check_mode", "held_report"]

MODES = ("warm", "mmap", "on_demand")  # what a worker keeps ready between requests


def check_mode(mode: str) -> str:
    """``mode`` when it is a worker readiness mode, else ValueError."""
    if mode not in MODES:
        raise ValueError(f"readiness must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def held_report(mode: str, model: bool, contexts: int, timings: dict[str, float]) -> dict[str, Any]:
    """A worker's ``held`` report (``engine.worker``): its mode, whether the model is loaded,
    its open contexts and the latest step timings (ms)."""
    return {"mode": mode, "model": model, "contexts": contexts, "timings": {k: round(v, 3) for k, v in timings.items()}}


class ModelHolder:
    """One shared model, loaded by ``load`` and probed by ``probe``, kept as ``readiness`` says."""

    def __init__(
        self,
        load: Callable[[], Any],
        probe: Callable[[Any], None],
        *,
        readiness: str = "warm",
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._load = load
        self._probe = probe
        self.readiness = check_mode(readiness)
        self.timings: dict[str, float] = {}  # load_ms, ctx_ms, first_ms: the latest of each
        self._on_change = on_change
        self._model: Any = None
        self._users = 0  # requests using the model now
        self._shed_asked = False  # on_demand was asked while requests used the model: it goes after them
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<ModelHolder {self.readiness} loaded={self.loaded} users={self._users}>"

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def held(self) -> dict[str, Any]:
        """What it holds now and what each step last cost (the worker's ``held`` report)."""
        with self._lock:
            return held_report(self.readiness, self.loaded, 0, self.timings)

    def _loaded_model(self) -> Any:
        """The model, loaded now when it is not (timed: ``load_ms``); the caller holds the lock."""
        if self._model is None:
            t0 = time.perf_counter()
            self._model = self._load()
            self.timings["load_ms"] = (time.perf_counter() - t0) * 1000
            self.timings.setdefault("ctx_ms", 0.0)
        return self._model

    def measure(self) -> None:
        """Rule 2: load and probe once (timing both), then hold what the mode keeps."""
        with self._lock:
            model = self._loaded_model()
            t0 = time.perf_counter()
            self._probe(model)
            self.timings["first_ms"] = (time.perf_counter() - t0) * 1000
            self._settle()
            self._on_change()

    def start(self) -> None:
        """Without a probe: load the model now unless the mode is ``on_demand``."""
        with self._lock:
            self._settle()
            self._on_change()

    def _settle(self) -> None:
        if self.readiness != "on_demand":
            self._loaded_model()
        elif self._users == 0:
            self._model = None

    def set_readiness(self, mode: str) -> None:
        """Rule 3."""
        with self._lock:
            self.readiness = check_mode(mode)
            self._shed_asked = mode == "on_demand" and self._users > 0
            self._settle()
            self._on_change()

    @contextmanager
    def use(self) -> Iterator[Any]:
        """The model for one request, loaded first when it is not (rule 1)."""
        with self._lock:
            was = self.loaded
            model = self._loaded_model()
            self._users += 1
            if not was:
                self._on_change()
        try:
            yield model
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._shed_asked:
                    self._shed_asked = False
                    self._model = None
                    self._on_change()
