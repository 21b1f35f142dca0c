"""``POST /v1/embeddings`` (OpenAI's shape) and Ollama's ``POST /api/embed``, over the
embeddings service (``runtime.embeddings``) through the request service's unary path.

Rules:

1. ``input`` is a string, a list of strings, a list of token ids, or a list of token-id
   lists. Token ids are this model's own vocabulary (bge-small-en's WordPiece ids), without
   ``[CLS]``/``[SEP]``, which are added as for text. Empty input, an empty string, more
   than ``max_inputs`` inputs, an id outside the vocabulary, or an input longer than the
   model's window is a 400 naming ``input``. A text that has no tokens (only whitespace, or
   characters the tokenizer drops) is embedded as ``[CLS] [SEP]``, as sentence-transformers
   and OpenAI answer such input: a chunker's blank piece does not fail its whole batch.
2. ``encoding_format`` is ``float`` (lists of numbers) or ``base64`` (float32
   little-endian bytes, what the openai SDK asks for by default). ``dimensions`` is refused
   unless it is the model's own size: bge models are not trained to be truncated.
3. ``usage.prompt_tokens`` counts what the encoder ran, ``[CLS]`` and ``[SEP]`` included.
4. Every answer carries ``X-Spillover-*`` headers and a ``spillover`` object (route,
   degraded, reason, attempts), like chat; an answer computed on the CPU path is degraded.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spillover.errors import ContextLengthExceeded, InvalidRequest, SpilloverError, to_http
from spillover.http import jsonout
from spillover.http.fields import check_fields, model_field, stored
from spillover.http.routes import signal_headers
from spillover.runtime.run import Encoded
from spillover.runtime.unary import Emit, OnMove, UnaryEndpoint

if TYPE_CHECKING:
    from spillover.runtime.embeddings import EmbeddingsService, EmbedResult
    from spillover.runtime.gateway import Gateway

__all__ = ["EmbedRequest", "embedding_endpoints"]

JSON = "application/json"


@dataclass(frozen=True)
class EmbedRequest:
    """A validated embeddings request: wrapped token ids per input."""

    model: str
    service: str
    inputs: list[list[int]]
    encoding_format: str  # "float" | "base64"
    shape: str  # "openai" | "ollama" | "ollama-legacy"


def _texts_or_ids(value: Any) -> list[str] | list[list[int]]:
    """Rule 1's shapes, as texts or as id lists."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a non-empty string or list", param="input")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [list(value)]
    if all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value):
        return [list(v) for v in value]
    raise InvalidRequest(
        "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param="input",
    )


def parse_inputs(value: Any, svc: EmbeddingsService) -> list[list[int]]:
    """Rule 1: the inputs as wrapped ids the encoder runs."""
    got = _texts_or_ids(value)
    assert svc.info is not None and svc.tokenizer is not None
    if len(got) > svc.cfg.max_inputs:
        raise InvalidRequest(
            f"'input' holds {len(got)} inputs; at most {svc.cfg.max_inputs} per request", param="input"
        )
    if isinstance(got[0], str):
        if any(t == "" for t in got):
            raise InvalidRequest("'input' must not contain an empty string", param="input")
        try:
            ids = svc.tokenize([str(t) for t in got])
        except (TypeError, ValueError) as exc:  # e.g. a lone surrogate ("\ud800"): JSON, not text
            raise InvalidRequest("'input' contains text that is not valid Unicode", param="input") from exc
    else:
        ids = [list(map(int, x)) for x in got]
        for row in ids:
            if not row:
                raise InvalidRequest("'input' must not contain an empty token list", param="input")
            bad = next((t for t in row if not 0 <= t < svc.info.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"token id {bad} is not in the model's {svc.info.vocab_size}-token vocabulary", param="input"
                )
    window = svc.info.max_tokens
    for i, row in enumerate(ids):
        if len(row) + 2 > window:
            raise ContextLengthExceeded(
                f"input {i} is {len(row) + 2} tokens with [CLS] and [SEP]; {svc.name}'s window is {window} tokens",
                param="input",
            )
    return [svc.tokenizer.wrap(row) for row in ids]


def _check_dimensions(body: dict[str, Any], dim: int, refusal: str) -> None:
    """``dimensions``, when given, must be the model's own size: a 400 saying ``refusal`` for
    another size, and saying what it must be for a value that is not an integer (round 31: a
    string or a boolean got ``refusal``, which named the size it seemed to have)."""
    dims = body.get("dimensions")
    if dims is None:
        return
    if type(dims) is not int:
        raise InvalidRequest(
            f"'dimensions' must be an integer ({dim}), not {json.dumps(dims)[:40]}", param="dimensions"
        )
    if dims != dim:
        raise InvalidRequest(refusal, param="dimensions")


def parse_openai(body: Any, gw: Gateway) -> EmbedRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    check_fields(body, "embeddings", gw.cfg.server.ignored_fields)
    model = model_field(body)
    svc = _service(gw, model)
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if not isinstance(fmt, str) or fmt not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    assert svc.info is not None
    _check_dimensions(
        body,
        svc.info.dim,
        f"'dimensions' is not supported by {svc.name} except its own size ({svc.info.dim}): "
        "its vectors are not trained to be truncated",
    )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", param="user")
    if "input" not in body:
        raise InvalidRequest("'input' is required", param="input")
    return EmbedRequest(model, svc.name, parse_inputs(body["input"], svc), fmt, "openai")


def parse_ollama(body: Any, gw: Gateway) -> EmbedRequest:
    """Ollama's ``/api/embed``: ``model``, ``input`` (string or list), ``truncate: false`` only,
    ``keep_alive`` accepted as a no-op (the ladder, not the client, moves the service), and no
    ``options``."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    for name in body:
        if name not in ("model", "input", "truncate", "keep_alive", "options", "dimensions"):
            raise InvalidRequest(f"unknown field '{name}'", param=name)
    if body.get("options") not in (None, {}):
        raise InvalidRequest(
            "'options' are not supported for embeddings (the service's placement and batching are spillover's)",
            param="options",
        )
    if body.get("truncate") not in (None, False):
        raise InvalidRequest(
            "'truncate' is not supported: an input longer than the window is refused, never cut", param="truncate"
        )
    model = model_field(body)
    svc = _service(gw, model)
    assert svc.info is not None
    _check_dimensions(body, svc.info.dim, f"'dimensions' must be {svc.info.dim} for {svc.name}")
    if "input" not in body:
        raise InvalidRequest("'input' is required", param="input")
    return EmbedRequest(model, svc.name, parse_inputs(body["input"], svc), "float", "ollama")


def parse_ollama_legacy(body: Any, gw: Gateway) -> EmbedRequest:
    """Ollama's older ``/api/embeddings`` (the ollama client's ``embeddings()``): ``model`` and
    one ``prompt`` string, answered ``{"embedding": [...]}``; otherwise as ``/api/embed``."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    for name in body:
        if name not in ("model", "prompt", "keep_alive", "options"):
            raise InvalidRequest(f"unknown field '{name}'", param=name)
    if not isinstance(body.get("prompt"), str):
        raise InvalidRequest("'prompt' must be a string", param="prompt")
    req = parse_ollama({"model": body.get("model"), "input": body["prompt"], "options": body.get("options")}, gw)
    return dataclasses.replace(req, shape="ollama-legacy")


