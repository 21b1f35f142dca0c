"""A model file the gateway cannot read at start is the operator's file, not a bug: whatever
its reader raises (a GGUF header that lies about its layers fails as IndexError, one missing a
key as TypeError or KeyError) is a ConfigError naming the model, its role and the file, which
the start prints in one line (``http.app.GatewayLifespan``)."""

from __future__ import annotations

import pytest

from spillover.config import load_config
from spillover.errors import ConfigError
from spillover.runtime.chat import chat_models


@pytest.mark.parametrize(
    "raised",
    [
        IndexError("list index out of range"),
        TypeError("int() argument must be a string, not 'NoneType'"),
        KeyError("llama.block_count"),
        ValueError("not a GGUF file"),
        OSError("Input/output error"),
    ],
)
def test_whatever_a_model_reader_raises_is_a_config_error_naming_the_model(
    monkeypatch: pytest.MonkeyPatch, raised: Exception
) -> None:
    def reader(path: str) -> None:
        raise raised

    monkeypatch.setattr("spillover.engine.gguf_meta.read_model_spec", reader)
    monkeypatch.setattr("spillover.engine.llama_engine.Tokenizer", lambda path: object())
    chat = chat_models(load_config())[0]
    with pytest.raises(ConfigError) as got:
        chat._read_model("/models/lying.gguf")
    text = str(got.value)
    assert text.startswith(f"chat model {chat.name!r}: /models/lying.gguf cannot be served ({type(raised).__name__}: ")
    assert got.value.__cause__ is raised
    with pytest.raises(ConfigError) as fallback:
        chat._read_model("/f.gguf", "chat model 'x''s CPU fallback model 'y'")
    assert str(fallback.value).startswith("chat model 'x''s CPU fallback model 'y': /f.gguf cannot be served (")
