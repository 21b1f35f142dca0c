"""A validated generation request turned into what the scheduler runs: the prompt in each
lane's tokens (with that model's chat template; client text never becomes control tokens),
the bounded grammar of a forced tool call, and the context limits (400 when too long).

Nothing here knows HTTP: ``http.schemas`` builds the ``GenerationRequest`` from a body.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jinja2

from spillover.core.routing import MIN_SHRUNK_TOKENS, fits_lane
from spillover.engine.grammar import GrammarRefused, schema_to_grammar
from spillover.engine.schema_keywords import FORMS
from spillover.errors import ContextLengthExceeded, InvalidRequest

if TYPE_CHECKING:
    from spillover.runtime.chat import ChatModel
    from spillover.runtime.gateway import Gateway

__all__ = ["GenerationRequest", "Prepared", "choose_seed", "new_request_id", "prepare", "render", "tool_schema"]


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
    allow_shrink: bool | None  # None: the operator's default ([admission].shrink_by_default)
    prefer_cpu: bool = False
    deadline_ms: int | None = None
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str = ""
    tools: tuple[dict[str, Any], ...] = ()
    forced_tool: str | None = None  # a named function, or "*" for "required"
    tools_unused: bool = False  # tool_choice "none": the tools are shown to the template, never called
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1  # -1: none; N >= 0: each token's log-probability and the N likeliest
    response_format: dict[str, Any] | None = None  # json_object / json_schema (None: text)
    ctx_limit: int | None = None  # the client's own context limit (Ollama's num_ctx): prompt + output
    # The output stops when its context is full (Ollama's rule): max_tokens is cut to the room
    # the context (``ctx_limit`` or the lanes' cap) leaves after the prompt, never refused for it.
    stops_at_context: bool = False

    def sampling(self) -> dict[str, Any]:
        """The sampling fields a worker takes as they are."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            # A forced tool call's output is the call's JSON in a wrapper the client never sees:
            # a stop sequence there could only match the wrapper or cut the call (ignored).
            "stop": list(self.stop) if self.forced_tool is None else [],
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repeat_penalty": self.repeat_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "logit_bias": [list(x) for x in self.logit_bias],
            "logprobs": self.logprobs,
        }


DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps the parts its "#/..." refs name
DEFS_REFS = ("#/$defs/", "#/definitions/")


def tool_schema(tools: tuple[dict[str, Any], ...], forced: str) -> dict[str, Any]:
    """JSON schema the constrained output must follow for a forced tool call. Each function's
    parameters sit under ``arguments`` in it, so their ``$defs``/``definitions`` (what a
    ``#/$defs/...`` ref in them names: pydantic's nested models) move to its root, where those
    refs resolve; two functions that define one name differently are refused (400)."""
    defs: dict[str, dict[str, Any]] = {}

    def params(t: dict[str, Any], at: str) -> dict[str, Any]:
        p = _refs_under(dict(t["function"].get("parameters") or {"type": "object", "properties": {}}), at)
        if not FORMS & p.keys():  # a $ref or a union is its own type (a type beside it was refused)
            p.setdefault("type", "object")
        for key in DEFS_KEYS:
            for name, part in (p.pop(key, None) or {}).items() if isinstance(p.get(key), dict) else ():
                if defs.setdefault(key, {}).setdefault(name, part) != part:
                    raise InvalidRequest(
                        f"two functions define {key} '{name}' differently; a forced call needs one",
                        param="tools",
                    )
        return p

    chosen = [t for t in tools if forced == "*" or t["function"]["name"] == forced]
    at = (
        ["#/properties/arguments"]
        if len(chosen) == 1
        else [f"#/anyOf/{i}/properties/arguments" for i in range(len(chosen))]
    )
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": params(t, where)},
            "required": ["name", "arguments"],
        }
        for t, where in zip(chosen, at, strict=True)
    ]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return schema | defs


ARGUMENTS_PATH = "properties.arguments"  # where a forced call's parameters sit in its schema (``tool_schema``)


