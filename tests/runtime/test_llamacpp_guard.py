"""Where llama.cpp's CPU backend has AMX, every model loads without extra buffer types
(``spillover.engine.llamacpp``): the pinned build's AMX matrix product crashes the process at
the first prompt of more than one token; elsewhere llama.cpp's defaults are left alone."""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama_cpp as lib
import pytest

from spillover.config import default_model_path
from spillover.engine.llama_engine import Engine, GenerateParams, Step
from spillover.engine.llamacpp import amx_in_cpu_backend, load_llama_cpp

AMX_INFO = b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 | "
NO_AMX_INFO = b"CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | OPENMP = 1 | REPACK = 1 | "


def _fresh(monkeypatch: pytest.MonkeyPatch, info: bytes) -> None:
    """The bindings as they were, reporting ``info``; restored after the test."""
    monkeypatch.setattr(lib, "llama_print_system_info", lambda: info)
    monkeypatch.setattr(lib, "llama_model_default_params", lib.llama_model_default_params)
    monkeypatch.setattr(llama_cpp, "llama_model_default_params", llama_cpp.llama_model_default_params)


def test_the_system_info_line_is_read_for_amx() -> None:
    assert amx_in_cpu_backend(AMX_INFO.decode())
    assert not amx_in_cpu_backend(NO_AMX_INFO.decode())
    assert not amx_in_cpu_backend("CPU : AMX_INT8 = 0 | AVX2 = 1 | ")


def test_on_an_amx_cpu_every_load_leaves_the_extra_buffers_out(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch, AMX_INFO)
    original = lib.llama_model_default_params()
    module = load_llama_cpp.__wrapped__()
    assert module is llama_cpp
    # both ways in: the package (spillover's own loads) and the bindings' module (Llama())
    assert llama_cpp.llama_model_default_params().use_extra_bufts is False
    assert lib.llama_model_default_params().use_extra_bufts is False
    changed = lib.llama_model_default_params()

    def plain(params: lib.llama_model_params) -> dict[str, object]:  # the int and bool fields
        values = {f: getattr(params, f) for f, _ in params._fields_ if f != "use_extra_bufts"}
        return {f: v for f, v in values.items() if isinstance(v, int | bool)}

    assert plain(changed) == plain(original) and len(plain(original)) >= 5  # the rest: llama.cpp's


def test_without_amx_llama_cpps_defaults_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch, NO_AMX_INFO)
    before = lib.llama_model_default_params
    load_llama_cpp.__wrapped__()
    assert lib.llama_model_default_params is before
    assert llama_cpp.llama_model_default_params is before  # the package's name too (one function for both)


def test_the_default_model_answers_a_prompt_of_many_tokens_on_this_machine() -> None:
    """The crash this guards against came at the first decode of more than one token."""
    e = Engine(default_model_path(), slots=1, n_ctx=512, n_threads=1, n_batch=512)
    e.measure()
    prompt = [int(t) for t in e._slots[0].tokenize(b"Hello! How are you today? " * 20, add_bos=True, special=False)]
    assert len(prompt) > 100
    steps = e.generate(
        0, prompt, GenerateParams(max_tokens=4, temperature=0.0), kv_tokens=512, should_stop=lambda: False
    )
    assert sum(isinstance(s, Step) for s in steps) == 4
