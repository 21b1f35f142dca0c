"""A forced JSON answer from the real default model keeps its schema's integer bounds and is
JSON that a strict parser takes (no raw control character in a string): the grammar the
gateway builds (``engine.grammar``) parsed and enforced by llama.cpp, over sampled seeds."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from spillover.config import default_model_path
from spillover.core.routing import fault_outcome
from spillover.engine.grammar import schema_to_grammar
from spillover.engine.llama_engine import Engine, GenerateParams, RequestRefused, Step, Tokenizer
from spillover.errors import InvalidRequest
from spillover.http.schemas import parse_chat
from spillover.runtime import prepare

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "people": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 13},
        "stars": {"type": ["integer", "null"], "minimum": 1, "maximum": 5},
        "code": {"type": "string", "pattern": "^[^,]{2,5}.$"},
        "zip": {"type": "string", "pattern": r"^\d{3}$"},  # pydantic's digits: the grammar was refused
        "tag": {"enum": ["a\\b", 'say "hi"']},  # a backslash came back a backspace; a quote broke the grammar
        "path": {"type": "string", "pattern": r"^[a-z]{1,3}\\[a-z]{1,3}$"},  # a literal backslash
    },
    "required": ["city", "days", "people", "stars", "code", "zip", "tag", "path"],
}


def test_sampled_answers_keep_the_integer_bounds_and_are_strict_json() -> None:
    grammar = schema_to_grammar(SCHEMA, max_bytes=65536, max_repeat=512)
    prompt = Tokenizer(default_model_path()).tokenize_chat(
        [{"role": "user", "content": "Plan a trip: a city, how many days (a lot!), how many people. JSON."}], None
    )
    # One llama.cpp thread, as in every runtime test: scripts/test-pythons runs two pytest
    # processes at once on two cores, and two threads each spin-wait on each other (this test
    # took 14 s alone, 71 s beside its twin, past 300 s on CI).
    e = Engine(default_model_path(), slots=1, n_ctx=512, n_threads=1, n_batch=256)
    answers = []
    for seed in range(10):
        slot = e.acquire_slot()
        assert slot is not None
        try:
            params = GenerateParams(max_tokens=160, temperature=1.3, seed=seed, grammar=grammar)
            out = list(e.generate(slot, prompt, params, kv_tokens=512, should_stop=lambda: False))
        finally:
            e.release_slot(slot)
        assert out[-1] == "stop", out[-1]
        answers.append(json.loads("".join(s.text for s in out if isinstance(s, Step)), strict=True))
    assert all(1 <= a["days"] <= 7 and 1 <= a["people"] <= 12 and len(a["city"]) <= 12 for a in answers), answers
    assert all(a["stars"] is None or 1 <= a["stars"] <= 5 for a in answers), answers
    assert all(3 <= len(a["code"]) <= 6 and "," not in a["code"][:-1] for a in answers), answers
    assert all(re.fullmatch(r"\d{3}", a["zip"]) and a["tag"] in ("a\\b", 'say "hi"') for a in answers), answers
    assert all(re.fullmatch(r"[a-z]{1,3}\\[a-z]{1,3}", a["path"]) for a in answers), answers
    e.set_readiness("on_demand")


def test_an_empty_prompt_is_the_requests_fault_not_the_engines() -> None:
    """llama.cpp cannot decode zero tokens (llama-cpp-python asserts): the engine refuses it as
    the request's fault, which the breaker does not count against the device."""
    e = Engine(default_model_path(), slots=1, n_ctx=64, n_threads=1, n_batch=64)
    slot = e.acquire_slot()
    assert slot is not None
    try:
        with pytest.raises(RequestRefused) as refused:
            list(e.generate(slot, [], GenerateParams(max_tokens=4), kv_tokens=64, should_stop=lambda: False))
    finally:
        e.release_slot(slot)
    assert refused.value.kind == "empty_prompt"
    assert fault_outcome("empty_prompt") == "client"
    e.set_readiness("on_demand")


def test_a_grammar_llama_cpp_refuses_is_a_400_before_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker refused it after the request was journaled (round 45b: ``{"enum": []}`` gave a
    rule with no alternative): the gateway parses the grammar with llama.cpp itself first."""
    tok = Tokenizer(default_model_path())
    assert tok.grammar_parses('root ::= "a"')
    assert not tok.grammar_parses("root ::= ( ")
    chat = SimpleNamespace(tokenizer=tok, cpu_tokenizer=None)
    req = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        "m",
    )
    assert prepare._checked_grammar(chat, req, 65536, 512)  # type: ignore[arg-type]
    monkeypatch.setattr(prepare, "_output_grammar", lambda *_: "root ::= ( ")
    with pytest.raises(InvalidRequest) as e:
        prepare._checked_grammar(chat, req, 65536, 512)  # type: ignore[arg-type]
    assert e.value.param == "response_format.json_schema.schema"