def _refs_under(schema: dict[str, Any], at: str) -> dict[str, Any]:
    """``schema`` (a function's parameters) with each local ``$ref`` that names a part of it
    (``#``, ``#/properties/a``: zod-to-json-schema's reused parts, a self-recursive pydantic
    root) pointing there inside the call's schema (``at``); ``#/$defs/...`` and
    ``#/definitions/...`` stay, their maps move to the root. They resolved against the
    call's wrapper: "a not in {'name': ..., 'arguments': ...}"."""

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not ref.startswith(DEFS_REFS):
            out["$ref"] = at + ref[1:]
        return out

    return dict(moved(schema))


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
    # No max_tokens asked: up to the context limit of the lane that serves it (OpenAI's
    # meaning). Such a request may always be shrunk to fit: it asked for no particular length.
    open_ended: bool = False
    allow_shrink: bool = False
    chat: ChatModel | None = None  # the chat model that serves it (None: the gateway's primary)
    cut: bool = False  # max_tokens was cut to the room the lanes' context leaves (``stops_at_context``): shrunk


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
            except GrammarRefused as exc:  # named as the client wrote it: without the call's wrapper
                path = exc.path.removeprefix(ARGUMENTS_PATH).lstrip(".")
                raise InvalidRequest(exc.message, param=f"{param}.{path}" if path else param) from exc
    try:
        return schema_to_grammar(tool_schema(req.tools, req.forced_tool), max_bytes=max_bytes, max_repeat=max_repeat)
    except GrammarRefused as exc:
        raise InvalidRequest(f"the tools together: {exc.message}", param="tools") from exc


def _output_grammar(req: GenerationRequest, max_bytes: int, max_repeat: int) -> str | None:
    """The bounded grammar the output must follow: a forced tool call's, or the
    ``response_format``'s (any JSON object, or the given JSON schema); None for text."""
    if req.forced_tool is not None:
        return _tool_grammar(req, max_bytes, max_repeat)
    rf = req.response_format
    if rf is None:
        return None
    if rf["type"] == "json_object":
        from llama_cpp.llama_grammar import JSON_GBNF  # root ::= object

        return str(JSON_GBNF)
    param = "response_format.json_schema.schema"
    try:
        return schema_to_grammar(rf["schema"], max_bytes=max_bytes, max_repeat=max_repeat)
    except GrammarRefused as exc:
        raise InvalidRequest(exc.message, param=f"{param}.{exc.path}" if exc.path else param) from exc


def _checked_grammar(chat: ChatModel, req: GenerationRequest, max_bytes: int, max_repeat: int) -> str | None:
    """``_output_grammar``, parsed by llama.cpp here for each vocabulary a lane uses: one it
    refuses is a 400 before the request is accepted."""
    grammar = _output_grammar(req, max_bytes, max_repeat)
    if grammar is None:
        return None
    for tok in (chat.tokenizer, chat.cpu_tokenizer):
        if tok is not None and not tok.grammar_parses(grammar):
            raise InvalidRequest(
                "llama.cpp cannot parse the output grammar this schema gives",
                param="tools" if req.forced_tool is not None else "response_format.json_schema.schema",
            )
    return grammar


def _check_tools_taken(chat: ChatModel, req: GenerationRequest) -> None:
    """Tools a model may call of its own accord (``tool_choice`` ``auto``, or none given) reach
    it only through its chat template: one whose template drops them (SmolLM2's) would answer
    as if none had been sent (round 45b: the same prompt tokens with and without them). That is
    a 400 naming ``tools``, as Ollama answers a model without tool support; a forced call
    (``required`` or a named function) works with any model (its output is constrained)."""
    if not req.tools or req.forced_tool is not None or req.tools_unused:
        return
    # The served model's template (a fallback model answers in its own degraded way, flagged).
    if chat.tokenizer is not None and not chat.tokenizer.takes_tools():
        raise InvalidRequest(
            f"model {req.model!r} does not take tools: its chat template leaves them out, so it would answer "
            "as if none were sent; send no tools, or (OpenAI's API) tool_choice 'required' or a named function: "
            "the answer is then constrained to a call",
            param="tools",
            code="model_not_supported",
        )


