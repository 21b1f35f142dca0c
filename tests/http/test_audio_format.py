"""http.audio's subtitle writers: SubRip and WebVTT cues from segments."""

from __future__ import annotations

import json

from spillover.http.audio import delta_frame, subtitles

SEGS = [
    {"id": 0, "start": 0.0, "end": 2.5, "text": " Hello there."},
    {"id": 1, "start": 3661.042, "end": 3662.0, "text": " A --> B"},
]


def test_srt_numbers_cues_with_comma_milliseconds() -> None:
    assert subtitles(SEGS, "srt") == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n01:01:01,042 --> 01:01:02,000\nA -> B\n"
    )


def test_vtt_has_its_header_and_dot_milliseconds() -> None:
    assert subtitles(SEGS, "vtt") == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n01:01:01.042 --> 01:01:02.000\nA -> B\n"
    )


def test_no_segments_is_an_empty_file_of_its_kind() -> None:
    assert subtitles([], "srt") == "" and subtitles([], "vtt") == "WEBVTT\n\n"


def test_a_delta_frame_is_one_sse_event() -> None:
    frame = delta_frame(SEGS[0])
    assert frame.startswith(b"data: {") and frame.endswith(b"}\n\n")
    assert b'"type":"transcript.text.delta"' in frame and b'"segment":{"id":0,"start":0.0,"end":2.5}' in frame
    assert b'"spillover"' not in frame
    told = json.loads(delta_frame(SEGS[0], {"route": "cpu"})[len(b"data: ") :])
    assert told["spillover"] == {"route": "cpu"} and told["delta"] == SEGS[0]["text"]
