"""The model registry: every model id (and alias) the gateway serves, and which service
and kind answers it.

Rules:

1. One id names one service: the chat model (``[model]`` and its aliases) and each
   ``[[services]]`` entry with its aliases. ``config`` refuses duplicates (the chat
   fallback's name included: clients see it on fallback answers, but it is not requestable).
2. An unknown id is a 404 ``model_not_found`` whose message lists what is served; an id of
   another kind (an embeddings model sent to chat) is a 400 naming the right endpoint. An id
   with Ollama's default tag (``name:latest``, what Ollama's clients send for ``name``) is
   the id without it, unless the tagged id itself is served.
3. ``/v1/models`` lists every service once, by its canonical id, with its kind and aliases.
4. ``/v1/models/{id}`` answers one of them by its id or an alias (the entry names the canonical
   id, as OpenAI's answers the model's own).
"""

from __future__ import annotations

from dataclasses import dataclass

from spillover.config import Config
from spillover.errors import InvalidRequest, NotFound

__all__ = ["ENDPOINT_OF_KIND", "ModelRegistry", "ServedModel"]

DEFAULT_TAG = ":latest"  # Ollama's tag for a name without one (rule 2)

ENDPOINT_OF_KIND = {
    "chat": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
    "transcription": "/v1/audio/transcriptions",
}


@dataclass(frozen=True)
class ServedModel:
    """One service as clients name it."""

    id: str
    kind: str
    aliases: tuple[str, ...]
    priority: str


class ModelRegistry:
    """Model id -> service (rules in the module docstring)."""

    def __init__(self, cfg: Config) -> None:
        self.models: list[ServedModel] = [
            ServedModel(cfg.model.name, "chat", tuple(cfg.model.aliases), "interactive"),
            *(ServedModel(s.name, s.kind, tuple(s.aliases), s.priority) for s in cfg.services),
        ]
        self._by_id: dict[str, ServedModel] = {}
        for m in self.models:
            for mid in (m.id, *m.aliases):
                self._by_id[mid] = m

    def __repr__(self) -> str:
        return f"<ModelRegistry {', '.join(m.id for m in self.models)}>"

    def lookup(self, model_id: str) -> ServedModel | None:
        """The service ``model_id`` (an id or an alias, with Ollama's default tag or not) names, of any kind."""
        return self._by_id.get(self.named(model_id))

    def resolve(self, model_id: str, kind: str) -> ServedModel:
        """The service that answers ``model_id`` on an endpoint of ``kind`` (rule 2)."""
        m = self._found(model_id)
        if m.kind != kind:
            raise InvalidRequest(
                f"model {model_id!r} serves {m.kind}, not {kind}: send it to {ENDPOINT_OF_KIND[m.kind]}",
                param="model",
                code="model_not_supported",
            )
        return m

    def named(self, model_id: str) -> str:
        """``model_id`` as it is served: without Ollama's default tag when only that is (rule 2)."""
        if model_id not in self._by_id and model_id.endswith(DEFAULT_TAG):
            return model_id.removesuffix(DEFAULT_TAG)
        return model_id

    def describe(self) -> str:
        """Every served id with its kind and aliases, for error messages."""
        parts = []
        for m in self.models:
            alias = f", also {', '.join(repr(a) for a in m.aliases)}" if m.aliases else ""
            parts.append(f"{m.id!r} ({m.kind}{alias})")
        return "; ".join(parts)

    def listing(self) -> list[dict[str, object]]:
        """``/v1/models`` entries (rule 3)."""
        return [self.entry(m) for m in self.models]

    @staticmethod
    def entry(m: ServedModel) -> dict[str, object]:
        """One model as ``/v1/models`` lists it and ``/v1/models/{id}`` answers it."""
        return {
            "id": m.id,
            "object": "model",
            "created": 0,
            "owned_by": "spillover",
            "spillover": {"kind": m.kind, "aliases": list(m.aliases), "priority": m.priority},
        }

    def retrieve(self, model_id: str) -> dict[str, object]:
        """``GET /v1/models/{id}`` (openai-python's ``models.retrieve``): the entry of the
        service an id or alias names, of any kind (rule 4); 404 ``model_not_found`` as rule 2."""
        return self.entry(self._found(model_id))

    def _found(self, model_id: str) -> ServedModel:
        m = self.lookup(model_id)
        if m is None:
            raise NotFound(
                f"model {model_id!r} does not exist; this server serves {self.describe()}",
                param="model",
                code="model_not_found",
            )
        return m
