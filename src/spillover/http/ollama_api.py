"""The routes of Ollama's API (see ``http.ollama`` for the request and answer shapes).

``/api/tags`` lists the served model, ``/api/ps`` says where it is loaded *now* (one entry
with ``size`` and ``size_vram``, plus spillover's own ``workers`` list: the GPU worker, the
CPU replica, their state and bytes), ``/api/show`` its template and GGUF facts,
``/api/version`` spillover's version. ``/api/embed`` runs on the embeddings service
(``http.embeddings``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import os
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spillover.errors import InvalidRequest, NotFound, to_http
from spillover.http.ollama import (
    NdjsonEncoding,
    check_body,
    created_at,
    ollama_error_body,
    parse_ollama_chat,
    parse_ollama_generate,
    unloads,
)
from spillover.http.routes import Handler, plain_json
from spillover.runtime.registry import ENDPOINT_OF_KIND
from spillover.runtime.requests import Endpoint

if TYPE_CHECKING:
    from spillover.runtime.chat import ChatModel
    from spillover.runtime.embeddings import EmbeddingsService
    from spillover.runtime.gateway import Gateway

__all__ = ["ollama_endpoints", "ollama_error", "ollama_routes"]

Generate = Callable[..., Awaitable[Response]]  # app.generate(request, endpoint, refuse, read)


class _LoadOnly(Exception):
    """An Ollama request that asks only to load its model: nothing to run or journal."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__("load")
        self.answer = answer


SHOW_FIELDS = frozenset({"model", "name", "verbose"})  # /api/show's (Ollama's "name" is the older "model")
FAR_FUTURE = "2999-12-31T23:59:59Z"  # expires_at: spillover does not unload on a timer
UNLOAD_NOTICE = "the model stays loaded: spillover keeps its models while it runs and moves them under pressure"
OLLAMA_PREFIX = "/api/"  # every Ollama route's path begins so: an error there is in Ollama's shape


def ollama_error(err: BaseException, rid: str, *, generate: bool = False) -> Response:
    """An error in Ollama's shape, with the same status and headers as the OpenAI routes (any
    exception: one that is not a ``SpilloverError`` is an ``internal_error``); ``generate``:
    an ``/api/generate`` request's (its prompt is ``prompt``)."""
    e = to_http(err)
    headers = dict(e.headers) | {"X-Spillover-Request-Id": rid, "X-Spillover-Route": "none"}
    return JSONResponse(ollama_error_body(err, generate=generate), status_code=e.status, headers=headers)


def ollama_endpoints(gw: Gateway) -> list[Endpoint]:
    """The request service's endpoints for /api/chat and /api/generate."""
    name = gw.cfg.model.name
    return [
        Endpoint(
            "ollama-chat",
            parse=functools.partial(parse_ollama_chat, default_model=name),
            stored=dict,  # validated field by field: journaled whole
            encoding=functools.partial(NdjsonEncoding, generate=False),
        ),
        Endpoint(
            "ollama-generate",
            parse=functools.partial(parse_ollama_generate, default_model=name),
            stored=dict,  # validated field by field: journaled whole
            encoding=functools.partial(NdjsonEncoding, generate=True),
        ),
    ]


def _details(chat: ChatModel) -> dict[str, Any]:
    import gguf

    spec = chat.spec
    meta = chat.tokenizer.metadata if chat.tokenizer is not None else {}
    quant = ""
    if spec is not None and spec.file_type >= 0:
        try:
            quant = gguf.LlamaFileType(spec.file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            quant = str(spec.file_type)
    family = spec.arch if spec is not None else ""
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": str(meta.get("general.size_label", "")),
        "quantization_level": quant,
    }


@functools.cache
def _digest(path: str) -> str:
    from spillover.engine.llama_engine import file_digest

    return file_digest(path)


EMBED_DETAILS = {"format": "onnx", "family": "bert", "families": ["bert"], "quantization_level": "int8"}


def embed_show(svc: EmbeddingsService) -> dict[str, Any]:
    """/api/show of an embeddings service (Ollama's ``embedding`` capability; no template)."""
    i = svc.info
    info: dict[str, Any] = {"general.architecture": "bert", "general.name": svc.name}
    if i is not None:
        info |= {"bert.embedding_length": i.dim, "bert.block_count": i.n_layers, "bert.context_length": i.max_tokens,
                 "bert.attention.head_count": i.n_heads, "bert.feed_forward_length": i.intermediate}  # fmt: skip
    return {
        "modelfile": f"FROM {svc.model_dir}\n",
        "parameters": "",
        "template": "",
        "details": EMBED_DETAILS,
        "model_info": info,
        "capabilities": ["embedding"],
        "modified_at": created_at(),
    }


