"""A cancel stops the running llama_decode itself (``Engine.abort``), a long prompt's prefill
included, on the real default model; the slot then answers as a fresh one would."""

from __future__ import annotations

import threading
import time

from spillover.config import default_model_path
from spillover.engine.llama_engine import Engine, GenerateParams, Step

N_CTX = 2048


def engine() -> Engine:
    # n_batch = the context: the whole prompt is one llama_decode, which only an abort ends early
    return Engine(default_model_path(), slots=1, n_ctx=N_CTX, n_threads=1, n_batch=N_CTX)


def long_prompt(e: Engine) -> list[int]:
    e.measure()
    llm = e._slots[0]
    text = " ".join(f"item {i} of the list," for i in range(400)).encode()
    return [int(t) for t in llm.tokenize(text, add_bos=True, special=False)][: N_CTX - 64]


def greedy(e: Engine, prompt: list[int], n: int = 8) -> list[int]:
    steps = e.generate(
        0, prompt, GenerateParams(max_tokens=n, temperature=0.0), kv_tokens=N_CTX, should_stop=lambda: False
    )
    return [s.token_id for s in steps if isinstance(s, Step)]


def test_an_abort_ends_the_prefill_inside_its_decode_and_the_slot_answers_as_before() -> None:
    e = engine()
    prompt = long_prompt(e)
    assert len(prompt) > 1500
    short = prompt[:40]
    want = greedy(e, short)
    stop = threading.Event()
    asked = threading.Event()

    def should_stop() -> bool:
        asked.set()  # the first ask is generate's own, just before the prompt's decode
        return stop.is_set()

    out: list[Step | str] = []
    ended: list[float] = []

    def run() -> None:
        params = GenerateParams(max_tokens=4, temperature=0.0)
        out.extend(e.generate(0, prompt, params, kv_tokens=N_CTX, should_stop=should_stop))
        ended.append(time.monotonic())

    th = threading.Thread(target=run)
    th.start()
    assert asked.wait(30)
    time.sleep(0.3)  # inside the one decode of the whole prompt (seconds on these machines)
    assert th.is_alive(), "the prompt's decode ended before the cancel: the test proves nothing"
    stop.set()
    e.abort(0)
    t_abort = time.monotonic()
    th.join(30)
    assert out == ["cancelled"]
    assert ended[0] - t_abort < 0.5, ended[0] - t_abort
    assert e._slots[0].n_tokens == 0  # the prompt's decode never finished: it was stopped inside
    assert greedy(e, short) == want  # nothing of the stopped decode is left in the slot


def test_a_cancel_marked_before_the_decode_starts_is_not_lost() -> None:
    """The flag is cleared before the request's cancel is looked at: a cancel that came
    before generate armed it ends the request at once, without a decode."""
    e = engine()
    prompt = long_prompt(e)
    e.abort(0)  # a leftover from an earlier request: cleared, not taken for this one's
    assert greedy(e, prompt[:40], n=3) != []
    t0 = time.monotonic()
    steps = list(e.generate(0, prompt, GenerateParams(max_tokens=4), kv_tokens=N_CTX, should_stop=lambda: True))
    assert steps == ["cancelled"]
    assert time.monotonic() - t0 < 0.5
