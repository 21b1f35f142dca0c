"""Execution profiles of a chat model on the device: ``gpu`` (resident: every layer on the
device), ``split`` (its last N layers on the device, the rest on the CPU: llama.cpp's
``n_gpu_layers``) and ``cpu`` (nothing on the device).

Rules:

1. A profile *fits* when its weights on the device plus ``slots`` requests at its context cap
   (each the memory model's request footprint: KV pages of its layers on the device for the
   cells llama.cpp creates for that context, padded to 256; the compute and output buffers
   that placement puts there; fragmentation) fit the device's usable bytes (capacity less
   margin). Admission reserves the same footprint for a request's own tokens (16-token
   pages), never more than this, so a planned profile is one admission can actually run; and
   it is ``spillover estimate --gpu-layers N``'s device total with margin (``core.estimate``'s
   placement rules: a split's device runs its layers' part of the graph; the logits and the
   output buffer stay with the output layer on the host).
2. The resident profile runs when one request at the GPU lane's cap fits beside its weights.
3. With a split worker configured, its N is the configured one, or (``-1``) the largest N in
   1..n_layers that fits with the split worker's own slots, cap and batch (``split_layers``):
   beside the resident's bytes when the resident fits (the split worker then serves what the
   resident cannot take: a request too long for its lane, no room beside its running
   requests, its worker down), in the whole device when it does not (the split worker then
   serves every device request: ``split``; its ``why`` gives the longest request the resident
   alone could take there, and the GPU lane's cap that keeps it resident). Configured layers
   that do not fit that room run no split worker (the plan's ``why`` says so): a worker that
   could never load is not started.
4. Without a split worker (none configured, or none fits), the resident runs (``gpu``) as
   long as the smallest context (one token: 256 KV cells, llama.cpp's padding) fits beside its
   weights: admission then sends what does not fit to the CPU, and the plan says up to about
   how many tokens fit. When not even that fits, the model runs on the CPU only (``cpu``): no
   resident worker would hold the weights on the device and never be admitted a request.
5. ``resident_tokens`` is the most tokens (prompt and answer) of one request the resident
   can ever hold: the GPU lane's cap when it fits, rule 4's longest request when only that
   fits, 0 when it does not run. It is the resident's context cap for admission (a longer
   request is too long for the GPU, and shrinks to it when allowed) and for the longest
   context the model serves (longer than every running lane's: a 400, not a 503 to retry).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spillover.core.memory import MemoryModel

__all__ = ["PROFILES", "ProfilePlan", "device_bytes", "plan_profile", "split_layers"]

PROFILES = ("gpu", "split", "cpu")
MIB = 1024 * 1024


@dataclass(frozen=True)
class ProfilePlan:
    """What runs on the device for one chat model, and why."""

    profile: str  # gpu | split | cpu
    resident_bytes: int  # weights + one request at the GPU lane's cap, all layers on the device
    split_layers: int  # layers the split worker puts on the device (0: no split worker)
    split_bytes: int  # its weights + its slots' requests at its cap (0: none)
    usable_bytes: int
    why: str
    resident_tokens: int = 0  # rule 5: the most tokens of one request the resident can hold (0: not running)

    def as_dict(self) -> dict[str, object]:
        return {
            "profile": self.profile,
            "resident_bytes": self.resident_bytes,
            "resident_tokens": self.resident_tokens,
            "split_layers": self.split_layers,
            "split_bytes": self.split_bytes,
            "usable_bytes": self.usable_bytes,
            "why": self.why,
        }


def device_bytes(model: MemoryModel, slots: int, ctx_tokens: int) -> int:
    """A placement's device bytes (rule 1): weights plus ``slots`` requests at ``ctx_tokens``,
    each at the KV cells llama.cpp creates for that context (padded to ``ctx_pad_tokens``: a
    cap of 1100 is 1280 cells, which counting 1100 tokens put 3 % under, and a layer past what
    ``spillover estimate`` plans)."""
    return model.weights_bytes() + slots * model.request_footprint(model.cells(ctx_tokens), 0).total_bytes


def _apart(a: int, b: int) -> tuple[str, str]:
    """Two byte counts in MiB with as few decimals as show them apart, else in bytes: a need
    one byte over the room must not read as equal to it (round 19: "needs 10 MiB, 10 MiB on
    the device" for 10,939,944 bytes over 10,485,760)."""
    for places in (0, 1, 2):
        x, y = f"{a / MIB:.{places}f} MiB", f"{b / MIB:.{places}f} MiB"
        if x != y or a == b:
            return x, y
    return f"{a:,} bytes", f"{b:,} bytes"


def _layers(n: int) -> str:
    return "1 layer" if n == 1 else f"{n} layers"


def split_layers(model: MemoryModel, slots: int, ctx_tokens: int, usable_bytes: int) -> int:
    """The largest N in 1..n_layers whose split fits ``usable_bytes`` (rule 3); 0 when none."""
    for n in range(model.spec.n_layers, 0, -1):
        if device_bytes(replace(model, n_gpu_layers=n), slots, ctx_tokens) <= usable_bytes:
            return n
    return 0


def plan_profile(
    resident: MemoryModel,
    *,
    gpu_ctx_tokens: int,
    usable_bytes: int,
    split: MemoryModel | None = None,
    split_slots: int = 1,
    split_ctx_tokens: int = 0,
    split_gpu_layers: int = -1,
) -> ProfilePlan:
    """The profile to run (rules 2-4). ``split`` is the split worker's memory model (its batch;
    any ``n_gpu_layers``), None when no split worker is configured."""
    need = device_bytes(resident, 1, gpu_ctx_tokens)
    resident_fits = need <= usable_bytes
    n, split_need, split_why = 0, 0, ""
    if split is not None:
        room = usable_bytes - need if resident_fits else usable_bytes
        where = "left beside the resident" if resident_fits else "on the device"
        if split_gpu_layers >= 0:
            n = min(split_gpu_layers, split.spec.n_layers)
        else:
            n = split_layers(split, split_slots, split_ctx_tokens, room)
        split_need = device_bytes(replace(split, n_gpu_layers=n), split_slots, split_ctx_tokens) if n > 0 else 0
        if n > 0 and split_need > room:  # configured layers that do not fit: no worker that could never load
            most = split_layers(split, split_slots, split_ctx_tokens, room)
            split_why = f"; the configured split of {_layers(n)} needs %s, %s {where}: no split worker" % _apart(
                split_need, max(0, room)
            ) + (f" ([split].gpu_layers = {most} would fit)" if most else "")
            n, split_need = 0, 0
        elif n == 0:  # what even one layer would need: its requests' share may be what does not fit
            one = device_bytes(replace(split, n_gpu_layers=1), split_slots, split_ctx_tokens)
            split_why = (
                f"; no split of it fits {where}: one layer with {split_slots} request(s) of "
                f"{split_ctx_tokens} tokens ([split] slots, ctx_cap_tokens) needs %s, %s {where}"
                % _apart(one, max(0, room))
            )
        elif resident_fits:
            split_why = f"; a split worker with {_layers(n)} beside it ({split_need / MIB:.0f} MiB)"
    if resident_fits:
        why = f"all layers and a {gpu_ctx_tokens}-token request need %s of %s" % _apart(need, usable_bytes)
        return ProfilePlan("gpu", need, n, split_need, usable_bytes, why + split_why, gpu_ctx_tokens)
    short = f"all layers and a {gpu_ctx_tokens}-token request need %s, the device has %s" % _apart(need, usable_bytes)
    if n > 0:
        of = split.spec.n_layers if split else 0
        every = ", the output layer on the CPU" if n == of else ""  # llama.cpp offloads it only past them
        why = f"{short}; {n} of {of} layers fit{'s' if n == 1 else ''}{every} ({split_need / MIB:.0f} MiB)"
        # Round 73: a device short of the resident at its cap runs the split for every request;
        # the resident alone, with a lower cap, would keep the requests that fit at full speed.
        longest = _longest_request(resident, gpu_ctx_tokens, usable_bytes)
        if longest > 0:
            why += (
                f"; with a lower GPU lane cap the resident would take requests up to about {longest} tokens,"
                f" every layer on the device ([gpu_lane] ctx_cap_tokens = {longest}, every chat model's cap;"
                " longer ones then go to the CPU, or to a split beside it if one still fits)"
            )
        return ProfilePlan("split", need, n, split_need, usable_bytes, why)
    # Rule 4: no split worker runs (none configured, or none fits): the resident serves the
    # requests that fit, if any does (round 73: a configured split that could not run left the
    # device unused).
    none = "; no split worker configured" if split is None else split_why
    longest = _longest_request(resident, gpu_ctx_tokens, usable_bytes)
    if longest > 0:
        fit = (
            f"requests up to about {longest} tokens fit (the resident's context cap); longer go to the CPU, "
            "within its own cap"
        )
        alone = ": " if split is None else "; the resident alone: "
        return ProfilePlan("gpu", need, 0, 0, usable_bytes, f"{short}{none}{alone}{fit}", longest)
    why = f"{short}; not even a 1-token request fits beside its weights{split_why}"
    return ProfilePlan("cpu", need, 0, 0, usable_bytes, why)


def _longest_request(model: MemoryModel, cap_tokens: int, usable_bytes: int) -> int:
    """The most tokens (prompt and answer, up to ``cap_tokens``) of one request that fit beside
    the weights (rule 1's bytes), 0 when not even one does."""
    lo, hi = 0, cap_tokens
    while lo < hi:  # the footprint grows with the tokens
        mid = (lo + hi + 1) // 2
        if device_bytes(model, 1, mid) <= usable_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
