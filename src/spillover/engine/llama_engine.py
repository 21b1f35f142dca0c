"""llama.cpp through llama-cpp-python: loading, chat templates, tokenizing and generating.

One ``Engine`` holds one model, loaded once (mmap'ed) and shared by every slot's own llama
context; how much of it stays loaded between requests is its ``readiness``. A cancelled
request stops inside its current ``llama_decode`` (``Engine.abort``: a long prompt's prefill
too), not only between tokens. The gateway uses a vocab-only ``Tokenizer`` to count prompt
tokens before admission, so both workers see the very same token ids.

A chat prompt is tokenized by ``Tokenizer.tokenize_chat``: only the chat template's own
markers become control tokens; text from the client (every message content, including the
gateway's tool-instruction message) is tokenized with ``special=False``, so
``<|im_end|>\n<|im_start|>system`` inside a message stays plain text.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillover.engine.holder import check_mode, held_report
from spillover.engine.llamacpp import OP_OFFLOAD, load_llama_cpp
from spillover.engine.textstream import StopScanner

__all__ = ["Engine", "GenerateParams", "Step", "Tokenizer", "fingerprint_parts"]


def _llama_cls() -> Any:
    return load_llama_cpp().Llama


TEMPLATE_RUNS_KEPT = 256  # template-only text runs whose ids a tokenizer remembers
_C_SPACE = " \t\n\v\f\r"  # what C's isspace() strips around an lstrip/rstrip marker


@dataclass(frozen=True)
class _Marker:
    """A vocabulary token that only ``special=True`` produces (a control or unknown token)."""

    text: str
    token_id: int
    lstrip: bool  # llama.cpp drops the whitespace before it
    rstrip: bool  # ... and after it


@dataclass(frozen=True)
class _Content:
    """Client text inside a rendered chat prompt: never parsed for markers."""

    text: str


@functools.cache
def _abort_installer() -> Callable[[Any, Any], None] | None:
    """What sets a context's abort callback: ``install(ctx, flag)`` gives llama.cpp's
    ``llama_set_abort_callback`` (``bool (*)(void *data)``, asked by the CPU backend after
    every node of the graph it computes) C's own ``strlen`` as the callback and a slot's
    two-byte flag (``_AbortFlag``) as its data: empty while the request runs, one character
    once it is cancelled. No Python runs per node, so the check costs nothing and needs no
    GIL (a Python callback would take the GIL a thousand times a decode, and wait for it
    whenever another slot's thread holds it). The length is 0 or 1, so the low byte the caller
    reads as the bool is the whole answer, on every C calling convention llama.cpp runs on.
    None where the C library cannot be found: a cancel is then seen between tokens only, as
    it is for a graph a GPU backend computes (only the CPU backend asks the callback)."""
    import llama_cpp.llama_cpp as lib

    try:
        libc = ctypes.CDLL(None) if not hasattr(ctypes, "windll") else ctypes.cdll.msvcrt
        address = ctypes.cast(libc.strlen, ctypes.c_void_p).value
        setter = lib._lib.llama_set_abort_callback
    except (OSError, AttributeError):
        return None
    if address is None:
        return None
    setter.argtypes = [ctypes.c_void_p, lib.ggml_abort_callback, ctypes.c_void_p]
    setter.restype = None
    callback = lib.ggml_abort_callback(address)

    def install(ctx: Any, flag: Any) -> None:
        setter(ctx, callback, ctypes.cast(flag, ctypes.c_void_p))

    return install


class _AbortFlag:
    """A slot's cancel flag, read by llama.cpp between graph nodes (``_abort_installer``).

    Rules: ``arm`` installs it on the slot's context and clears it before the request's
    cancel is looked at (so a cancel that comes meanwhile is seen either way); ``set`` is
    called after the request is marked cancelled. A decode that sees it set stops and
    returns 2 (``llama_decode``: aborted), llama.cpp removes what that decode had put in the
    KV cache, and the next request starts from an empty context as always."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(2)

    def arm(self, llm: Any) -> None:
        self._buf[0] = b"\0"
        if (install := _abort_installer()) is not None:
            install(llm._ctx.ctx, self._buf)

    def set(self) -> None:
        self._buf[0] = b"x"


def _strings(obj: Any) -> Iterator[str]:
    """Every string inside a JSON-like value (keys included)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _strings(v)


class _Sentinels(dict[str, str]):
    """Sentinel -> the client text it stands for, for one rendering. Each sentinel is ASCII
    letters only (no template trims, escapes or splits it): this rendering's fresh random
    28-letter prefix (about 160 bits: a client cannot guess it) and a 5-letter count. One
    random draw per rendering, and the skeleton is cut with ``str.split`` on the prefix
    (a regular expression of every sentinel was compiled anew for each request)."""

    _LETTERS = string.ascii_letters
    _DIGITS = 5

    def __init__(self) -> None:
        super().__init__()
        self.prefix = "".join(self._LETTERS[b % 52] for b in secrets.token_bytes(28))

    def add(self, original: str) -> str:
        n = len(self)
        if n >= 52**self._DIGITS:
            raise ValueError("too many strings in one conversation")
        key = self.prefix + "".join(self._LETTERS[n // 52**i % 52] for i in range(self._DIGITS))
        self[key] = original
        return key

    def cut(self, skeleton: str) -> list[str | _Content] | None:
        """The skeleton as template text and client text; None when a sentinel came out cut
        or changed (the template rewrote it)."""
        first, *rest = skeleton.split(self.prefix)
        parts: list[str | _Content] = [first]
        for chunk in rest:
            original = self.get(self.prefix + chunk[: self._DIGITS])
            if original is None:
                return None
            parts += [_Content(original), chunk[self._DIGITS :]]
        return parts


def _piece(llm: Any, token_id: int) -> str:
    """A token's text, control tokens included."""
    return bytes(llm.detokenize([token_id], special=True)).decode("utf-8", "replace")


def _tokenize(llama_cpp: Any, vocab: Any, data: bytes, *, add_bos: bool, special: bool) -> list[int]:
    """``llama_tokenize`` into a buffer sized for ``data``: a token is at least one byte, plus
    BOS and EOS. (llama-cpp-python's ``tokenize`` zeroes a buffer of the training context, which a
    vocab-only load reports as 0, so it calls llama.cpp twice: about twice this one's cost.)"""
    room = len(data) + 2
    buf = (llama_cpp.llama_token * room)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, room, add_bos, special)
    if n < 0:  # more ids than that (a vocab that adds a space and EOS to a byte; llama.cpp says how many)
        room = -n
        if room > 4 * len(data) + 16:  # INT32_MIN is "too many to count": no buffer of 8 GiB
            raise RuntimeError(f"llama_tokenize asked for {room} ids for {len(data)} bytes")
        buf = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, room, add_bos, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n}) on {len(data)} bytes")
    return list(buf[:n])


