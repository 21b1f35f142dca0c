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
5. A dropped model's memory goes back to the system: the allocator's free pages are returned
   (glibc ``malloc_trim``), else the process would keep most of it and the host-RAM guard,
   which stops counting the model, would be wrong (measured: 70 MiB of a 125 MiB process
   kept after an embeddings model was dropped, 60 MiB of it returned by the trim).
6. ``load_soon`` starts a load on a thread of its own and returns at once, so a request that
   waits for its model can still see its cancel (the worker answers it at once; the load
   finishes and is kept).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

__all__ = ["MODES", "ModelHolder", "check_mode", "held_report"]

MODES = ("warm", "mmap", "on_demand")  # what a worker keeps ready between requests


def check_mode(mode: str) -> str:
    """``mode`` when it is a worker readiness mode, else ValueError."""
    if mode not in MODES:
        raise ValueError(f"readiness must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def release_memory() -> None:
    """Rule 5: collect, then hand the allocator's free pages back (glibc only; else a no-op)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        ctypes.CDLL(name).malloc_trim(0)


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
        self._loading: Future[Any] | None = None  # a load_soon in flight
        self._loading_lock = threading.Lock()  # for ``_loading`` alone: a load holds ``_lock`` throughout

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

    def _load_reported(self) -> Any:
        """The model, loaded now when it is not and the load reported (the caller holds the lock)."""
        was = self.loaded
        model = self._loaded_model()
        if not was:
            self._on_change()
        return model

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
            self._drop()

    def _drop(self) -> None:
        """Drop the model (the caller holds the lock) and give its memory back (rule 5)."""
        if self._model is not None:
            self._model = None
            release_memory()

    def load_soon(self) -> Future[Any]:
        """Rule 6: a future that is done once the model is loaded (at once when it is)."""
        with self._loading_lock:  # never waits for a load in flight (``_lock`` is held through it)
            if self._loading is not None:
                return self._loading
            done: Future[Any] = Future()
            if self.loaded:
                done.set_result(None)
                return done
            self._loading = done

        def load() -> None:
            try:
                with self._lock:
                    self._load_reported()
            except BaseException as exc:  # the request that waits for it fails with it
                failed: BaseException | None = exc
            else:
                failed = None
            with self._loading_lock:
                self._loading = None
            if failed is not None:
                done.set_exception(failed)
            else:
                done.set_result(None)

        threading.Thread(target=load, name="model-load", daemon=True).start()
        return done

    def set_readiness(self, mode: str) -> None:
        """Rule 3."""
        with self._lock:
            self.readiness = check_mode(mode)
            self._shed_asked = mode == "on_demand" and self._users > 0
            self._settle()
            self._on_change()

    @contextlib.contextmanager
    def use(self) -> Iterator[Any]:
        """The model for one request, loaded first when it is not (rule 1)."""
        with self._lock:
            model = self._load_reported()
            self._users += 1
        try:
            yield model
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._shed_asked:
                    self._shed_asked = False
                    self._drop()
                    self._on_change()
