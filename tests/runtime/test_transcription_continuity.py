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