def _service(gw: Gateway, model: str) -> EmbeddingsService:
    from spillover.runtime.embeddings import EmbeddingsService

    svc = gw.services[gw.registry.resolve(model, "embeddings").id]
    assert isinstance(svc, EmbeddingsService)
    return svc


def encode_answer(rid: str, req: EmbedRequest, res: EmbedResult) -> Encoded:
    """Rules 2-4: the whole answer."""
    rows = [res.data[i * res.dim * 4 : (i + 1) * res.dim * 4] for i in range(res.n)]
    sp = {
        "request_id": rid,
        "route": res.lane,
        "degraded": res.lane != "gpu",
        "reason": res.reason,
        "model": req.service,
        "attempts": res.attempts,
    }
    if req.shape == "ollama-legacy":
        doc: dict[str, Any] = {"embedding": list(struct.unpack(f"<{res.dim}f", rows[0])), "spillover": sp}
    elif req.shape == "ollama":
        doc = {
            "model": req.model,
            "embeddings": [list(struct.unpack(f"<{res.dim}f", r)) for r in rows],
            "prompt_eval_count": res.prompt_tokens,
            "spillover": sp,
        }
    else:
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": (
                    base64.b64encode(r).decode("ascii")
                    if req.encoding_format == "base64"
                    else list(struct.unpack(f"<{res.dim}f", r))
                ),
            }
            for i, r in enumerate(rows)
        ]
        doc = {
            "object": "list",
            "data": data,
            "model": req.service,
            "usage": {"prompt_tokens": res.prompt_tokens, "total_tokens": res.prompt_tokens},
            "spillover": sp,
        }
    return Encoded(200, [jsonout.dumps(doc)], signal_headers(sp), JSON)


def encode_error(err: SpilloverError, rid: str, *, shape: str) -> Encoded:
    from spillover.http.ollama import ollama_error_body

    e = to_http(err, rid)
    body = e.body if shape == "openai" else ollama_error_body(err)
    headers = {"X-Spillover-Request-Id": rid, "X-Spillover-Route": "none", **e.headers}
    return Encoded(e.status, [json.dumps(body).encode()], headers, JSON, error=e.body)


async def _execute(
    gw: Gateway, rid: str, req: EmbedRequest, attempt: int, on_move: OnMove, emit: Emit | None
) -> Encoded:
    svc = _service(gw, req.model)
    res = await svc.embed(rid, req.inputs, attempt=attempt, on_move=on_move)
    return encode_answer(rid, req, res)


def embedding_endpoints(gw: Gateway) -> list[UnaryEndpoint]:
    """The unary endpoints the request service runs (and replays after a restart)."""
    out = []
    shapes = (
        ("embeddings", parse_openai, "openai"),
        ("ollama-embed", parse_ollama, "ollama"),
        ("ollama-embeddings", parse_ollama_legacy, "ollama"),
    )
    for name, parse, shape in shapes:
        out.append(
            UnaryEndpoint(
                name=name,
                kind="embeddings",
                parse=functools.partial(parse, gw=gw),
                stored=(lambda body: stored(body, "embeddings")) if shape == "openai" else dict,
                hold_place=lambda req, rid, deadline_s: gw.services[req.service].hold_place(rid, deadline_s=deadline_s),
                release_place=lambda req, rid: gw.services[req.service].release_place(rid),
                execute=functools.partial(_execute, gw),
                error=functools.partial(encode_error, shape=shape),
            )
        )
    return out
