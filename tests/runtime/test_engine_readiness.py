"""Engine readiness on the real default model: one shared llama_model under every slot's
context, and the warm / mmap / on_demand modes holding exactly what they say."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spillover.config import default_model_path
from spillover.engine.llama_engine import Engine, GenerateParams, Step, _llama_cls

PROMPT = [1, 9690, 28, 638, 429, 346, 47]


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def engine(mode: str, slots: int = 3, reports: list[dict[str, Any]] | None = None) -> Engine:
    box: list[Engine] = []
    e = Engine(
        default_model_path(),
        slots=slots,
        n_ctx=256,
        n_threads=1,
        n_batch=64,
        readiness=mode,
        on_change=lambda: reports.append(box[0].held()) if reports is not None else None,
    )
    box.append(e)
    return e


def run(e: Engine, n: int = 6) -> list[int]:
    slot = e.acquire_slot()
    assert slot is not None
    try:
        steps = e.generate(
            slot, PROMPT, GenerateParams(max_tokens=n, temperature=0.0), kv_tokens=256, should_stop=lambda: False
        )
        return [s.token_id for s in steps if isinstance(s, Step)]
    finally:
        e.release_slot(slot)


def test_slots_share_one_model_and_answer_as_a_model_of_their_own() -> None:
    e = engine("warm")
    e.measure()
    assert e.contexts == 3 and e.model_loaded
    model = e._model.model
    assert all(llm._model.model == model for llm in e._slots)  # one llama_model under all three
    own = _llama_cls()(model_path=default_model_path(), n_ctx=256, n_batch=64, n_threads=1, verbose=False)
    own.reset()
    want = [t for _, t in zip(range(6), own.generate(PROMPT, top_k=1, temp=0.0), strict=False)]
    own.close()
    assert [run(e) for _ in range(3)] == [want] * 3
    e.set_readiness("on_demand")  # closing every context leaves the model to the engine
    assert e.contexts == 0 and not e.model_loaded


def test_measure_times_each_step_and_settles_into_the_mode() -> None:
    for mode, model, contexts in (("warm", True, 2), ("mmap", True, 0), ("on_demand", False, 0)):
        reports: list[dict[str, Any]] = []
        e = engine(mode, slots=2, reports=reports)
        e.measure()
        held = e.held()
        assert (held["mode"], held["model"], held["contexts"]) == (mode, model, contexts)
        assert set(held["timings"]) == {"load_ms", "ctx_ms", "first_ms"}
        assert all(v > 0 for v in held["timings"].values())
        assert reports[-1] == held  # every change is reported


def test_on_demand_loads_at_the_first_request_and_keeps_it() -> None:
    reports: list[dict[str, Any]] = []
    e = engine("on_demand", reports=reports)
    e.measure()
    assert not e.model_loaded
    before = e.timings["load_ms"]
    out = run(e)
    assert len(out) == 6 and e.model_loaded and e.contexts == 1
    assert reports[-1]["model"] and reports[-1]["contexts"] == 1
    assert e.timings["load_ms"] != before  # the real load refreshed its figure
    run(e)
    assert e.contexts == 1  # kept: the next request reuses it


def test_moving_down_frees_idle_state_now_and_busy_state_when_its_slot_returns() -> None:
    e = engine("warm")
    e.measure()
    warm = rss_mib()
    busy = e.acquire_slot()
    assert busy is not None
    e.set_readiness("on_demand")
    assert e.contexts == 1 and e.model_loaded  # the busy slot keeps its context (and the model)
    e.release_slot(busy)
    assert e.contexts == 0 and not e.model_loaded
    assert rss_mib() < warm - 50  # the weights' pages went back (the model is about 100 MiB)
    e.set_readiness("mmap")
    assert e.model_loaded and e.contexts == 0
    e.set_readiness("warm")
    assert e.contexts == 3
    e.set_readiness("mmap")
    assert e.model_loaded and e.contexts == 0
    run(e)
    assert e.contexts == 1  # mmap keeps a context made on demand once it is not shedding


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="readiness"):
        engine("lukewarm")
    e = engine("mmap")
    with pytest.raises(ValueError, match="readiness"):
        e.set_readiness("auto")


def test_the_probe_prefills_what_the_shortest_chat_request_does() -> None:
    """The first-token probe is a short user message rendered by the model's chat template, as
    the gateway renders a chat request (SmolLM2's adds its system prompt: 37 tokens, not the
    message's 8), so a replayed short chat request recovers in the measured time; a model
    without a template, or whose template refuses the message, gets the plain conversation."""
    from spillover.engine.llama_engine import PROBE_MESSAGE, Tokenizer, probe_prompt

    llm = _llama_cls()(model_path=default_model_path(), vocab_only=True, verbose=False)
    text = probe_prompt(llm)
    tok = Tokenizer(default_model_path())
    assert text == tok.render_chat([{"role": "user", "content": PROBE_MESSAGE}], None)
    assert len(llm.tokenize(text.encode(), add_bos=True, special=True)) == 37

    class NoTemplate:
        metadata: dict[str, str] = {}

    assert probe_prompt(NoTemplate()) == f"user: {PROBE_MESSAGE}\nassistant:"

    class Raising(NoTemplate):  # a template that refuses a lone user message
        metadata = {"tokenizer.chat_template": "{{ raise_exception('a system message first') }}"}

        def token_eos(self) -> int:
            return -1

        token_bos = token_eos

    assert probe_prompt(Raising()) == f"user: {PROBE_MESSAGE}\nassistant:"


def test_every_context_runs_without_op_offload() -> None:
    """llama.cpp's default ``op_offload`` would run a host-held weight's large-batch product on
    the GPU with a copy of the weight in the GPU's compute buffer: on a split, device memory
    the memory model gives to the host (``engine.llamacpp.OP_OFFLOAD``). Every slot's context
    is made without it."""
    e = engine("warm", slots=2)
    e.measure()
    assert e.contexts == 2
    assert [bool(llm.context_params.op_offload) for llm in e._slots] == [False, False]
    e.set_readiness("on_demand")
