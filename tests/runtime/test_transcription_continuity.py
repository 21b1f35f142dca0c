"""runtime.transcription rule 5: a streamed transcription hands each new segment on once; after
a failover the replay's first segments must equal those already sent."""

from __future__ import annotations

from typing import Any

import pytest

from spillover.errors import FailoverInterrupted
from spillover.runtime.events import AudioInfo, Segment
from spillover.runtime.transcription import _Continuity


def _seg(i: int, text: str | None = None) -> Segment:
    return Segment({"id": i, "start": float(i), "end": i + 1.0, "text": text or f" s{i}", "tokens": [i]})


def _collector() -> tuple[_Continuity, list[tuple[int, str, str, int]]]:
    sent: list[tuple[int, str, str, int]] = []

    def on_segment(seg: dict[str, Any], lane: str, reason: str, attempt: int) -> None:
        sent.append((seg["id"], lane, reason, attempt))

    return _Continuity(on_segment), sent


def test_new_segments_are_handed_on_once_and_a_same_replay_continues() -> None:
    c, sent = _collector()
    c(AudioInfo("en", 10.0), lane="gpu", reason="fits", attempt=1)  # not a segment: ignored
    for i in range(3):
        c(_seg(i), lane="gpu", reason="fits", attempt=1)
    for i in range(5):  # the CPU replay decodes from the start: 0-2 equal, 3-4 new
        c(_seg(i), lane="cpu", reason="failover:oom", attempt=2)
    assert sent == [(0, "gpu", "fits", 1), (1, "gpu", "fits", 1), (2, "gpu", "fits", 1),
                    (3, "cpu", "failover:oom", 2), (4, "cpu", "failover:oom", 2)]  # fmt: skip


@pytest.mark.parametrize("field", ["text", "start", "end", "tokens"])
def test_a_replay_that_differs_from_what_was_sent_ends_the_stream(field: str) -> None:
    c, sent = _collector()
    c(_seg(0), lane="gpu", reason="fits", attempt=1)
    c(_seg(1), lane="gpu", reason="fits", attempt=1)
    c(_seg(0), lane="cpu", reason="failover:oom", attempt=2)
    changed = dict(_seg(1).data)
    changed[field] = [99] if field == "tokens" else (" other" if field == "text" else 42.0)
    with pytest.raises(FailoverInterrupted, match="segment 1"):
        c(Segment(changed), lane="cpu", reason="failover:oom", attempt=2)
    assert [s[0] for s in sent] == [0, 1]


def test_a_replay_before_anything_was_sent_hands_everything_on() -> None:
    c, sent = _collector()
    for i in range(2):
        c(_seg(i), lane="cpu", reason="failover:exited", attempt=2)
    assert [(s[0], s[3]) for s in sent] == [(0, 2), (1, 2)]


def _transcribe(replays: list[list[Segment]]) -> Any:
    """``TranscriptionService.transcribe`` over a stand-in ``serve`` whose attempts decode
    ``replays`` (each attempt's segments, the last one's the answer); what it returns or raises."""
    import asyncio
    from types import SimpleNamespace

    from spillover.runtime.events import Done
    from spillover.runtime.service import Served
    from spillover.runtime.transcription import TranscriptionService

    streamed: list[str] = []

    async def serve(rid: str, msg: dict[str, Any], *, on_part: Any, **_: Any) -> Served:
        parts: list[Any] = []
        for n, segments in enumerate(replays, start=1):
            lane = "gpu" if n == 1 else "cpu"
            parts = [AudioInfo("en", 10.0), *segments]
            for p in parts:
                on_part(p, lane=lane, reason="fits", attempt=n)
        return Served(parts, Done("stop", 0, 0.0, 0.0), "cpu" if len(replays) > 1 else "gpu", "fits", len(replays))

    svc = SimpleNamespace(cfg=SimpleNamespace(beam_size=1, max_audio_s=60), predicted_bytes=lambda s: 0, serve=serve)

    async def main() -> Any:
        return await TranscriptionService.transcribe(
            svc,  # type: ignore[arg-type]
            "r1",
            {},
            10.0,
            attempt=0,
            on_move=lambda *a: None,  # type: ignore[arg-type,return-value]
            on_segment=lambda seg, *a: streamed.append(seg["text"]),
        )

    return asyncio.run(main()), streamed


@pytest.mark.parametrize("replayed", [0, 1, 2])
def test_a_replay_that_ends_before_what_was_sent_ends_the_stream(replayed: int) -> None:
    """The GPU streamed three segments and died; the CPU replay decodes the same first ones
    and then ends (it took the tail for silence): the answer would lack text the client has."""
    with pytest.raises(FailoverInterrupted, match=f"ended after {replayed} segments, and 3 were already sent"):
        _transcribe([[_seg(0), _seg(1), _seg(2)], [_seg(i) for i in range(replayed)]])


def test_a_replay_as_long_as_what_was_sent_or_longer_is_the_answer() -> None:
    for replay in ([_seg(0), _seg(1)], [_seg(0), _seg(1), _seg(2)]):
        transcript, streamed = _transcribe([[_seg(0), _seg(1)], replay])
        assert [s["text"] for s in transcript.segments] == [s.data["text"] for s in replay]
        assert streamed == [s.data["text"] for s in replay]
