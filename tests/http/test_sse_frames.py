"""A streamed token's SSE frame: the fast path (bytes around the text made once) is the
chunk the general path builds, byte for byte, for any text and either API shape."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from spillover.http.openai import SseEncoding


def encoding(kind: str, model: list[str]) -> SseEncoding:
    req = SimpleNamespace(kind=kind, forced_tool=None)
    run: Any = SimpleNamespace(req=req, rid="0123abcd", created_s=1796000000, served_model=lambda: model[0])
    return SseEncoding(run)


@given(text=st.text(), kind=st.sampled_from(["chat", "completion"]))
def test_a_text_frame_is_the_chunk_byte_for_byte(text: str, kind: str) -> None:
    enc = encoding(kind, ["smollm2"])
    general = enc.chunk({"content": text} if kind == "chat" else text)
    assert enc._text(text) == general
    assert enc._text(text) == general  # made once, used again


def test_the_frame_follows_the_served_model() -> None:
    """A failover to a fallback model changes the model named in every later frame."""
    model = ["smollm2"]
    enc = encoding("chat", model)
    assert b'"model":"smollm2"' in enc._text("a")
    model[0] = 'fallback "small"'
    assert enc._text("a\n") == enc.chunk({"content": "a\n"})
    assert b'"model":"fallback \\"small\\""' in enc._text("b")
