"""Ask llama.cpp itself what compute buffer a context would need, without loading weights.

llama.cpp sizes its compute buffer by reserving the worst-case graph (a full micro-batch)
with ggml's graph allocator; how much the allocator's free list fragments depends on the
order and sizes of every tensor in the graph, so arithmetic on the model's shape can only
bound it (``core.memory.MemoryModel.compute_bytes``, an envelope). A dry run gives the exact
figure: the model is opened with ``no_alloc`` and ``load_mode = none`` (metadata only, no
tensor is read or allocated), a context is created, and llama.cpp logs the compute buffer
it would allocate. It takes a fraction of a second. Its memory is the metadata and the KV
cache's bookkeeping, which llama.cpp keeps for every cell of the context: tens of bytes a
cell (here a context of 10 million tokens took 0.6 GB, one of a billion 20 GB and 49 s before
llama.cpp gave up with ``bad_alloc``). So no dry run is made for a context of more than
``PLAN_CELLS_MAX`` cells: there the buffer grows by the same bytes a cell (the tensors sized
by the cache), so ``spillover estimate`` extends the plans at half that and at that in a
straight line, which gave llama.cpp's own figure to the byte at twice the bound.

It plans for the backends this llama.cpp build has (the CPU backend here; on a CUDA build
the device's buffers too, which this machine cannot check). ``None`` comes back when
llama.cpp cannot plan the file (an architecture this build does not know, say); callers
then use the model's envelope. ``PlanRefused`` is raised when the model loads but llama.cpp
refuses the context settings, with llama.cpp's own reason.

llama.cpp aborts the process on some malformed models (a failed ``GGML_ASSERT``), so
``plan_buffers_isolated`` runs the dry run in a forked child and reports a crash as ``None``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spillover.engine.calibrate import COMPUTE_LINE, OUTPUT_LINE, by_buffer, ggml_type
from spillover.engine.llamacpp import OP_OFFLOAD, load_llama_cpp

__all__ = [
    "PLAN_CELLS_MAX",
    "PlanRefused",
    "PlannedBuffers",
    "plan_buffers",
    "plan_buffers_isolated",
    "plan_buffers_many",
    "plan_buffers_many_isolated",
]

PLAN_CELLS_MAX = 2**22  # the largest context (in cells) a dry run is made for: about 70 MB of bookkeeping here

_LOCK = threading.Lock()  # llama.cpp's log callback is process-wide


@dataclass(frozen=True)
class PlannedBuffers:
    """Compute and output buffer bytes llama.cpp planned, by backend buffer name."""

    compute: dict[str, int]
    output: dict[str, int]

    @property
    def compute_bytes(self) -> int:
        return sum(self.compute.values())

    @property
    def output_bytes(self) -> int:
        return sum(self.output.values())


class PlanRefused(ValueError):
    """llama.cpp loaded the model but refused to create a context with these settings, or it
    cannot load the file because the file is damaged (``DAMAGED``): no plan can be made."""


# llama.cpp's load errors that say the file itself is wrong, for any build: its tensors against
# its own metadata, a key its architecture needs missing or of the wrong type or length, no
# vocabulary, no architecture at all. Its other load errors (an architecture or pre-tokenizer
# it does not know) say this build does not know the file, which a newer one may: the envelope
# answers those.
DAMAGED = (
    "check_tensor_dims", "wrong number of tensors", "not within the file bounds", "key not found in model",
    "has wrong type", "has wrong array length", "cannot find tokenizer vocab", "unknown model architecture: ''",
)  # fmt: skip


def plan_buffers(model_path: str, n_ctx: int, *args: Any, **kwargs: Any) -> PlannedBuffers | None:
    """llama.cpp's own compute and output buffer sizes for this context, from a dry run
    (``plan_buffers_many``'s settings: the batch sizes, ``kv_type``, ``flash_attn``,
    ``n_gpu_layers``, ``why``).

    The batch sizes are clamped as llama-cpp-python clamps them (``n_batch`` to the context,
    ``n_ubatch`` to ``n_batch``), so the plan is of the context the engine would create.
    When it returns None, ``why`` (when given) gets the reason, as a sentence.
    """
    plans = plan_buffers_many(model_path, [n_ctx], *args, **kwargs)
    return None if plans is None else plans[0]


def plan_buffers_many(
    model_path: str,
    n_ctxs: Sequence[int],
    n_batch: int = 512,
    n_ubatch: int = 512,
    *,
    kv_type: str = "f16",
    flash_attn: bool = False,
    n_gpu_layers: int = 0,
    why: list[str] | None = None,
) -> list[PlannedBuffers | None] | None:
    """``plan_buffers`` for each context of ``n_ctxs``, the model opened once (a context's
    dry run then takes milliseconds: the fit search asks every cell of a context's range).
    None when llama.cpp cannot load the file; an entry is None when llama.cpp reported no
    compute buffer for that context (``why`` says so); ``PlanRefused`` as ``plan_buffers``."""
    llama_cpp = load_llama_cpp()
    lines: list[tuple[int, str]] = []  # (ggml log level, text)

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append((level, text.decode("utf-8", "replace")))

    mp = llama_cpp.llama_model_default_params()
    mp.no_alloc = True
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    mp.n_gpu_layers = n_gpu_layers
    from llama_cpp import _logger

    plans: list[PlannedBuffers | None] = []
    with _LOCK:
        llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
        try:
            model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
            if not model:
                errors = _errors(lines) or "no reason given"
                if any(mark in errors for mark in DAMAGED):
                    raise PlanRefused(f"llama.cpp cannot load the file, it is damaged or inconsistent: {errors}")
                if why is not None:
                    why.append(f"this llama.cpp build cannot load the file ({errors})")
                return None
            try:
                for n_ctx in n_ctxs:
                    lines.clear()
                    batch = min(n_ctx, n_batch)
                    cp = llama_cpp.llama_context_default_params()
                    cp.n_ctx = n_ctx
                    cp.n_batch = batch
                    cp.n_ubatch = min(batch, n_ubatch)
                    cp.n_threads = cp.n_threads_batch = 1
                    cp.type_k = cp.type_v = ggml_type(kv_type)
                    cp.op_offload = OP_OFFLOAD  # as the engine's contexts run
                    cp.flash_attn_type = (
                        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                        if flash_attn
                        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
                    )
                    ctx = llama_cpp.llama_init_from_model(model, cp)
                    if not ctx:
                        raise PlanRefused(_reason(lines))
                    llama_cpp.llama_free(ctx)
                    text = "".join(t for _, t in lines)
                    compute = by_buffer(COMPUTE_LINE, text)
                    if not compute and why is not None:
                        why.append("llama.cpp reported no compute buffer for it")
                    plans.append(PlannedBuffers(compute, by_buffer(OUTPUT_LINE, text)) if compute else None)
            finally:
                llama_cpp.llama_model_free(model)
        finally:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    return plans


LOG_ERROR, LOG_CONT = 4, 5  # ggml_log_level: GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT


def _reason(lines: list[tuple[int, str]]) -> str:
    """Why llama.cpp refused the context: its last error lines, as one sentence."""
    text = _errors(lines) or "llama.cpp refused to create the context"
    return f"llama.cpp refuses these settings: {text}"


def _errors(lines: list[tuple[int, str]]) -> str:
    """llama.cpp's last error lines (logged at its error level, with their continuations),
    as one sentence ("" when none); its other lines are notes, whatever words they hold."""
    errors: list[str] = []
    last = 0
    for level, text in lines:
        if level == LOG_ERROR:
            errors.append(text.strip())
        elif level == LOG_CONT and last == LOG_ERROR and errors:
            errors[-1] = f"{errors[-1]} {text.strip()}"
        if level != LOG_CONT:
            last = level
    return "; ".join(e for e in errors[-2:] if e)


def plan_buffers_isolated(
    model_path: str, n_ctx: int, *args: Any, why: list[str] | None = None, **kwargs: Any
) -> PlannedBuffers | None:
    """``plan_buffers`` in a forked child, so that a llama.cpp abort ends the child only.

    Returns ``None`` when the child dies (by a signal or an exit status) or llama.cpp cannot
    plan, with the reason in ``why`` (when given); raises ``PlanRefused`` as ``plan_buffers`` does.
    """
    plans = plan_buffers_many_isolated(model_path, [n_ctx], *args, why=why, **kwargs)
    return None if plans is None else plans[0]


def plan_buffers_many_isolated(
    model_path: str, n_ctxs: Sequence[int], *args: Any, why: list[str] | None = None, **kwargs: Any
) -> list[PlannedBuffers | None] | None:
    """``plan_buffers_many`` in one forked child (``plan_buffers_isolated``'s rules): None when
    the child dies or llama.cpp cannot load the file."""
    import json
    import os

    if not n_ctxs:
        return []
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plan, write one JSON document, leave without cleanup
        os.close(read)
        # An abort's backtrace (ggml runs gdb, which writes to the inherited stdout as well as
        # stderr) is not the user's to read, and must not land in ``--json``'s one object.
        os.environ["GGML_NO_BACKTRACE"] = "1"
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        out: dict[str, Any]
        reasons: list[str] = []
        try:
            plans = plan_buffers_many(model_path, n_ctxs, *args, why=reasons, **kwargs)
            shown = None if plans is None else [None if p is None else [p.compute, p.output] for p in plans]
            out = {"plans": shown, "why": reasons}
        except PlanRefused as exc:
            out = {"refused": str(exc)}
        except BaseException as exc:  # anything else is "cannot plan"
            out = {"error": repr(exc), "why": [f"the dry run failed ({exc!r})"]}
        data = memoryview(json.dumps(out).encode())
        while data:
            data = data[os.write(write, data) :]
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if not chunks or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        if why is not None:
            why.append(
                "llama.cpp aborted planning it (one of its own checks failed: a damaged model, "
                "or one this build cannot run)"
            )
        return None
    out = json.loads(b"".join(chunks))
    if "refused" in out:
        raise PlanRefused(out["refused"])
    if why is not None:
        why.extend(out.get("why") or ([] if out.get("plans") else ["llama.cpp could not plan it"]))
    if out.get("plans") is None:
        return None
    return [None if p is None else PlannedBuffers(compute=p[0], output=p[1]) for p in out["plans"]]