def _check_logit_bias(chat: ChatModel, req: GenerationRequest) -> None:
    """Token ids of ``logit_bias`` exist in the served model's vocabulary, and mean the same
    tokens on every lane (not so with a fallback model of another vocabulary)."""
    if not req.logit_bias:
        return
    if chat.cpu_tokenizer is not None:
        raise InvalidRequest(
            "logit_bias names token ids of one model, and this server's CPU lane serves another "
            f"(the fallback {chat.fallback_name!r}); send the request without logit_bias",
            param="logit_bias",
        )
    n_vocab = chat.tokenizer.n_vocab
    for token, _ in req.logit_bias:
        if token >= n_vocab:
            raise InvalidRequest(
                f"logit_bias: token id {token} is not in the model's {n_vocab}-token vocabulary", param="logit_bias"
            )


# A prompt up to this many characters (message fields' text, no tools) is rendered and tokenized
# on the event loop: ~0.5 ms for a short one, 1-3.4 ms at this size on a 2-core VM (3.4 ms: 950
# CJK characters, the slowest text tried), less CPU than the thread hop it saves (a wake-up of
# the thread and one of the loop, ~0.1-0.3 ms each here, plus the GIL handed back and forth).
# A larger one, or one with tools, takes a thread so the loop does not stall other requests'
# tokens for long.
INLINE_RENDER_CHARS = 1000


def _renders_inline(req: GenerationRequest) -> bool:
    """Whether ``req``'s prompt is small enough to render on the event loop."""
    if req.kind == "text":
        return len(req.prompt) <= INLINE_RENDER_CHARS
    if req.tools:
        return False
    left = INLINE_RENDER_CHARS
    for m in req.messages:  # the fields' text as Python shows it: a bound of what the template puts in
        left -= len(str(m))
        if left < 0:
            return False
    return True


async def _render_or_400(tok: Any, req: GenerationRequest) -> list[int]:
    """``_render``: on the loop when small (``_renders_inline``) and the tokenizer is free, else in
    a thread. A chat template that refuses the conversation (Jinja's ``raise_exception``, e.g.
    roles that do not alternate) is the client's 400."""
    try:
        if _renders_inline(req) and not tok.busy():  # a busy tokenizer would stall the loop
            ids = render(tok, req)
        else:
            ids = await asyncio.to_thread(render, tok, req)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param="messages") from exc
    if ids:
        return ids
    # An empty prompt ("", or a conversation that renders to nothing) starts from the model's BOS
    # token, as llama-cpp-python's completions do; llama.cpp cannot decode zero tokens, and that
    # was the worker's failure on both lanes: three such requests opened the GPU's breaker.
    if tok.bos_id < 0:
        raise InvalidRequest(
            "the prompt is empty and this model has no beginning-of-sequence token to start from",
            param="prompt" if req.kind == "text" else "messages",
        )
    return [tok.bos_id]