def _plain_chat(messages: list[dict[str, Any]]) -> str:
    """A conversation for a model without a chat template."""
    return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"


def _chat_formatter(template: str, eos_token: str, bos_token: str) -> Any:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token)


PROBE_MESSAGE = "Hello! How are you today?"


def probe_prompt(llm: Any) -> str:
    """What a CPU replica's probe prefills: a short user message as the model's chat template
    renders it. The shortest chat request a failover replays prefills as much (with SmolLM2's
    template 37 tokens; the bare message is 8), so the measured first token is what such a
    request's recovery waits for; a longer prompt waits longer, in proportion. A template that
    cannot render it (one that raises on a lone user message) gets the plain conversation: the
    probe must not stop the replica from starting."""
    messages = [{"role": "user", "content": PROBE_MESSAGE}]
    template = str(dict(llm.metadata).get("tokenizer.chat_template", ""))
    if not template:
        return _plain_chat(messages)
    eos, bos = (_piece(llm, t) if t >= 0 else "" for t in (llm.token_eos(), llm.token_bos()))
    try:
        return str(_chat_formatter(template, eos, bos)(messages=messages).prompt)
    except Exception:  # jinja2's errors, a template's own raise_exception
        return _plain_chat(messages)


def grammar_parses(llama_cpp: Any, vocab: Any, text: str) -> bool:
    """Whether llama.cpp's own parser takes ``text`` as a GBNF grammar for ``vocab``."""
    probe = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
    if not probe:
        return False
    llama_cpp.llama_sampler_free(probe)
    return True


TOOL_PROBE = "spillover_probe_tool"  # a tool name no template writes of its own (``Tokenizer.takes_tools``)