def ollama_routes(
    gw: Gateway,
    generate: Generate,
    guarded: Callable[[Handler], Handler],
    read_json: Callable[[Request], Awaitable[Any]],
) -> list[Route]:
    """The /api routes; ``generate`` runs a request through the service, ``guarded`` checks
    the API key as on every other route and answers errors in Ollama's shape, ``read_json``
    reads a body as every route does (``max_body_bytes``, ``body_timeout_s``)."""

    async def model_entry(chat: ChatModel) -> dict[str, Any]:
        digest = await asyncio.to_thread(_digest, chat.model_path)
        spec = chat.spec
        mtime = dt.datetime.fromtimestamp(os.stat(chat.model_path).st_mtime, dt.UTC)
        return {
            "name": chat.name,
            "model": chat.name,
            "modified_at": mtime.isoformat().replace("+00:00", "Z"),
            "size": spec.file_bytes if spec else 0,
            "digest": digest,
            "details": _details(chat),
        }

    def unknown_model(asked: Any) -> NotFound:
        listed = [svc.name for svc in gw.embedding_services() if svc.model_dir]
        served = ", ".join(repr(name) for name in [*(c.name for c in gw.chats), *listed])
        return NotFound(f"model {asked!r} not found; this server's models are {served}", code="model_not_found")

    def load_reader(
        field: str, stand_in: Any, parse: Callable[[Any, str], Any], empty: dict[str, Any]
    ) -> Callable[[Request], Awaitable[Any]]:
        """The body, read as ``generate`` reads it; a request whose ``field`` is missing or
        empty (``messages: []``, ``prompt: ""``) is Ollama's load request: the ollama CLI's
        preload before its prompt. It is answered at once (``done_reason: "load"``) for a
        model this server serves, and runs nothing: spillover keeps its models loaded. A
        ``keep_alive`` of 0 (``ollama stop``, for a chat or an embeddings model: ``/api/ps``
        lists both) unloads nothing either: it is answered ``done_reason: "unload"``, as
        Ollama's, with a ``spillover.notice`` that says so. Its other fields are checked as a
        run's are (``parse`` with ``stand_in`` as its ``field``): a refused option is refused."""

        async def read(request: Request) -> Any:
            body = await read_json(request)
            if isinstance(body, dict) and body.get(field) in (None, "", []):
                parse({**body, field: stand_in}, gw.cfg.model.name)  # its 400s, as a run's
                asked = str(body.get("model") or gw.cfg.model.name)  # as the request's own parse defaults it
                unload = unloads(body.get("keep_alive"))
                listed = gw.registry.lookup(asked) if unload else None  # `ollama stop` of any model /api/ps lists
                if listed is not None and listed.kind == "embeddings":
                    name = listed.id
                else:  # an unknown model's 404, another kind's 400, as a run's
                    name = gw.chat_model(gw.registry.resolve(asked, "chat").id).name
                answer = {"model": name, "created_at": created_at(), **empty, "done_reason": "load", "done": True}
                if unload:  # `ollama stop`: answered as Ollama's, and told the truth
                    answer["done_reason"] = "unload"
                    answer["spillover"] = {"notice": UNLOAD_NOTICE}
                raise _LoadOnly(answer)
            return body

        return read

    async def load_or_run(request: Request, endpoint: str, read: Callable[[Request], Awaitable[Any]]) -> Response:
        try:
            refuse = functools.partial(ollama_error, generate=endpoint == "ollama-generate")
            return await generate(request, endpoint, refuse, read)
        except _LoadOnly as load:
            return plain_json(load.answer)

    async def chat(request: Request) -> Response:
        stand_in = [{"role": "user", "content": "."}]
        read = load_reader("messages", stand_in, parse_ollama_chat, {"message": {"role": "assistant", "content": ""}})
        return await load_or_run(request, "ollama-chat", read)

    async def gen(request: Request) -> Response:
        read = load_reader("prompt", ".", parse_ollama_generate, {"response": ""})
        return await load_or_run(request, "ollama-generate", read)

    async def service_entry(svc: EmbeddingsService) -> dict[str, Any]:
        onnx = os.path.join(svc.model_dir, "model.onnx")
        digest = await asyncio.to_thread(_digest, onnx)
        mtime = dt.datetime.fromtimestamp(os.stat(onnx).st_mtime, dt.UTC)
        return {
            "name": svc.name,
            "model": svc.name,
            "modified_at": mtime.isoformat().replace("+00:00", "Z"),
            "size": svc.info.file_bytes if svc.info else 0,
            "digest": digest,
            "details": EMBED_DETAILS,
        }

    @guarded
    async def tags(request: Request) -> Response:
        extra = [await service_entry(svc) for svc in gw.embedding_services() if svc.model_dir]
        return plain_json({"models": [*[await model_entry(c) for c in gw.chats], *extra]})

    async def running(chat: ChatModel) -> dict[str, Any] | None:
        """A chat model's /api/ps entry: where its workers hold it (None: nowhere loaded)."""
        workers = []
        vram = host = 0
        ready_lanes = set()
        whole = chat.memory.weights_bytes() if chat.memory else 0
        for s in chat.supervisors:
            w = s.worker.statistics()
            if w.lane == "gpu":
                on_device, on_host = whole, 0
            elif w.lane == "split" and chat.memory is not None and chat.profile is not None:
                # its last layers on the device, the rest on the host (llama.cpp's n_gpu_layers)
                on_device = dataclasses.replace(chat.memory, n_gpu_layers=chat.profile.split_layers).weights_bytes()
                on_host = max(0, whole - on_device)
            elif chat.readiness is not None:  # what its replica holds now (runtime.readiness): a
                # mode that keeps no model (on_demand) holds nothing until a failover loads it
                on_device, on_host = 0, chat.readiness.host_bytes(s.worker)
            else:
                on_device, on_host = 0, chat.cpu_slot_bytes
            ready = w.state == "ready"
            if ready:
                vram += on_device
                host += on_host
                ready_lanes.add(w.lane)
            workers.append({"worker_id": w.worker_id, "lane": w.lane, "device": w.device, "state": w.state,
                            "size": on_device + on_host if ready else 0})  # fmt: skip
        if not (vram or host):
            return None
        # Where it runs: the resident worker, else the split one, else the CPU replica (a CPU
        # replica beside a GPU worker is a second copy, not a split of the model).
        placement = next(lane for lane in ("gpu", "split", "cpu") if lane in ready_lanes or lane == "cpu")
        return await model_entry(chat) | {
            "size": vram + host,
            "size_vram": vram,
            "expires_at": FAR_FUTURE,
            "context_length": chat.context_cap_tokens(gw.device is not None),
            "spillover": {"placement": placement, "workers": workers, "mode": gw.status()["mode"]},
        }

    async def service_running(svc: EmbeddingsService) -> dict[str, Any] | None:
        """An embeddings service's /api/ps entry, as a chat model's: its GPU worker holds its
        weights on the device, its CPU replica what its readiness holds now (None: neither)."""
        workers = []
        vram = host = 0
        for s in svc.supervisors():
            w = s.worker.statistics()
            on_device = svc.weights_bytes() if w.lane == "gpu" else 0
            on_host = 0
            if w.lane != "gpu":
                held = svc.readiness.host_bytes(s.worker) if svc.readiness is not None else None
                on_host = svc.host_weights_bytes() if held is None else held
            ready = w.state == "ready"
            vram, host = vram + (on_device if ready else 0), host + (on_host if ready else 0)
            workers.append({"worker_id": w.worker_id, "lane": w.lane, "device": w.device, "state": w.state,
                            "size": on_device + on_host if ready else 0})  # fmt: skip
        if not (vram or host):
            return None
        return await service_entry(svc) | {
            "size": vram + host,
            "size_vram": vram,
            "expires_at": FAR_FUTURE,
            "context_length": svc.info.max_tokens if svc.info else 0,
            "spillover": {"placement": "gpu" if vram else "cpu", "workers": workers, "mode": gw.status()["mode"]},
        }

    @guarded
    async def ps(request: Request) -> Response:
        chats = [e for c in gw.chats if (e := await running(c)) is not None]
        services = [e for svc in gw.embedding_services() if svc.model_dir and (e := await service_running(svc))]
        return plain_json({"models": [*chats, *services]})

    @guarded
    async def show(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise InvalidRequest('the body must be a JSON object naming the model: {"model": ...}')
        check_body(body, SHOW_FIELDS)
        asked = body.get("model") or body.get("name")
        if not isinstance(asked, str) or not asked:
            raise InvalidRequest("'model' is required: the name of a model this server lists", param="model")
        served = gw.registry.lookup(asked)  # an id or an alias; Ollama's clients send "name:latest"
        listed = {svc.name: svc for svc in gw.embedding_services() if svc.model_dir}  # as /api/tags lists them
        if served is not None and served.id in listed:
            return plain_json(embed_show(listed[served.id]))
        if served is not None and served.kind == "transcription":  # a kind Ollama's API does not have
            raise NotFound(
                f"model {asked!r} serves transcription, which Ollama's API has no model kind for:"
                f" send it to {ENDPOINT_OF_KIND['transcription']}",
                code="model_not_found",
            )
        if served is None or served.kind != "chat":
            raise unknown_model(gw.registry.named(asked))
        chat = gw.chat_model(served.id)
        tok = chat.tokenizer
        meta = tok.metadata if tok is not None else {}
        info = {k: v for k, v in meta.items() if not k.startswith("tokenizer.") and len(str(v)) < 512}
        return plain_json(
            {
                "modelfile": f"FROM {chat.model_path}\n",
                "parameters": "\n".join(f"{k} {v}" for k, v in (("temperature", 0.8), ("top_k", 40), ("top_p", 0.9))),
                "template": chat.tokenizer.chat_template if chat.tokenizer is not None else "",
                "details": _details(chat),
                "model_info": info,
                # Ollama's clients send tools only to a model that lists them (``prepare`` rule)
                "capabilities": ["completion", "tools"] if tok is not None and tok.takes_tools() else ["completion"],
                "modified_at": created_at(),
            }
        )

    async def version(request: Request) -> Response:
        return plain_json({"version": metadata.version("spillover")})

    async def embed(request: Request) -> Response:
        return await generate(request, "ollama-embed", ollama_error)

    async def embeddings(request: Request) -> Response:  # the older route (the ollama client's embeddings())
        return await generate(request, "ollama-embeddings", ollama_error)

    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", gen, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/version", version, methods=["GET"]),
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embeddings, methods=["POST"]),
    ]
