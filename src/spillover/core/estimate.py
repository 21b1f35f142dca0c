""" "Will it fit?": a model's device and host bytes by component, for ``spillover estimate``.

Given a model's ``ModelSpec`` and llama.cpp's context settings, the estimate splits what
llama.cpp will allocate into weights, KV cache, compute buffer and output buffer, on the
device and on the host, plus spillover's margin (the admission's fragmentation allowance,
kept apart: ``total_bytes`` is what llama.cpp allocates, ``total_with_margin_bytes`` is what
admission would need free).

Placement follows one of two rule sets:

- ``cpu`` (a llama.cpp build without a GPU backend, as on this machine; the ``sim`` device
  runs this build too): everything is in host memory, the weights as the CPU backend holds
  them (mapped file span plus repacked copies, ``ModelSpec.cpu_model_bytes``).
- ``gpu`` (llama.cpp's offload rules, ``n_gpu_layers = L``): the last ``min(L, n_layers)``
  layers and their KV cache are on the device; the output layer is on the device only when
  ``L > n_layers``; the input embeddings always stay on the host. The compute buffer's
  logits part goes with the output layer, and each side that holds layers also needs the
  attention/feed-forward part. Tensors count their file bytes. These rules are llama.cpp's
  with ``op_offload`` off, as every context spillover makes runs (``engine.llamacpp.
  OP_OFFLOAD``: with it on, host weights' large-batch products would run on the device);
  the CUDA buffers themselves were not measured here (no GPU was available).

The compute buffer is either llama.cpp's own planned figure (``engine.plan``, exact on the
build at hand) or the memory model's envelope (an upper bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from spillover.core.memory import MemoryModel, ModelSpec, layer_shares

__all__ = ["PLACEMENTS", "ContextFit", "Estimate", "Parts", "estimate", "largest_context", "largest_gpu_layers"]

PLACEMENTS = ("cpu", "gpu")
ComputeFn = Callable[[int], int]  # n_ctx -> the whole compute buffer in bytes


@dataclass(frozen=True)
class Parts:
    """Bytes on one side (device or host), by component."""

    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    output_bytes: int = 0
    margin_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """What llama.cpp allocates here (the margin is not an allocation)."""
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes

    @property
    def total_with_margin_bytes(self) -> int:
        return self.total_bytes + self.margin_bytes

    def as_dict(self) -> dict[str, int]:
        return {
            **asdict(self),
            "total_bytes": self.total_bytes,
            "total_with_margin_bytes": self.total_with_margin_bytes,
        }


@dataclass(frozen=True)
class Estimate:
    """A model's predicted bytes for one context and placement."""

    n_ctx: int
    cells: int
    n_batch: int
    n_ubatch: int
    kv_type: str
    flash_attn: bool
    placement: str
    gpu_layers: int  # llama.cpp's n_gpu_layers as placed (0..n_layers+1)
    n_layers: int
    device: Parts
    host: Parts
    compute_source: str

    @property
    def total_bytes(self) -> int:
        return self.device.total_bytes + self.host.total_bytes

    @property
    def total_with_margin_bytes(self) -> int:
        return self.device.total_with_margin_bytes + self.host.total_with_margin_bytes

    def components(self) -> dict[str, int]:
        """Device plus host, by component."""
        d, h = self.device, self.host
        return {
            "weights_bytes": d.weights_bytes + h.weights_bytes,
            "kv_bytes": d.kv_bytes + h.kv_bytes,
            "compute_bytes": d.compute_bytes + h.compute_bytes,
            "output_bytes": d.output_bytes + h.output_bytes,
            "margin_bytes": d.margin_bytes + h.margin_bytes,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "n_ctx": self.n_ctx,
            "cells": self.cells,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "kv_type": self.kv_type,
            "flash_attn": self.flash_attn,
            "placement": self.placement,
            "gpu_layers": self.gpu_layers,
            "n_layers": self.n_layers,
            "compute_source": self.compute_source,
            "total_bytes": self.total_bytes,
            "total_with_margin_bytes": self.total_with_margin_bytes,
            "components": self.components(),
            "device": self.device.as_dict(),
            "host": self.host.as_dict(),
        }


def _margin(parts: Parts, ratio: float) -> Parts:
    return replace(parts, margin_bytes=int((parts.kv_bytes + parts.compute_bytes + parts.output_bytes) * ratio))