class Tokenizer:
    """Vocab-only view of a GGUF: chat template, tokenize, special tokens."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._llm = _llama_cls()(model_path=model_path, vocab_only=True, verbose=False)
        meta: dict[str, str] = dict(self._llm.metadata)
        self.metadata = meta
        self.chat_template = meta.get("tokenizer.chat_template", "")
        arch = meta.get("general.architecture", "llama")
        self.n_ctx_train = int(meta.get(f"{arch}.context_length", "2048"))
        self.n_vocab = int(self._llm.n_vocab())
        self._lib = load_llama_cpp()
        self._vocab = self._lib.llama_model_get_vocab(self._llm.model)
        self._lock = threading.Lock()
        self._marker_cache: list[_Marker] | None = None
        self._formatter: Any = None  # llama_cpp's Jinja2ChatFormatter, built on first use
        # Ids of runs of the template's own text (no client text in them: "system\n...",
        # "assistant\n"), which every prompt repeats; bounded, emptied when full.
        self._template_runs: dict[str, list[int]] = {}
        self._edges: list[int] | None = None  # what tokenize adds to an empty text (BOS, EOS)
        self._takes_tools: bool | None = None  # ``takes_tools``, once asked
        eos_id = self._llm.token_eos()
        bos_id = self._llm.token_bos()
        self.eos_token = self._piece(eos_id) if eos_id >= 0 else ""
        self.bos_token = self._piece(bos_id) if bos_id >= 0 else ""
        self.bos_id = bos_id  # -1: the vocabulary has none

    def _piece(self, token_id: int) -> str:
        return _piece(self._llm, token_id)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """Apply the model's own chat template (Jinja2, sandboxed)."""
        if not self.chat_template:
            return _plain_chat(messages)
        if self._formatter is None:  # compiled once: compiling the template cost more than rendering it
            self._formatter = _chat_formatter(self.chat_template, self.eos_token, self.bos_token)
        result = self._formatter(messages=messages, tools=tools)
        return str(result.prompt)

    def takes_tools(self) -> bool:
        """Whether the chat template puts tool definitions in the prompt (a probe tool's name
        shows in a rendering; asked once). A model without a template takes none."""
        if self._takes_tools is None:
            parameters = {"type": "object", "properties": {}}  # as clients send it: a template may read it
            probe = {"type": "function", "function": {"name": TOOL_PROBE, "description": "", "parameters": parameters}}
            try:
                rendered = self.render_chat([{"role": "user", "content": "hi"}], [probe]) if self.chat_template else ""
            except Exception:  # a template that refuses tools altogether
                rendered = ""
            self._takes_tools = TOOL_PROBE in rendered
        return self._takes_tools

    def busy(self) -> bool:
        """Whether another thread is tokenizing now (a caller on the event loop would wait for it)."""
        return self._lock.locked()

    def tokenize(self, text: str, *, special: bool = True, add_bos: bool = True) -> list[int]:
        """Token ids for ``text``; with ``add_bos`` the model's BOS/EOS when it asks for them.

        ``special=True`` turns marker text such as ``<|im_start|>`` into control tokens:
        use it only on text that the client cannot write (see ``tokenize_chat``).
        """
        data = text.encode("utf-8")
        with self._lock:
            return _tokenize(self._lib, self._vocab, data, add_bos=add_bos, special=special)

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Prompt ids for a conversation in which only the template's own markers are control tokens.

        The template is rendered a second time as a skeleton: each message's content is
        replaced by a unique sentinel, and so is every marker text (``<|im_end|>``...)
        inside the other client strings (tool definitions, tool calls, ids). When putting
        the originals back into the skeleton gives exactly the real rendering, the
        skeleton's template text is cut at marker text (as llama.cpp does for
        ``special=True``) and the client text joins the plain text around it, each run
        between two markers tokenized with ``special=False``. For ordinary text the ids
        are identical to ``tokenize(render_chat(...), special=True)``. A template that
        drops or repeats a content is fine: every copy is client text.

        Fallback, when the template rewrites client text (trims, slices, escapes it), so
        the skeleton cannot be matched to the real rendering: if no client string holds
        marker text, the rendering is tokenized with ``special=True`` as before (nothing
        to forge); otherwise it is tokenized with ``special=False`` as a whole: the model
        then sees no control tokens at all, and never forged ones.
        """
        rendered = self.render_chat(messages, tools)
        parts = self._chat_parts(messages, tools, rendered)
        if parts is not None:
            return self._tokenize_parts(parts)
        forgeable = any(self._has_marker(s) for s in _strings([messages, tools]))
        return self.tokenize(rendered, special=not forgeable)

    def _markers(self) -> list[_Marker]:
        """Control and unknown tokens, longest text first (llama.cpp's matching order)."""
        if self._marker_cache is None:
            import llama_cpp

            vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
            found = []
            for i in range(self._llm.n_vocab()):
                attr = int(llama_cpp.llama_vocab_get_attr(vocab, i))
                if not attr & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN):
                    continue
                text = bytes(llama_cpp.llama_vocab_get_text(vocab, i)).decode("utf-8", "replace")
                if text:
                    lstrip = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP)
                    found.append(_Marker(text, i, lstrip, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
            self._marker_cache = sorted(found, key=lambda m: -len(m.text.encode()))
        return self._marker_cache

    def _has_marker(self, text: str) -> bool:
        return any(m.text in text for m in self._markers())

    def _escape(self, obj: Any, originals: _Sentinels) -> Any:
        """``obj`` with each marker text in its strings replaced by a fresh sentinel (noted in ``originals``)."""
        if isinstance(obj, dict):
            return {self._escape(k, originals): self._escape(v, originals) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self._escape(v, originals) for v in obj]
        if not isinstance(obj, str) or not self._has_marker(obj):
            return obj
        out: list[str] = []
        for piece in self._split_markers(obj):
            if isinstance(piece, _Marker):
                piece = originals.add(piece.text)
            out.append(piece)
        return "".join(out)

    def _chat_parts(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, rendered: str
    ) -> list[str | _Content] | None:
        """The rendering as template text and client text, or None when the two cannot be told apart."""
        originals = _Sentinels()
        skeleton_messages = []
        for m in messages:
            content = m.get("content")
            m = {k: v if k == "content" else self._escape(v, originals) for k, v in m.items()}
            if isinstance(content, str):
                m["content"] = originals.add(content)
            else:
                m["content"] = self._escape(content, originals)
            skeleton_messages.append(m)
        skeleton = self.render_chat(skeleton_messages, self._escape(tools, originals))
        parts = originals.cut(skeleton)
        if parts is None or "".join(p.text if isinstance(p, _Content) else p for p in parts) != rendered:
            return None
        return parts

    def _split_markers(self, text: str) -> list[str | _Marker]:
        """Cut template text at marker text, each marker in turn (as llama.cpp partitions)."""
        out: list[str | _Marker] = [text]
        for marker in self._markers():
            if marker.text not in text:
                continue
            cut: list[str | _Marker] = []
            for piece in out:
                if isinstance(piece, _Marker):
                    cut.append(piece)
                    continue
                for j, chunk in enumerate(piece.split(marker.text)):
                    if j:
                        cut.append(marker)
                    cut.append(chunk)
            out = cut
        return out

    def _tokenize_parts(self, parts: list[str | _Content]) -> list[int]:
        """Markers become their ids; the plain text between two markers is one special=False run."""
        if self._edges is None:
            self._edges = self.tokenize("", special=False, add_bos=True)  # BOS (and EOS) when the model adds them
        edges = self._edges
        bos = edges[:1] if edges and edges[0] == self._llm.token_bos() else []
        out: list[int] = list(bos)
        run: list[str] = []
        client = False  # the run holds client text (never remembered)
        after_rstrip = False

        def flush(before: _Marker | None) -> None:
            nonlocal client
            text = "".join(run)
            run.clear()
            if after_rstrip:
                text = text.lstrip(_C_SPACE)
            if before is not None and before.lstrip:
                text = text.rstrip(_C_SPACE)
            if text and client:
                out.extend(self.tokenize(text, special=False, add_bos=False))
            elif text:
                if (ids := self._template_runs.get(text)) is None:
                    if len(self._template_runs) >= TEMPLATE_RUNS_KEPT:
                        self._template_runs.clear()
                    ids = self._template_runs[text] = self.tokenize(text, special=False, add_bos=False)
                out.extend(ids)
            client = False

        for part in parts:
            if isinstance(part, _Content):
                pieces: list[str | _Marker] = [part.text]
                client = True
            else:
                pieces = self._split_markers(part)
            for piece in pieces:
                if isinstance(piece, str):
                    run.append(piece)
                    continue
                flush(piece)
                out.append(piece.token_id)
                after_rstrip = piece.rstrip
        flush(None)
        return out + edges[len(bos) :]

    def grammar_parses(self, text: str) -> bool:
        """Whether llama.cpp takes ``text`` as a grammar for this vocabulary: the worker's own
        check (``Engine._grammar``), made before the request is accepted, so that a grammar
        it would refuse (an empty ``enum`` gave a rule with no alternative) is the client's
        400 at once, not a journaled failure after a worker saw it."""
        return grammar_parses(self._lib, self._vocab, text)

    def vocab_digest(self) -> str:
        """A hash of the whole vocabulary (token pieces in id order)."""
        h = hashlib.sha256()
        n = self._llm.n_vocab()
        for i in range(n):
            h.update(bytes(self._llm.detokenize([i], special=True)))
            h.update(b"\0")
        return h.hexdigest()


def file_digest(path: str, cache_dir: Path | None = None) -> str:
    """sha256 of a model file, cached by (path, size, mtime) in ``cache_dir``."""
    p = Path(path)
    st = p.stat()
    key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cache = cache_dir / f"digest-{key}.txt" if cache_dir else None
    if cache is not None and cache.is_file():
        return cache.read_text().strip()
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(digest)
    return digest


def fingerprint_parts(
    model_path: str, tok: Tokenizer, backend: str, cache_dir: Path | None, n_batch: int = 512
) -> dict[str, str]:
    """The compatibility and numerics parts of a worker's fingerprint."""
    import llama_cpp

    compat = {
        "model_sha256": file_digest(model_path, cache_dir),
        "vocab_sha256": tok.vocab_digest(),
        "chat_template_sha256": hashlib.sha256(tok.chat_template.encode()).hexdigest(),
        "quantization": tok.metadata.get("general.file_type", ""),
    }
    numerics = {
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "backend": backend,
        "n_batch": str(n_batch),
    }
    return {
        "compat": hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16],
        "numerics": hashlib.sha256(json.dumps(numerics, sort_keys=True).encode()).hexdigest()[:16],
        **compat,
        **numerics,
    }


class RequestRefused(Exception):
    """The engine cannot run this request as asked (the client's fault, not the device's)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # context_overflow | bad_grammar | empty_prompt
        self.message = message


@dataclass(frozen=True)
class GenerateParams:
    """Sampling parameters of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    grammar: str | None = None  # GBNF, already bounded by the gateway (engine.grammar)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int = -1  # -1: none; N >= 0: each token's log-probability and the N likeliest


@dataclass(frozen=True)
class Alternative:
    """A token the model could have chosen, with its log-probability."""

    token_id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True)
