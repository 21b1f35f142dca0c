"""Where a prompt is rendered and tokenized: a small one on the event loop (no thread hop), a large
one, one with tools, or one while the tokenizer is busy in another thread, in a thread; the
template's refusal is the client's 400 either way (the real default model's tokenizer)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from spillover.engine.llama_engine import Tokenizer
from spillover.errors import InvalidRequest
from spillover.http.schemas import parse_chat, parse_completion
from spillover.runtime.prepare import INLINE_RENDER_CHARS, GenerationRequest, _render_or_400, _renders_inline, render

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tok(model_path: str) -> Tokenizer:
    return Tokenizer(model_path)


class Recording:
    """The real tokenizer, noting the thread each conversation is rendered on."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.threads: list[threading.Thread] = []

    def busy(self) -> bool:
        return self.tok.busy()

    def tokenize(self, text: str, **kw: Any) -> list[int]:
        self.threads.append(threading.current_thread())
        return self.tok.tokenize(text, **kw)

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        self.threads.append(threading.current_thread())
        return self.tok.tokenize_chat(messages, tools)


def chat(content: str, **extra: Any) -> GenerationRequest:
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": content}], **extra}, "m")


def _fill(n: int) -> str:
    """Content that makes the message's shown text exactly ``n`` characters."""
    shell = len(str({"role": "user", "content": ""}))
    return "x" * (n - shell)


@pytest.mark.parametrize(
    ("req", "inline"),
    [
        (chat("hi"), True),
        (chat(_fill(INLINE_RENDER_CHARS)), True),
        (chat(_fill(INLINE_RENDER_CHARS + 1)), False),
        (chat("hi", tools=[TOOL]), False),  # tool definitions are rendered too: no bound taken here
        (parse_completion({"model": "m", "prompt": "x" * INLINE_RENDER_CHARS}, "m"), True),
        (parse_completion({"model": "m", "prompt": "x" * (INLINE_RENDER_CHARS + 1)}, "m"), False),
    ],
)
def test_only_small_prompts_without_tools_render_inline(req: GenerationRequest, inline: bool) -> None:
    assert _renders_inline(req) is inline


def test_the_bound_counts_every_message() -> None:
    """Two messages of half the bound each are over it together."""
    half = {"role": "user", "content": "x" * (INLINE_RENDER_CHARS // 2)}
    two = parse_chat({"model": "m", "messages": [half, {"role": "assistant", "content": "ok"}, half]}, "m")
    assert not _renders_inline(two)


@pytest.mark.parametrize(
    ("req", "on_loop"),
    [(chat("Hello there"), True), (chat(_fill(INLINE_RENDER_CHARS + 1)), False), (chat("hi", tools=[TOOL]), False)],
)
def test_a_small_prompt_is_rendered_on_the_loop_a_large_one_in_a_thread(
    tok: Tokenizer, req: GenerationRequest, on_loop: bool
) -> None:
    """Same ids either way; the small one never leaves the loop's thread."""
    rec = Recording(tok)

    async def go() -> tuple[list[int], threading.Thread]:
        return await _render_or_400(rec, req), threading.current_thread()

    ids, loop_thread = asyncio.run(go())
    assert ids == render(tok, req)
    assert (rec.threads == [loop_thread]) is on_loop and len(rec.threads) == 1


def test_a_busy_tokenizer_sends_even_a_small_prompt_to_a_thread(tok: Tokenizer) -> None:
    """While another thread tokenizes (holds the tokenizer's lock), the loop does not wait for it:
    the small prompt goes to a thread, and the loop runs on meanwhile."""
    rec = Recording(tok)
    held, release = threading.Event(), threading.Event()

    def other() -> None:  # another request's long tokenization; the test releases it (10 s at most)
        with tok._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=other)
    holder.start()
    held.wait(5)

    async def go() -> threading.Thread:
        task = asyncio.ensure_future(_render_or_400(rec, chat("hi")))
        await asyncio.sleep(0.05)
        running = not task.done()  # its thread waits for the lock; the loop got here
        release.set()
        await task
        assert running
        return threading.current_thread()

    loop_thread = asyncio.run(go())
    holder.join()
    assert len(rec.threads) == 1 and rec.threads[0] is not loop_thread


@pytest.mark.parametrize("content", ["hi", _fill(INLINE_RENDER_CHARS + 1)])
def test_a_refused_conversation_is_the_clients_400_inline_or_not(tok: Tokenizer, content: str) -> None:
    """A template that raises (Jinja's ``raise_exception`` raises as this one does) is a 400 naming
    ``messages`` on both paths."""

    class Refusing(Recording):
        def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
            super().tokenize_chat(messages, tools)
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    with pytest.raises(InvalidRequest) as err:
        asyncio.run(_render_or_400(Refusing(tok), chat(content)))
    assert err.value.param == "messages" and "refused these messages" in str(err.value)


def _nested_tool(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


@pytest.mark.parametrize("tool_choice", [None, "auto", "required"])
def test_a_tool_schema_nested_past_the_bound_is_the_clients_400_on_both_apis(tok: Tokenizer, tool_choice: Any) -> None:
    """A tool whose parameters nest 300 schema levels (600 JSON levels) with tool_choice auto or
    absent: rendering it into the prompt ran out of Python's stack, a 500. It is a 400 naming
    the tool's parameters, on /v1/chat/completions and /api/chat; at the bound it renders."""
    from spillover.http.ollama import parse_ollama_chat
    from spillover.http.schemas import MAX_TOOL_JSON_DEPTH

    msgs = [{"role": "user", "content": "hi"}]
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    for levels in (300, MAX_TOOL_JSON_DEPTH // 2 + 1):
        with pytest.raises(InvalidRequest) as caught:
            parse_chat({"messages": msgs, "tools": [_nested_tool(levels)], **choice}, "m")
        assert caught.value.param == "tools[0].function.parameters" and "nests deeper" in caught.value.message
        with pytest.raises(InvalidRequest) as caught:
            parse_ollama_chat({"model": "m", "messages": msgs, "tools": [_nested_tool(levels)]}, "m")
        assert caught.value.param == "tools[0].function.parameters"
    req = parse_chat({"messages": msgs, "tools": [_nested_tool(MAX_TOOL_JSON_DEPTH // 2 - 1)], **choice}, "m")
    assert render(tok, req)  # the deepest allowed renders
