"""Every request field, honoured or refused: nothing a client sends is silently ignored.

Rules:

1. A field in ``HONOURED`` changes what the gateway does (README, "Request fields").
2. A field in ``NO_OP`` is accepted only with a value that asks for what the gateway does
   anyway (``n: 1``, ``store: false``, ``modalities: ["text"]``, ...); any other value is a
   400 whose ``param`` names the field and says why.
3. Any other field is a 400 naming it, unless the operator listed it in
   ``[server].ignored_fields`` (a knowing choice for a client that sends extras).
4. Only the fields the gateway reads are journaled (``stored``), so junk in a body cannot
   grow the journal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from spillover.errors import InvalidRequest

__all__ = ["CHAT", "COMPLETION", "EMBEDDINGS", "HONOURED", "check_fields", "model_field", "stored"]

_COMMON = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "user",
        "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "spillover",
        # llama.cpp's sampling extensions, honoured as llama.cpp's server does
        "top_k", "min_p", "repeat_penalty",
    }
)  # fmt: skip

# Honoured (rule 1), per endpoint.
CHAT = _COMMON | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "top_logprobs",
    "response_format", "safety_identifier", "prompt_cache_key",
}  # fmt: skip
COMPLETION = _COMMON | {"prompt"}
EMBEDDINGS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
HONOURED = {"chat": CHAT, "text": COMPLETION, "embeddings": EMBEDDINGS}

# Accepted only with these values (rule 2): field -> (allowed values, why others are refused).
_NONE = (None,)
NO_OP: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    "chat": {
        "n": ((1, None), "only one choice per request (n=1) is served"),
        "store": ((False, None), "stored completions are not offered"),
        "metadata": ((None, {}), "metadata belongs to stored completions, which are not offered"),
        "service_tier": (("auto", "default", None), "there is one service tier"),
        "modalities": ((["text"], None), "only text output is served"),
        "audio": (_NONE, "audio output is not served"),
        "prediction": (_NONE, "predicted outputs are not supported"),
        "reasoning_effort": (_NONE, "the served model does not reason in separate steps"),
        "verbosity": (_NONE, "verbosity is not supported; ask for it in the prompt"),
        "web_search_options": (_NONE, "web search is not offered"),
        "functions": (_NONE, "the deprecated 'functions' is not supported; use 'tools'"),
        "function_call": (_NONE, "the deprecated 'function_call' is not supported; use 'tool_choice'"),
        "prompt_cache_retention": (_NONE, "prompt caching is not offered"),
        "prompt_cache_options": (_NONE, "prompt caching is not offered"),
        "moderation": (_NONE, "moderation is not offered"),
    },
    "text": {
        "n": ((1, None), "only one choice per request (n=1) is served"),
        "best_of": ((1, None), "only best_of=1 is served"),
        "echo": ((False, None), "echo is not supported"),
        "suffix": ((None, ""), "insertion with a suffix is not supported"),
    },
    "embeddings": {},
}


def check_fields(body: dict[str, Any], endpoint: str, ignored: Iterable[str] = ()) -> None:
    """Rules 1-3 for one body (``endpoint``: ``chat``, ``text`` or ``embeddings``)."""
    honoured = HONOURED[endpoint]
    no_op = NO_OP[endpoint]
    skip = frozenset(ignored)
    for name, value in body.items():
        if name in honoured or name in skip:
            continue
        if name in no_op:
            allowed, why = no_op[name]
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise InvalidRequest(f"'{name}'={_short(value)} is not supported: {why}", param=name)
            continue
        raise InvalidRequest(
            f"unknown field '{name}': this server does not ignore what it does not understand "
            "(the README lists every field it takes; an operator may allow extras with "
            "[server].ignored_fields)",
            param=name,
        )


def model_field(body: dict[str, Any]) -> str:
    """The body's ``model``: a 400 naming it when it is missing, or when it is given but is not a
    non-empty string (round 31: ``"model": 5`` was answered "'model' is required")."""
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            f"'model' must be a non-empty string naming a served model, not {_short(model)}", param="model"
        )
    return model


def stored(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """Rule 4: the part of a validated body that is journaled."""
    honoured = HONOURED[endpoint]
    return {k: v for k, v in body.items() if k in honoured or k in NO_OP[endpoint]}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