class Step:
    """One generated token and the text it releases (with its log-probability when asked:
    of the model's own distribution, before temperature, penalties, bias and grammar)."""

    token_id: int
    text: str
    piece: bytes = b""
    logprob: float | None = None
    top: tuple[Alternative, ...] = ()


_BORROW_LOCK = threading.Lock()


def _borrowed_llama(model: Any, params: dict[str, Any]) -> Any:
    """A ``Llama`` whose context runs over ``model`` (a loaded ``llama_cpp._internals.LlamaModel``)
    instead of loading the file again.

    llama-cpp-python's ``Llama`` always loads its own model; for the time of its constructor
    (under a lock) its ``LlamaModel`` is replaced by a factory that hands out a view of the
    shared one whose ``close`` does nothing, so closing the context never frees the model
    (``Engine`` frees it). Written against llama-cpp-python 0.3.x (pinned).
    """
    import copy

    import llama_cpp._internals as internals

    real = internals.LlamaModel

    def borrow(*, path_model: str, params: Any, verbose: bool) -> Any:
        view = copy.copy(model)
        view.close = lambda: None  # the context's exit stack and __del__ leave the model alone
        return view

    with _BORROW_LOCK:
        internals.LlamaModel = borrow  # type: ignore[misc,assignment]
        try:
            return _llama_cls()(**params)
        finally:
            internals.LlamaModel = real  # type: ignore[misc]


