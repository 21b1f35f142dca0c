"""A validated generation request turned into what the scheduler runs: the prompt in each
lane's tokens (with that model's chat template; client text never becomes control tokens),
the bounded grammar of a forced tool call, and the context limits (400 when too long).

Nothing here knows HTTP: ``http.schemas`` builds the ``GenerationRequest`` from a body.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from spillover.engine.grammar import GrammarRefused, schema_to_grammar
from spillover.errors import ContextLengthExceeded, InvalidRequest, NotFound

if TYPE_CHECKING:
    from spillover.runtime.gateway import Gateway

__all__ = ["GenerationRequest", "Prepared", "new_request_id", "prepare", "render", "tool_schema"]


def new_request_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class GenerationRequest:
    """A validated chat or text completion request."""

    kind: str  # "chat" | "text"
    model: str
    stream: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    include_usage: bool
    allow_shrink: bool
    prefer_cpu: bool = False
    deadline_ms: int | None = None
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str = ""
    tools: tuple[dict[str, Any], ...] = ()
    forced_tool: str | None = None  # a named function, or "*" for "required"
    user: str | None = None


def tool_schema(tools: tuple[dict[str, Any], ...], forced: str) -> dict[str, Any]:
    """JSON schema the constrained output must follow for a forced tool call."""

    def params(t: dict[str, Any]) -> dict[str, Any]:
        p = dict(t["function"].get("parameters") or {"type": "object", "properties": {}})
        p.setdefault("type", "object")
        return p

    chosen = [t for t in tools if forced == "*" or t["function"]["name"] == forced]
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": params(t)},
            "required": ["name", "arguments"],
        }
        for t in chosen
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


@dataclass(frozen=True)
class Prepared:
    """A request turned into tokens and limits, ready for the scheduler."""

    rid: str
    req: GenerationRequest
    tokens: list[int]
    max_tokens: int
    grammar: str | None  # GBNF that constrains the output (a forced tool call), bounded
    seed: int
    cpu_tokens: list[int] | None = None  # the prompt in the CPU lane's fallback model's tokens (if it differs)


def _tool_system_prompt(req: GenerationRequest) -> dict[str, Any]:
    fns = [t["function"] for t in req.tools if req.forced_tool in ("*", t["function"]["name"])]
    return {
        "role": "system",
        "content": 'You call functions. Reply with one JSON object {"name": ..., "arguments": {...}} '
        "that calls one of these functions:\n" + json.dumps(fns),
    }


def render(tok: Any, req: GenerationRequest) -> list[int]:
    """The prompt in ``tok``'s tokens (with that model's chat template)."""
    if req.kind == "text":
        return list(tok.tokenize(req.prompt, special=False))
    messages = [dict(m) for m in req.messages]
    if req.forced_tool is not None:
        messages.insert(0, _tool_system_prompt(req))
    return list(tok.tokenize_chat(messages, [dict(t) for t in req.tools] or None))


def _tool_grammar(req: GenerationRequest, max_bytes: int, max_repeat: int) -> str | None:
    """The bounded output grammar of a forced tool call (400 naming the schema otherwise).
    Each chosen tool's parameters are checked alone first, so the error names its tool."""
    if req.forced_tool is None:
        return None
    for i, t in enumerate(req.tools):
        if req.forced_tool in ("*", t["function"]["name"]):
            param = f"tools[{i}].function.parameters"
            try:
                schema_to_grammar(tool_schema((t,), t["function"]["name"]), max_bytes=max_bytes, max_repeat=max_repeat)
            except GrammarRefused as exc:
                raise InvalidRequest(exc.message, param=f"{param}.{exc.path}" if exc.path else param) from exc
    try:
        return schema_to_grammar(tool_schema(req.tools, req.forced_tool), max_bytes=max_bytes, max_repeat=max_repeat)
    except GrammarRefused as exc:
        raise InvalidRequest(f"the tools together: {exc.message}", param="tools") from exc


async def _render_or_400(tok: Any, req: GenerationRequest) -> list[int]:
    """``_render`` in a thread; a chat template that refuses the conversation (Jinja's
    ``raise_exception``, e.g. roles that do not alternate) is the client's 400."""
    try:
        return await asyncio.to_thread(render, tok, req)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param="messages") from exc


async def prepare(gw: Gateway, req: GenerationRequest, rid: str) -> Prepared:
    """Check the model, tokenize, and apply the context limits (400 when too long)."""
    if req.model != gw.cfg.model.name:
        raise NotFound(
            f"model {req.model!r} does not exist; this server serves {gw.cfg.model.name!r}",
            param="model",
            code="model_not_found",
        )
    m = gw.cfg.model
    grammar = await asyncio.to_thread(_tool_grammar, req, m.max_grammar_bytes, m.max_grammar_repeat)
    tokens = await _render_or_400(gw.tokenizer, req)
    cpu_tokens = None
    if gw.cpu_tokenizer is not None:  # a fallback model: its own template and vocabulary
        cpu_tokens = await _render_or_400(gw.cpu_tokenizer, req)
        if cpu_tokens == tokens:
            cpu_tokens = None
    cap = gw.context_cap_tokens()
    n = max(len(tokens), len(cpu_tokens or ()))
    if n >= cap or (req.max_tokens is not None and n + req.max_tokens > cap):
        want = n + (req.max_tokens or 1)
        raise ContextLengthExceeded(
            f"this request needs {want} tokens ({n} in the prompt) but the longest context "
            f"any lane serves is {cap} tokens",
            param="messages" if req.kind == "chat" else "prompt",
        )
    max_tokens = req.max_tokens if req.max_tokens is not None else min(gw.cfg.model.default_max_tokens, cap - n)
    seed = req.seed if req.seed is not None else gw.cfg.model.seed
    return Prepared(rid, req, tokens, max_tokens, grammar, seed, cpu_tokens)