def estimate(
    spec: ModelSpec,
    n_ctx: int,
    *,
    n_batch: int = 512,
    n_ubatch: int = 512,
    kv_type: str = "f16",
    flash_attn: bool = False,
    placement: str = "cpu",
    gpu_layers: int = -1,
    margin_ratio: float = 0.02,
    compute: ComputeFn | None = None,
) -> Estimate:
    """Device and host bytes for a context of ``n_ctx`` tokens (see the module docstring).

    ``compute`` gives the whole compute buffer for a context (llama.cpp's plan); without it
    the memory model's envelope is used. Raises ``ValueError`` for settings llama.cpp refuses.
    """
    if n_ctx < 1:
        raise ValueError("the context must be at least 1 token")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
    model = MemoryModel(
        spec, kv_type=kv_type, n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=flash_attn, cpu_repack=True
    )
    whole = compute(n_ctx) if compute is not None else model.compute_bytes(n_ctx)
    source = "llama.cpp plan" if compute is not None else "memory model envelope"
    kv_layers = model.layer_kv_bytes(n_ctx)  # each layer's KV (and a hybrid's recurrent state)
    out = model.output_bytes()

    def made(where: str, gpu_layers: int, device: Parts, host: Parts) -> Estimate:
        return Estimate(
            n_ctx=n_ctx,
            cells=model.cells(n_ctx),
            n_batch=min(n_batch, n_ctx),
            n_ubatch=model.ubatch(n_ctx),
            kv_type=kv_type,
            flash_attn=flash_attn,
            placement=where,
            gpu_layers=gpu_layers,
            n_layers=spec.n_layers,
            device=_margin(device, margin_ratio),
            host=_margin(host, margin_ratio),
            compute_source=source,
        )

    if placement == "cpu":
        return made("cpu", 0, Parts(), Parts(model.weights_bytes(), sum(kv_layers), whole, out))
    n = spec.n_layers
    placed = n + 1 if gpu_layers < 0 else min(gpu_layers, n + 1)
    on_device = min(placed, n)
    output_on_device = placed > n
    sizes = layer_shares(spec.layer_sizes, spec.layer_bytes, n)
    device_layers = sum(sizes[n - on_device :])
    # The host's layers are run by the CPU backend: its repacked copies are held beside the
    # mapped file (cpu_model_bytes' rule, layer by layer); a device holds the file's bytes.
    repacks = layer_shares(spec.layer_repack_sizes, spec.repack_bytes, n)
    host_layers = sum(sizes[: n - on_device]) + sum(repacks[: n - on_device])
    # A tied output is a second copy of token_embd only when it sits on another device.
    head = spec.output_layer_bytes
    host_head = head - spec.input_bytes if spec.tied_output else head
    layer_part = model.layers_compute_bytes(n_ctx)
    if compute is not None and 0 < placed <= n:  # the device's part of a split is the envelope's share
        source = f"{source} on the host; the device's share of the layers from the memory model envelope"
    device_compute = whole if output_on_device else layer_part if on_device else 0
    host_compute = whole if not output_on_device else layer_part if on_device < n else 0
    device = Parts(
        device_layers + (head if output_on_device else 0),
        sum(kv_layers[n - on_device :]),
        device_compute,
        out if output_on_device else 0,
    )
    host_weights = host_layers + spec.input_bytes + (0 if output_on_device else host_head + spec.output_repack_bytes)
    if placed == 0 and spec.cpu_model_bytes:  # nothing offloaded: the CPU backend's own figure
        host_weights = spec.cpu_model_bytes
    host = Parts(
        host_weights,
        sum(kv_layers[: n - on_device]),
        host_compute,
        0 if output_on_device else out,
    )
    return made("gpu", placed, device, host)


@dataclass(frozen=True)
class ContextFit:
    """The fit search's answer: the largest context that fits (0: none), and the contexts
    shorter than it that do not (``gaps``: inclusive ``(first, last)`` ranges), found in the
    first ``scanned_cells`` cells, where every cell was asked."""

    largest: int
    gaps: tuple[tuple[int, int], ...] = ()
    scanned_cells: int = 0


