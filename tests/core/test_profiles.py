"""core.profiles: which profile runs on the device (gpu / split / cpu), and the split's N,
on the default model's real spec, against bytes worked out from the memory model by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from spillover.core.memory import MemoryModel
from spillover.core.profiles import ProfilePlan, _longest_request, device_bytes, plan_profile, split_layers

MIB = 1024 * 1024
GPU_CTX, SPLIT_CTX = 2048, 1024


def models(memory: MemoryModel) -> tuple[MemoryModel, MemoryModel]:
    return dataclasses.replace(memory, n_batch=512), dataclasses.replace(memory, n_batch=128)


def test_device_bytes_are_weights_plus_each_slots_request(memory: MemoryModel) -> None:
    m = dataclasses.replace(memory, n_gpu_layers=10)
    fp = m.request_footprint(SPLIT_CTX, 0)
    assert device_bytes(m, 3, SPLIT_CTX) == m.weights_bytes() + 3 * fp.total_bytes
    # fewer layers on the device: fewer weights and less KV; of the compute, only the layers'
    # paths (the logits, and the output buffer, go with the output layer to the host)
    full = dataclasses.replace(memory, n_gpu_layers=-1)
    assert m.weights_bytes() < full.weights_bytes()
    assert m.request_footprint(SPLIT_CTX, 0).kv_bytes * 3 == full.request_footprint(SPLIT_CTX, 0).kv_bytes
    _, attention, ffn = m.compute_paths(SPLIT_CTX)
    assert m.request_footprint(SPLIT_CTX, 0).compute_bytes == math.ceil(max(attention, ffn))
    whole = full.compute_bytes(SPLIT_CTX) + full.output_bytes()
    assert full.request_footprint(SPLIT_CTX, 0).compute_bytes == whole > math.ceil(max(attention, ffn))


@pytest.mark.parametrize("usable_mib", [60, 100, 128, 200, 1024])
def test_split_layers_is_the_largest_n_that_fits(memory: MemoryModel, usable_mib: int) -> None:
    _, split = models(memory)
    usable = usable_mib * MIB
    n = split_layers(split, 1, SPLIT_CTX, usable)
    layers = memory.spec.n_layers
    assert 0 <= n <= layers
    if n:
        assert device_bytes(dataclasses.replace(split, n_gpu_layers=n), 1, SPLIT_CTX) <= usable
    if n < layers:  # one more layer would not fit
        assert device_bytes(dataclasses.replace(split, n_gpu_layers=n + 1), 1, SPLIT_CTX) > usable


def test_a_device_that_holds_the_whole_model_runs_it_resident_with_a_split_in_the_room_left(
    memory: MemoryModel,
) -> None:
    resident, split = models(memory)
    need = device_bytes(resident, 1, GPU_CTX)
    usable = need + 60 * MIB
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable, split=split, split_ctx_tokens=SPLIT_CTX)
    assert plan.profile == "gpu" and plan.resident_bytes == need
    assert plan.split_layers == split_layers(split, 1, SPLIT_CTX, usable - need) > 0
    assert plan.split_bytes <= usable - need  # beside the resident, not instead of it
    assert "of" in plan.why


def test_a_device_too_small_for_the_whole_model_runs_the_largest_split(memory: MemoryModel) -> None:
    resident, split = models(memory)
    usable = 60 * MIB
    assert device_bytes(resident, 1, GPU_CTX) > usable
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable, split=split, split_ctx_tokens=SPLIT_CTX)
    assert plan.profile == "split"
    assert 0 < plan.split_layers < memory.spec.n_layers
    assert plan.split_layers == split_layers(split, 1, SPLIT_CTX, usable)
    assert plan.split_bytes <= usable
    assert f"{plan.split_layers} of {memory.spec.n_layers} layers fit" in plan.why


def test_a_split_plan_names_the_cap_that_keeps_the_resident(memory: MemoryModel) -> None:
    """Round 73: a device just short of the resident at its cap runs the split for every request;
    the why names the longest request the resident alone would take there, and that cap plans it
    resident (a device too small for even a 1-token request names none)."""
    resident, split = models(memory)
    usable = device_bytes(resident, 1, GPU_CTX) - 1
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable, split=split, split_ctx_tokens=SPLIT_CTX)
    longest = _longest_request(resident, GPU_CTX, usable)
    assert plan.profile == "split" and 0 < longest < GPU_CTX
    assert f"the resident would take requests up to about {longest} tokens" in plan.why
    assert f"[gpu_lane] ctx_cap_tokens = {longest}, every chat model's cap" in plan.why
    kept = plan_profile(resident, gpu_ctx_tokens=longest, usable_bytes=usable, split=split, split_ctx_tokens=SPLIT_CTX)
    assert kept.profile == "gpu" and kept.resident_tokens == longest
    tiny = plan_profile(
        resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=60 * MIB, split=split, split_ctx_tokens=SPLIT_CTX
    )
    assert tiny.profile == "split" and "ctx_cap_tokens" not in tiny.why


def test_a_split_that_cannot_run_leaves_the_resident_what_fits(memory: MemoryModel) -> None:
    """Round 73: a configured split that fits nowhere (its cap too long, or too many slots) runs
    no split worker; the resident then takes the requests that fit, as without a
    split (rule 4), instead of leaving the device unused."""
    resident, split = models(memory)
    usable = device_bytes(resident, 1, GPU_CTX) - 1
    longest = _longest_request(resident, GPU_CTX, usable)
    for kw in ({"split_ctx_tokens": 1_000_000}, {"split_ctx_tokens": SPLIT_CTX, "split_slots": 100}):
        plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable, split=split, **kw)
        assert (plan.profile, plan.split_layers, plan.resident_tokens) == ("gpu", 0, longest), plan.why
        assert "no split" in plan.why and f"the resident alone: requests up to about {longest} tokens fit" in plan.why
    alone = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable)
    assert (alone.profile, alone.resident_tokens) == ("gpu", longest)
    # configured layers that do not fit (2 layers with 64 slots of its cap) take
    # the same path, and say what would fit
    many = plan_profile(
        resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable, split=split, split_slots=64, split_gpu_layers=2,
        split_ctx_tokens=SPLIT_CTX,
    )  # fmt: skip
    assert (many.profile, many.split_layers, many.resident_tokens) == ("gpu", 0, longest), many.why
    assert "the configured split of 2 layers needs" in many.why


def test_two_split_slots_fit_fewer_layers(memory: MemoryModel) -> None:
    resident, split = models(memory)
    one = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=60 * MIB, split=split, split_ctx_tokens=SPLIT_CTX)
    two = plan_profile(
        resident,
        gpu_ctx_tokens=GPU_CTX,
        usable_bytes=60 * MIB,
        split=split,
        split_slots=2,
        split_ctx_tokens=SPLIT_CTX,
    )
    assert 0 < two.split_layers < one.split_layers < memory.spec.n_layers


def test_nothing_fits_runs_on_the_cpu_only(memory: MemoryModel) -> None:
    resident, split = models(memory)
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=8 * MIB, split=split, split_ctx_tokens=SPLIT_CTX)
    assert (plan.profile, plan.split_layers, plan.split_bytes) == ("cpu", 0, 0)
    assert "no split of it fits" in plan.why
    # a device where layers fit but not a split worker's requests: the why names what they need
    # (a [split].ctx_cap_tokens of 100000 read only "no split of it fits")
    huge = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=100 * MIB, split=split, split_ctx_tokens=100_000)
    one = device_bytes(dataclasses.replace(split, n_gpu_layers=1), 1, 100_000)
    assert huge.profile == "cpu" and one > 100 * MIB > device_bytes(dataclasses.replace(split, n_gpu_layers=1), 1, 1)
    assert (
        f"one layer with 1 request(s) of 100000 tokens ([split] slots, ctx_cap_tokens) needs {one / MIB:.0f} MiB"
        in huge.why
    )
    assert "100 MiB on the device" in huge.why
    # without a split worker a device too small for even a 1-token request is the cpu profile
    # as well (no resident worker would ever be admitted one), and it names no split
    assert device_bytes(resident, 1, 1) > 128 * MIB
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=128 * MIB)
    assert (plan.profile, plan.split_layers) == ("cpu", 0)
    assert "not even a 1-token request fits" in plan.why and "split" not in plan.why


def test_without_a_split_worker_the_resident_runs_while_some_request_fits(memory: MemoryModel) -> None:
    """Rule 4: the resident serves the shorter requests a device too small for one at the cap
    still holds; admission sends the rest to the CPU. The plan says up to how many tokens."""
    resident, _ = models(memory)
    smallest, at_cap = device_bytes(resident, 1, 1), device_bytes(resident, 1, GPU_CTX)
    assert smallest < at_cap
    usable = (smallest + at_cap) // 2
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable)
    assert (plan.profile, plan.split_layers, plan.resident_bytes) == ("gpu", 0, at_cap)
    longest = int(plan.why.split("requests up to about ")[1].split()[0])
    assert 0 < longest < GPU_CTX
    assert device_bytes(resident, 1, longest) <= usable < device_bytes(resident, 1, longest + 1)
    assert "no split worker configured" in plan.why
    assert plan.resident_tokens == longest and plan.as_dict()["resident_tokens"] == longest  # rule 5
    assert plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=at_cap).resident_tokens == GPU_CTX
    assert plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=smallest).profile == "gpu"
    assert plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=smallest - 1).resident_tokens == 0
    assert plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=smallest - 1).profile == "cpu"


def test_configured_layers_are_taken_as_given_and_checked(memory: MemoryModel) -> None:
    resident, split = models(memory)
    plan = plan_profile(
        resident,
        gpu_ctx_tokens=GPU_CTX,
        usable_bytes=128 * MIB,
        split=split,
        split_ctx_tokens=SPLIT_CTX,
        split_gpu_layers=4,
    )
    assert (plan.profile, plan.split_layers) == ("split", 4)
    assert plan.split_bytes == device_bytes(dataclasses.replace(split, n_gpu_layers=4), 1, SPLIT_CTX)
    huge = plan_profile(
        resident,
        gpu_ctx_tokens=GPU_CTX,
        usable_bytes=60 * MIB,
        split=split,
        split_ctx_tokens=SPLIT_CTX,
        split_gpu_layers=999,  # more than the model has: all of its layers, which do not fit
    )
    assert (huge.profile, huge.split_layers) == ("cpu", 0)  # no worker that could never load


def test_configured_layers_that_do_not_fit_beside_the_resident_run_no_split_worker(memory: MemoryModel) -> None:
    """Beside a resident that fits, configured split layers are checked against the room it
    leaves: too many run no split worker (it could never load) and the plan says why; as many
    as fit run."""
    resident, split = models(memory)
    need = device_bytes(resident, 1, GPU_CTX)
    layers = memory.spec.n_layers
    # every repeating layer (the most a split places: its output layer stays on the CPU)
    all_layers = device_bytes(dataclasses.replace(split, n_gpu_layers=layers), 1, SPLIT_CTX)
    usable = need + all_layers - 1  # one byte short of every layer beside the resident

    def plan(configured: int, room: int = usable) -> ProfilePlan:
        return plan_profile(
            resident,
            gpu_ctx_tokens=GPU_CTX,
            usable_bytes=room,
            split=split,
            split_ctx_tokens=SPLIT_CTX,
            split_gpu_layers=configured,
        )

    over = plan(layers)
    assert (over.profile, over.split_layers, over.split_bytes) == ("gpu", 0, 0)
    assert f"the configured split of {layers} layers needs" in over.why and "no split worker" in over.why
    most = plan(-1).split_layers
    assert f"([split].gpu_layers = {most} would fit)" in over.why
    fits = plan(layers, usable + 1)
    assert (fits.profile, fits.split_layers, fits.split_bytes) == ("gpu", layers, all_layers)
    assert f"a split worker with {layers} layers beside it" in fits.why
    auto = plan(-1)
    assert auto.profile == "gpu" and 0 < auto.split_layers < layers
    none = plan(-1, need + 1)  # no room at all beside the resident
    assert (none.split_layers, none.split_bytes) == (0, 0) and "no split of it fits" in none.why


def test_the_planner_counts_device_weights_as_spillover_estimate_does(memory: MemoryModel) -> None:
    """llama.cpp offloads the output layer only past the repeating layers: at ``n_gpu_layers =
    n_layers`` it stays on the CPU. The planner (and the sim ledger, which charges what it
    plans) counted it on the device there, so a split of every layer looked 30 MB larger than
    ``spillover estimate --gpu-layers 30`` says and the planner chose one layer fewer."""
    from spillover.core.estimate import estimate

    layers = memory.spec.n_layers
    for n in (1, layers - 1, layers, layers + 1):
        planned = dataclasses.replace(memory, n_gpu_layers=n).weights_bytes()
        estimated = estimate(memory.spec, 1024, placement="gpu", gpu_layers=n).device.weights_bytes
        assert planned == estimated, n
    # and the whole of a split's device bytes as the estimate's (the helper's check: the planner
    # also put the whole compute buffer and the output buffer on the device, 19.8 MB more, so
    # a device that the estimate said holds 20 layers was planned 14)
    _, split = models(memory)
    for n in (1, 14, layers - 1, layers, layers + 1):
        planned = device_bytes(dataclasses.replace(split, n_gpu_layers=n), 1, SPLIT_CTX)
        est = estimate(memory.spec, SPLIT_CTX, n_batch=split.n_batch, placement="gpu", gpu_layers=n)
        assert planned == est.device.total_with_margin_bytes, n
    every = dataclasses.replace(memory, n_gpu_layers=layers).weights_bytes()
    assert every < dataclasses.replace(memory, n_gpu_layers=-1).weights_bytes()
    # the smallest device on which a split of every layer fits now plans it
    _, split = models(memory)
    usable = device_bytes(dataclasses.replace(split, n_gpu_layers=layers), 1, SPLIT_CTX)
    assert split_layers(split, 1, SPLIT_CTX, usable) == layers
    assert split_layers(split, 1, SPLIT_CTX, usable - 1) == layers - 1
    resident, _ = models(memory)
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=usable, split=split, split_ctx_tokens=SPLIT_CTX)
    assert plan.profile == "split" and f"{layers} of {layers} layers fit, the output layer on the CPU" in plan.why


@pytest.mark.parametrize("short_by", [1, 200_000, 3 * MIB])
def test_a_need_just_over_the_room_does_not_read_as_equal_to_it(memory: MemoryModel, short_by: int) -> None:
    """Round 19: "need 243 MiB, the device has 243" for 254,819,665 bytes over 254,803,968, and
    "one layer ... needs 10 MiB, 10 MiB on the device". The two figures of a refusal are written
    with as many decimals as tell them apart, else in bytes; apart by MiBs, as before."""
    resident, split = models(memory)
    need = device_bytes(resident, 1, GPU_CTX)
    plan = plan_profile(resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=need - short_by)
    a, b = plan.why.split(" need ", 1)[1].split(";")[0].split(", the device has ")
    assert a != b, plan.why
    if short_by >= MIB:
        assert (a, b) == (f"{need / MIB:.0f} MiB", f"{(need - short_by) / MIB:.0f} MiB")
    one = device_bytes(dataclasses.replace(split, n_gpu_layers=1), 1, SPLIT_CTX)
    tight = plan_profile(
        resident, gpu_ctx_tokens=GPU_CTX, usable_bytes=one - short_by, split=split, split_ctx_tokens=SPLIT_CTX
    )
    words = tight.why.split(" needs ", 1)[1].split(" on the device")[0]
    assert tight.profile == "cpu" and len(set(words.split(", "))) == 2, tight.why


@pytest.mark.parametrize("cap", [1100, 3001, 257])
def test_a_cap_off_the_256_grid_is_planned_at_the_cells_llama_cpp_creates(memory: MemoryModel, cap: int) -> None:
    """llama.cpp pads a context to 256 cells (1100 -> 1280): counting the cap's own tokens put the
    plan 3 % under what the worker allocates, and a layer past ``spillover estimate``'s answer."""
    _, split = models(memory)
    m = dataclasses.replace(split, n_gpu_layers=20)
    padded = math.ceil(cap / 256) * 256
    assert m.cells(cap) == padded
    assert device_bytes(m, 1, cap) == device_bytes(m, 1, padded)
    assert device_bytes(m, 1, cap) > m.weights_bytes() + m.request_footprint(cap, 0).total_bytes
    assert m.request_footprint(m.cells(cap), 0).kv_bytes == m.kv_bytes(cap)  # the estimate's KV