async def prepare(gw: Gateway, req: GenerationRequest, rid: str) -> Prepared:
    """Check the model, tokenize, and apply the context limits (400 when too long)."""
    served = gw.registry.resolve(req.model, "chat")  # 404 listing what is served, or 400 for another kind
    chat = gw.chat_model(served.id)
    if req.prefer_cpu and not chat.cpu_path:
        raise InvalidRequest(
            f'model {served.id!r} has no CPU path on this server (cpu = "none"); send it without prefer: cpu',
            param="spillover.prefer",
        )
    if req.kind == "chat" and not chat.has_template():
        raise InvalidRequest(
            f"model {served.id!r} has no chat template: it serves completions only; send a prompt to /v1/completions",
            param="model",
            code="model_not_supported",
        )
    m = gw.cfg.model
    grammar = None
    if req.forced_tool is not None or req.response_format is not None:  # building one takes a while
        grammar = await asyncio.to_thread(_checked_grammar, chat, req, m.max_grammar_bytes, m.max_grammar_repeat)
    _check_logit_bias(chat, req)
    _check_tools_taken(chat, req)
    tokens = await _render_or_400(chat.tokenizer, req)
    cpu_tokens = None
    if chat.cpu_tokenizer is not None:  # a fallback model: its own template and vocabulary
        cpu_tokens = await _render_or_400(chat.cpu_tokenizer, req)
        if cpu_tokens == tokens:
            cpu_tokens = None
    lanes_cap = chat.context_cap_tokens(gw.device is not None)
    cap = lanes_cap if req.ctx_limit is None else min(lanes_cap, req.ctx_limit)
    n = max(len(tokens), len(cpu_tokens or ()))
    allow_shrink = req.allow_shrink if req.allow_shrink is not None else gw.cfg.admission.shrink_by_default
    cut = False  # by spillover's context (the lanes' cap), not the client's own num_ctx
    if req.stops_at_context and req.max_tokens is not None and n < cap and n + req.max_tokens > cap:
        req = replace(req, max_tokens=cap - n)  # as many as the context holds, no more
        cut = cap == lanes_cap
    # A max_tokens past every lane's context is refused, unless it may be shrunk to fit.
    if n >= cap or (req.max_tokens is not None and not allow_shrink and n + req.max_tokens > cap):
        want = n + (1 if req.stops_at_context else req.max_tokens or 1)  # the least it could run with
        raise ContextLengthExceeded(
            f"this request needs {want} tokens ({n} in the prompt) but "
            + (
                f"its own context limit is {cap} token{'s' if cap != 1 else ''}"
                if req.ctx_limit == cap
                else f"the longest context any lane serves is {cap} tokens"
            ),
            param="messages" if req.kind == "chat" else "prompt",
        )
    # One that may shrink needs room for the least a shrunk answer keeps (``MIN_SHRUNK_TOKENS``,
    # or its max_tokens when fewer) on some lane, as admission counts it: with less, it got a 503
    # to retry that no retry could pass (round 31). A client's own context limit (Ollama's
    # ``num_ctx``) is not a lane: a generation there stops when that context is full.
    least = min(len(tokens), len(cpu_tokens or tokens))  # the shorter prompt: some lane may run it
    if req.max_tokens is not None and allow_shrink and not fits_lane(least, req.max_tokens, lanes_cap, shrinkable=True):
        answer = min(req.max_tokens, MIN_SHRUNK_TOKENS)
        raise ContextLengthExceeded(
            f"this request needs at least {least + answer} tokens ({least} in the prompt, {answer} to answer: "
            f"a shrunk answer keeps {MIN_SHRUNK_TOKENS}, or its max_tokens when fewer) but the longest "
            f"context any lane serves is {lanes_cap} tokens",
            param="messages" if req.kind == "chat" else "prompt",
        )
    open_ended = req.max_tokens is None and gw.cfg.model.default_max_tokens == 0
    if req.max_tokens is not None:
        max_tokens = req.max_tokens
    else:
        max_tokens = cap - n if open_ended else min(gw.cfg.model.default_max_tokens, cap - n)
    return Prepared(
        rid,
        req,
        tokens,
        max_tokens,
        grammar,
        choose_seed(req.seed, gw.cfg.model.seed),
        cpu_tokens,
        open_ended=open_ended,
        allow_shrink=allow_shrink or open_ended,
        chat=chat,
        cut=cut,
    )


def choose_seed(asked: int | None, configured: int) -> int:
    """The request's seed; else the configured one; else (-1) a fresh random one. The choice
    is journaled with the request, so a replay samples exactly the same way."""
    if asked is not None:
        return asked
    return configured if configured >= 0 else secrets.randbelow(1 << 31)