class Engine:
    """A loaded model with up to ``slots`` independent llama contexts over one shared model.

    Every slot's context borrows the one ``llama_model`` (``_borrowed_llama``), so weights,
    and a CPU backend's repacked copy of them, are held once however many slots there are.

    ``readiness`` is what the engine keeps ready between requests:

    - ``warm``: the model and every slot's context;
    - ``mmap``: the model (weights mapped); a slot's context is created on its first use
      and then kept, so host memory grows with the concurrency actually reached;
    - ``on_demand``: nothing; the model is loaded at the first request and then kept.

    ``measure()`` times each step once (model load, one context, a first token) so the
    gateway can predict what each mode costs to recover; every later load or context
    creation refreshes its figure (``timings``). ``set_readiness`` moves to a mode (or asks
    again for the one it is in): what the mode keeps is loaded at once, what it does not keep
    is freed (idle now, busy as its slot comes back).
    Free slots that already have a context are handed out first.
    """

    def __init__(
        self,
        model_path: str,
        *,
        slots: int,
        n_ctx: int,
        n_threads: int,
        n_batch: int,
        n_gpu_layers: int = 0,
        readiness: str = "warm",
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.model_path = model_path
        self.n_ctx = n_ctx
        self.n_gpu_layers = n_gpu_layers
        self._params = {
            "model_path": model_path,
            "n_ctx": n_ctx,
            "n_threads": n_threads,
            "n_threads_batch": n_threads,
            "n_batch": n_batch,
            "n_gpu_layers": n_gpu_layers,
            "op_offload": OP_OFFLOAD,  # a split's device holds only what was planned
            "verbose": False,
        }
        self.readiness = check_mode(readiness)
        self.timings: dict[str, float] = {}  # load_ms, ctx_ms, first_ms: the latest of each
        self._on_change = on_change
        self._model: Any = None  # the shared llama_model wrapper, or None
        self._model_params: Any = None
        self._slots: list[Any] = [None] * slots
        self._aborts = [_AbortFlag() for _ in range(slots)]
        self._free = list(range(slots))
        self._shedding = False  # a move down waits for busy slots to free the rest
        self._lock = threading.RLock()

    # -- what is held ---------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Number of slots."""
        return len(self._slots)

    @property
    def contexts(self) -> int:
        """Slots whose llama context exists."""
        return sum(1 for s in self._slots if s is not None)

    @property
    def model_loaded(self) -> bool:
        return self._model is not None

    def held(self) -> dict[str, Any]:
        """What it holds now and what each step last cost (the worker's ``held`` report)."""
        with self._lock:
            return held_report(self.readiness, self.model_loaded, self.contexts, self.timings)

    def _changed(self) -> None:
        """Report what it holds, under the lock so reports leave in the order of the changes."""
        with self._lock:
            self._on_change()

    def _load_model(self) -> Any:
        """The shared model, loaded now if it is not (timed: ``load_ms``)."""
        with self._lock:
            if self._model is None:
                import llama_cpp._internals as internals

                llama_cpp = load_llama_cpp()
                params = llama_cpp.llama_model_default_params()
                # -1 = every layer, as Llama(n_gpu_layers=-1) asks llama.cpp for it (INT32_MAX)
                params.n_gpu_layers = 0x7FFFFFFF if self.n_gpu_layers < 0 else self.n_gpu_layers
                params.vocab_only = False
                params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP  # as Llama(use_mmap=True) sets it
                t0 = time.perf_counter()
                self._model = internals.LlamaModel(path_model=self.model_path, params=params, verbose=False)
                self._model_params = params  # the ctypes struct outlives the model
                self.timings["load_ms"] = (time.perf_counter() - t0) * 1000
            return self._model

    def _create(self) -> Any:
        """A new llama context over the shared model (timed: ``ctx_ms``)."""
        model = self._load_model()
        t0 = time.perf_counter()
        llm = _borrowed_llama(model, self._params)
        self.timings["ctx_ms"] = (time.perf_counter() - t0) * 1000
        return llm

    def _free_slot_context(self, i: int) -> None:
        llm, self._slots[i] = self._slots[i], None
        if llm is not None:
            llm.close()

    def _drop_model(self) -> None:
        if self._model is not None and self.contexts == 0:
            self._model.close()
            self._model = None

    # -- readiness ------------------------------------------------------------------------
    def measure(self) -> None:
        """Time a cold start once (model load, one context, a first token), then settle into
        ``readiness``: the probe's context is kept as a slot's when the mode keeps any.

        The probe decodes on a thread of its own that ends with it. llama.cpp's CPU backend
        runs each decode as OpenMP parallel regions, and GOMP keeps a thread team for every
        OS thread that ever ran one; while more team threads are alive than cores, it stops
        spin-waiting between regions and every later decode is about 2.5x slower (measured:
        48 vs 139 tok/s at 2 threads on 2 cores). A probe on the worker's main thread would
        keep such a team alive for good."""
        failure: list[BaseException] = []

        def probe() -> None:
            try:
                self._measure()
            except BaseException as exc:  # re-raised on the caller's thread
                failure.append(exc)

        t = threading.Thread(target=probe, name="engine-measure")
        t.start()
        t.join()
        if failure:
            raise failure[0]
        self._changed()

    def _measure(self) -> None:
        with self._lock:
            llm = self._slots[0] if self._slots[0] is not None else self._create()
            self._slots[0] = llm
            probe = llm.tokenize(probe_prompt(llm).encode(), add_bos=True, special=True)
            t0 = time.perf_counter()
            llm.reset()
            llm.eval(probe)
            llm.sample(temp=0.0)
            self.timings["first_ms"] = (time.perf_counter() - t0) * 1000
            llm.reset()
            self._settle()

    def set_readiness(self, mode: str) -> None:
        """Move to ``mode`` (see the class): load what it keeps, free what it does not."""
        with self._lock:
            self.readiness = check_mode(mode)
            self._shedding = mode != "warm"  # asked: what it holds beyond the mode goes, busy slots too
            self._settle()
        self._changed()

    def _settle(self) -> None:
        """Hold what ``readiness`` keeps: free idle contexts (and the model) it does not keep,
        create the ones it does."""
        idle = [i for i in self._free if self._slots[i] is not None]
        if self.readiness == "warm":
            for i in range(len(self._slots)):
                if self._slots[i] is None:
                    self._slots[i] = self._create()
            return
        for i in idle:
            self._free_slot_context(i)
        if self.readiness == "mmap":
            self._load_model()
        else:
            self._drop_model()
        self._shedding = self._shedding and (self.contexts > 0 or (self.readiness == "on_demand" and self.model_loaded))

    def acquire_slot(self) -> int | None:
        """Take a free slot index (one with a context first), or None."""
        with self._lock:
            if not self._free:
                return None
            ready = [i for i in self._free if self._slots[i] is not None]
            pick = ready[0] if ready else self._free[0]
            self._free.remove(pick)
            return pick

    def release_slot(self, slot: int) -> None:
        """Give a slot back; a mode that keeps no idle context frees its context (and the
        model, when ``on_demand`` and no other slot holds one) once it is back."""
        changed = False
        with self._lock:
            self._free.append(slot)
            if self._shedding:
                self._settle()
                changed = True
        if changed:
            self._changed()

    def _slot_llm(self, slot: int) -> Any:
        """The slot's context, created now if it has none (on_demand: the model too)."""
        with self._lock:
            if self._slots[slot] is None:
                created = self._create()
                self._slots[slot] = created
            else:
                return self._slots[slot]
        self._changed()
        return created

    def abort(self, slot: int) -> None:
        """Stop the slot's running decode now (its request was cancelled: mark it so first,
        as ``generate``'s ``should_stop`` sees it); see ``_AbortFlag``."""
        self._aborts[slot].set()

    @staticmethod
    def _grammar(llm: Any, text: str) -> Any:
        """The output grammar, parsed once by llama.cpp here so that a grammar it refuses is
        the request's error (``bad_grammar``), not an engine failure."""
        import llama_cpp

        if not grammar_parses(llama_cpp, llama_cpp.llama_model_get_vocab(llm.model), text):
            raise RequestRefused("bad_grammar", "llama.cpp could not parse the output grammar")
        return llama_cpp.LlamaGrammar.from_string(text, verbose=False)  # type: ignore[attr-defined]

    def generate(
        self,
        slot: int,
        prompt_tokens: list[int],
        params: GenerateParams,
        *,
        kv_tokens: int,
        should_stop: Callable[[], bool],
        prefix: list[int] | None = None,
    ) -> Iterator[Step | str]:
        """Yield ``Step`` per new token, then the finish reason.

        Finish reasons: ``stop`` | ``length`` | ``cancelled`` | ``diverged``. A decode that
        ``abort`` stopped ends with ``cancelled`` too.

        ``prefix`` continues a generation whose first tokens were already delivered: the
        prompt is evaluated exactly as in an uninterrupted run (one batched eval), then
        each prefix token alone, as the original decode did. At each step the greedy
        choice is checked against the delivered token; any difference ends with
        ``diverged`` before a single new token is produced. Only greedy requests may be
        continued (the gateway checks).
        """
        llm = self._slot_llm(slot)
        self._aborts[slot].arm(llm)
        if should_stop():
            yield "cancelled"
            return
        try:
            yield from self._generate(
                llm, prompt_tokens, params, kv_tokens=kv_tokens, should_stop=should_stop, prefix=prefix
            )
        except RuntimeError:
            if not should_stop():  # llama_decode failed: not an abort
                raise
            yield "cancelled"

    def _generate(
        self,
        llm: Any,
        prompt_tokens: list[int],
        params: GenerateParams,
        *,
        kv_tokens: int,
        should_stop: Callable[[], bool],
        prefix: list[int] | None,
    ) -> Iterator[Step | str]:
        import llama_cpp
        import numpy as np

        prefix = list(prefix or [])
        limit = min(kv_tokens, self.n_ctx)
        budget = min(params.max_tokens, limit - len(prompt_tokens))
        if budget <= len(prefix):
            raise RequestRefused(
                "context_overflow",
                f"the prompt ({len(prompt_tokens) + len(prefix)} tokens) leaves no room to generate in this "
                f"worker's {limit}-token context",
            )
        if not prompt_tokens:  # llama.cpp cannot decode nothing (an assertion in llama-cpp-python)
            raise RequestRefused("empty_prompt", "the prompt is empty: there is no token to start from")
        grammar = self._grammar(llm, params.grammar) if params.grammar else None
        llm.reset()  # no KV prefix reuse: it made seeded sampling irreproducible
        llm.set_seed(params.seed)
        greedy = params.temperature <= 0
        scanner = StopScanner(stops=params.stop)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        history: list[int] = list(prompt_tokens)
        start = prompt_tokens
        if prefix:
            llm.eval(prompt_tokens)
            n_vocab = llm.n_vocab()
            for i, tok in enumerate(prefix):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
                if int(np.argmax(logits)) != tok:
                    yield "diverged"
                    return
                scanner.feed(bytes(llm.detokenize([tok], prev_tokens=history, special=False)))
                history.append(tok)
                if i < len(prefix) - 1:
                    llm.eval([tok])
            start = [prefix[-1]]
        produced = len(prefix)
        gen = llm.generate(
            start,
            top_k=1 if greedy else params.top_k,
            top_p=1.0 if greedy else params.top_p,
            min_p=0.0 if greedy else params.min_p,
            typical_p=1.0,
            temp=0.0 if greedy else params.temperature,
            repeat_penalty=params.repeat_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            logits_processor=_bias(params.logit_bias),
            reset=not prefix,
            grammar=grammar,
        )
        n_vocab = llm.n_vocab()
        try:
            for token in gen:
                if should_stop():
                    yield "cancelled"
                    return
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    tail = scanner.finish()
                    if tail:
                        yield Step(-1, tail)
                    yield "stop"
                    return
                piece = bytes(llm.detokenize([token], prev_tokens=history, special=False))
                history.append(token)
                produced += 1
                text = scanner.feed(piece)
                if params.logprobs >= 0:
                    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
                    lp, top = _logprobs(logits, token, params.logprobs)
                    alts = tuple(Alternative(t, bytes(llm.detokenize([t], special=False)), p) for t, p in top)
                    yield Step(token, text, piece, lp, alts)
                else:
                    yield Step(token, text, piece)
                if scanner.stopped:
                    yield "stop"
                    return
                if produced >= budget:
                    tail = scanner.finish()
                    if tail:
                        yield Step(-1, tail)
                    yield "length"
                    return
        finally:
            gen.close()


def _bias(logit_bias: tuple[tuple[int, float], ...]) -> Any:
    """A logits processor adding each token's bias (OpenAI's ``logit_bias``), or None."""
    if not logit_bias:
        return None
    import llama_cpp
    import numpy as np

    ids = np.array([t for t, _ in logit_bias], dtype=np.intp)
    add = np.array([b for _, b in logit_bias], dtype=np.float32)

    def apply(_input_ids: Any, scores: Any) -> Any:
        scores[ids] += add
        return scores

    return llama_cpp.LogitsProcessorList([apply])


def _logprobs(logits: Any, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under ``logits`` and the ``n`` likeliest tokens."""
    import numpy as np

    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    if n > 0:
        idx = np.argpartition(-x, n - 1)[:n]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return float(x[token] - lse), top