def largest_context(
    fits: Callable[[int], bool],
    *,
    limit: int,
    step: int = 256,
    floor_fits: Callable[[int], bool] | None = None,
    scan_cells: int = 0,
    prefetch: Callable[[list[int]], bool] | None = None,
    clamped_below: int = 0,
) -> ContextFit:
    """The largest context up to ``limit`` for which ``fits`` holds. llama.cpp pads a context
    to whole ``step``-token cells, so the search takes whole cells first (``fits`` is asked at
    the cells a context ends in, the most any context in them costs), then the contexts inside
    the next cell: they cost that cell's KV, which did not fit, but a context shorter than the
    micro-batch (``clamped_below``) clamps it (``MemoryModel.ubatch``), and a smaller compute
    buffer can make one of them fit (a 100 MiB device runs SmolLM2 at a context of 10, not at
    256), and where the micro-batch spans several cells a context in a later one can fit where
    neither whole cell around it does (each such cell's shortest context is asked). A limit
    between two whole cells (a training context of 1100) ends in a part of a cell, asked too:
    its contexts cost the next cell's bytes, which can fit where the whole cell below does not
    (see next).

    llama.cpp's planned compute buffer does not always grow with the context (its graph
    allocator reuses memory by the sizes of the tensors, and which tensor sets the peak changes:
    SmolLM2 with a q8_0 cache plans 3.3 MB less at 1280 cells than at 1024), so the bytes can
    fall from one cell to the next, and a binary search could miss a context that fits, or
    name one past contexts that do not. ``floor_fits`` (monotone: the bytes without the compute
    buffer) bounds the cells that can fit; the first ``scan_cells`` of those are each asked
    (every context that fits there is found, and the ones below the answer that do not are
    ``gaps``), and a binary search takes the cells past them, where the buffer grows with the
    context. Without ``floor_fits``, ``fits`` is taken as monotone (the envelope's bytes are).
    ``prefetch`` is told the contexts that will each be asked, before they are; when it says
    they cannot be (False: no plan for one of them), the search is binary throughout."""
    top = max(0, limit // step)
    bound = top if floor_fits is None else _last_true(lambda n: floor_fits(n * step), 0, top)
    scanned = min(bound, scan_cells)
    if scanned and prefetch is not None and not prefetch([n * step for n in range(1, scanned + 1)]):
        scanned = 0
    above = _last_true(lambda n: fits(n * step), scanned, bound)
    ok = [fits(n * step) for n in range(1, scanned + 1)]
    cells = above if above > scanned else max((n for n, good in enumerate(ok, 1) if good), default=0)
    # Inside the next cell (or up to a limit between two whole cells, a training context of 1000).
    found = _last_true(fits, cells * step, min((cells + 1) * step - 1, limit))
    partial = limit > top * step and cells < top and (floor_fits is None or floor_fits(limit))
    if partial and (tail := _last_true(fits, top * step, limit)) > top * step:  # the part of a cell at the limit
        found = tail
    # Further cells whose shorter contexts clamp the micro-batch (round 84: SmolLM2 with a
    # micro-batch of 2048 fits 1032 where neither 1024 nor 1280 does): each cell's shortest
    # context is asked (they grow within a cell), and the cell searched where it fits.
    last = min(-(-clamped_below // step), -(-limit // step))
    firsts = [(c - 1) * step + 1 for c in range(cells + 2, last + 1)]
    if floor_fits is not None:  # the cell's KV, which its every context holds, fits (monotone)
        firsts = [n for n in firsts if floor_fits(min(n - 1 + step, limit))]
    if not scanned:  # bytes that grow steadily (the envelope), or a plan not every cell has: none fit there
        firsts = []
    if firsts and prefetch is not None:
        prefetch(firsts)
    for first in firsts:
        if fits(first):
            found = max(found, _last_true(fits, first, min(first - 1 + step, limit)))
    below = -(-found // step)  # the cell the answer is in: the gaps are below it
    gaps: list[tuple[int, int]] = []
    for n, good in enumerate(ok[: max(0, below - 1)], 1):
        if good:
            continue
        first = (n - 1) * step + 1
        if first < clamped_below:  # a shorter context clamps the micro-batch: some of the cell may fit
            first = _last_true(fits, first - 1, n * step) + 1
        if gaps and gaps[-1][1] == first - 1:  # the cell after a gap's: one range
            gaps[-1] = (gaps[-1][0], n * step)
        else:
            gaps.append((first, n * step))
    return ContextFit(found, tuple(gaps), scanned)


def largest_gpu_layers(fits: Callable[[int], bool], n_layers: int) -> int:
    """The largest ``n_gpu_layers`` (0..n_layers+1) for which ``fits`` holds, -1 if none.
    All of them (``n_layers + 1``, the output layer too) is asked first: the device's bytes
    grow with the repeating layers, but not always from ``n_layers`` to all (the compute
    buffer's share of every repeating layer can pass the whole graph's planned buffer, which
    only all gets). Below that, a binary search, since each estimate sums over the layers."""
    if fits(n_layers + 1):
        return n_layers + 1
    return _last_true(fits, -1, n_layers)


def _last_true(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Binary search: the largest ``n`` in ``(lo, hi]`` for which ``fits`` holds, else ``lo``
    (``fits`` monotone: true up to a point, false after; ``lo`` itself is not asked)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
