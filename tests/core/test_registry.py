"""runtime.registry and [[services]] config: model ids, aliases, kinds and their errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from spillover.config import load_config
from spillover.errors import ConfigError, InvalidRequest, NotFound
from spillover.runtime.registry import ModelRegistry


def _write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_default_serves_chat_embeddings_and_transcription_with_aliases() -> None:
    """With no config, chat, the embeddings and the transcription service are served, each
    under its aliases (OpenAI's "whisper-1" names the transcription model)."""
    reg = ModelRegistry(load_config())
    assert [(m["id"], m["spillover"]["kind"]) for m in reg.listing()] == [  # type: ignore[index]
        ("smollm2-135m-instruct", "chat"),
        ("bge-small-en", "embeddings"),
        ("whisper-tiny.en", "transcription"),
    ]
    assert reg.resolve("smollm2", "chat").id == "smollm2-135m-instruct"
    assert reg.resolve("bge-small", "embeddings").id == "bge-small-en"
    assert reg.resolve("whisper-1", "transcription").id == "whisper-tiny.en"


def test_ollamas_default_tag_names_the_untagged_model() -> None:
    """Ollama's clients send ``name:latest`` for ``name``: it is the same model, on every
    kind; another tag is not, and the kind rules are unchanged."""
    reg = ModelRegistry(load_config())
    assert reg.resolve("smollm2:latest", "chat").id == "smollm2-135m-instruct"
    assert reg.resolve("bge-small-en:latest", "embeddings").id == "bge-small-en"
    assert reg.resolve("whisper-1:latest", "transcription").id == "whisper-tiny.en"
    with pytest.raises(NotFound):
        reg.resolve("smollm2:7b", "chat")
    with pytest.raises(NotFound):
        reg.resolve(":latest", "chat")
    with pytest.raises(InvalidRequest):
        reg.resolve("bge-small-en:latest", "chat")


def test_another_chat_file_is_served_under_its_own_name(tmp_path: Path) -> None:
    """--model (or [model].path) with another GGUF: its id is the file's name and it has no
    alias (it is not SmolLM2, and "smollm2" must not reach it); a name or aliases given win."""
    llama, x = tmp_path / "Llama-3.2-1B.Q4_K_M.gguf", tmp_path / "x.gguf"
    llama.write_bytes(b"GGUF")
    x.write_bytes(b"GGUF")
    reg = ModelRegistry(load_config(None, {"model": {"path": str(llama)}}))
    assert reg.listing()[0]["id"] == "Llama-3.2-1B.Q4_K_M"
    with pytest.raises(NotFound):
        reg.resolve("smollm2", "chat")
    named = load_config(None, {"model": {"path": str(x), "name": "mine"}})
    assert (named.model.name, named.model.aliases) == ("mine", ())
    toml = _write(tmp_path, f'[model]\npath = "{x}"\naliases = ["x1"]\n')
    assert (load_config(toml).model.name, load_config(toml).model.aliases) == ("x", ("x1",))
    assert load_config().model.aliases == ("smollm2",)


def test_unknown_model_is_404_listing_every_served_id() -> None:
    """An unknown id is model_not_found, and the message names every id and alias served."""
    with pytest.raises(NotFound) as e:
        ModelRegistry(load_config()).resolve("gpt-9", "chat")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    for name in ("smollm2-135m-instruct", "smollm2", "bge-small-en", "bge-small"):
        assert repr(name) in e.value.message


def test_a_model_of_another_kind_is_a_400_naming_the_endpoint() -> None:
    """An embeddings model sent to chat (and the reverse) names the endpoint that serves it."""
    reg = ModelRegistry(load_config())
    with pytest.raises(InvalidRequest, match="/v1/embeddings"):
        reg.resolve("bge-small-en", "chat")
    with pytest.raises(InvalidRequest, match="/v1/chat/completions"):
        reg.resolve("smollm2", "embeddings")


def test_services_can_be_turned_off(tmp_path: Path) -> None:
    """``services = []`` serves the chat model alone."""
    cfg = load_config(_write(tmp_path, "services = []\n"))
    assert cfg.services == ()
    assert [m.id for m in ModelRegistry(cfg).models] == ["smollm2-135m-instruct"]


def test_a_second_chat_model_is_a_chat_service_without_the_embeddings_aliases(tmp_path: Path) -> None:
    """A [[services]] chat entry is served by its id; the default entry's aliases (which name
    the embeddings model) are not given to it."""
    cfg = load_config(_write(tmp_path, '[[services]]\nkind = "chat"\nname = "tiny"\n'))
    assert cfg.services[0].aliases == ()
    reg = ModelRegistry(cfg)
    assert reg.resolve("tiny", "chat").id == "tiny"
    with pytest.raises(InvalidRequest, match="/v1/chat/completions"):
        reg.resolve("tiny", "embeddings")


@pytest.mark.parametrize(
    ("table", "name", "aliases", "priority"),
    [
        ('kind = "transcription"\n', "whisper-tiny.en", ("whisper-1",), "interactive"),
        ('kind = "transcription"\nname = "t"\n', "t", (), "interactive"),
        ("", "bge-small-en", ("bge-small",), "batch"),
        ('name = "e2"\n', "e2", ("bge-small",), "batch"),
        ('path = "/models/e5-small/"\n', "e5-small", (), "batch"),
        ('kind = "chat"\npath = "/models/Qwen2-0.5B.Q4_0.gguf"\n', "Qwen2-0.5B.Q4_0", (), "interactive"),
        ('kind = "chat"\n', "smollm2-135m-instruct", ("smollm2",), "interactive"),
    ],
)
def test_an_entry_without_a_name_is_served_under_its_models(
    table: str, name: str, aliases: tuple[str, ...], priority: str
) -> None:
    """A [[services]] entry without a name was served as "bge-small-en" whatever its kind or file:
    a transcription entry beside the default embeddings one was refused as that id served
    twice, and another embeddings model answered to bge-small's names. Its name is now its own
    model's: the file's or folder's, else its kind's packaged model's with that model's aliases."""
    from spillover.config import _services

    svc = _services([tomllib.loads(table)])[0]
    assert (svc.name, svc.aliases, svc.priority) == (name, aliases, priority)


def test_the_default_entries_listed_without_names_start(tmp_path: Path) -> None:
    """The two default services, written as kinds alone, load as the defaults do; a chat entry
    without a name or path is SmolLM2, which [model] already serves, and is refused by that id."""
    cfg = load_config(_write(tmp_path, '[[services]]\nkind = "embeddings"\n[[services]]\nkind = "transcription"\n'))
    assert [(s.name, s.aliases) for s in cfg.services] == [(s.name, s.aliases) for s in load_config().services]
    with pytest.raises(ConfigError, match="'smollm2-135m-instruct' is already served by \\[model\\]"):
        load_config(_write(tmp_path, '[[services]]\nkind = "chat"\n'))


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ('[[services]]\nname = "smollm2"\n', "already served"),
        ('[[services]]\nkind = ["chat"]\n', "kind in \\[\\[services\\]\\] #1 must be a string"),
        ('[[services]]\npath = "/"\n', "gives it no name: set name"),
        ('[[services]]\nname = "a"\n[[services]]\nname = "b"\naliases = ["a"]\n', "already served"),
        ('[[services]]\nkind = "chat"\nname = "x"\npath = "/nonexistent.gguf"\n', "no GGUF file"),
        ('[[services]]\nkind = "chat"\nname = "x"\naliases = ["smollm2"]\n', "already served"),
        ('[[services]]\nkind = "transcription"\nname = "x"\npath = "/nonexistent"\n', "no model.bin"),
        ('[[services]]\nkind = "transcription"\nname = "x"\nbeam_size = 0\n', "beam_size"),
        ('[[services]]\nkind = "music"\nname = "x"\n', "kind must be"),
        ('[[services]]\npriority = "urgent"\n', "priority"),
        ('[[services]]\ncpu = "fallback"\n', "cpu must be"),
        ('[[services]]\ncpu = "none"\ngpu = false\n', "needs a GPU worker or a CPU path"),
        ("[[services]]\nbatch_size = 0\n", ">= 1"),
        ('[[services]]\npath = "/nonexistent"\n', "no model.onnx"),
        ("[[services]]\nunknown = 1\n", "unknown setting"),
        ("services = 3\n", "list of tables"),
    ],
)
def test_bad_services_are_refused_at_start(tmp_path: Path, toml: str, match: str) -> None:
    """Every wrong [[services]] entry is a ConfigError naming what is wrong."""
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, toml))


def test_one_model_is_retrieved_by_id_or_alias_of_any_kind() -> None:
    """``GET /v1/models/{id}`` (openai-python's ``models.retrieve``) was a 404 for every id."""
    reg = ModelRegistry(load_config())
    assert reg.retrieve("whisper-1") == reg.listing()[2]
    assert reg.retrieve("smollm2:latest")["id"] == "smollm2-135m-instruct"
    with pytest.raises(NotFound) as e:
        reg.retrieve("gpt-9")
    assert e.value.code == "model_not_found"
