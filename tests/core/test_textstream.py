"""Stop-string scanning and UTF-8 reassembly across token boundaries."""

from __future__ import annotations

from spillover.engine.textstream import StopScanner


def test_holds_back_possible_stop_prefix_then_releases() -> None:
    """Text that could start a stop string is delivered only once it cannot."""
    s = StopScanner(stops=("END",))
    assert s.feed(b"abc E") == "abc "
    assert s.feed(b"x") == "Ex"
    assert not s.stopped


def test_stops_before_the_stop_string() -> None:
    """Generation stops at the first stop string, which is not delivered."""
    s = StopScanner(stops=("\n\n", "END"))
    out = s.feed(b"hello EN") + s.feed(b"D more")
    assert out == "hello " and s.stopped
    assert s.feed(b"later") == "" and s.finish() == ""


def test_multibyte_characters_split_across_tokens() -> None:
    """A UTF-8 character split over two tokens comes out whole."""
    s = StopScanner()
    data = "é€".encode()
    assert s.feed(data[:1]) == ""
    assert s.feed(data[1:4]) == "é"
    assert s.feed(data[4:]) + s.finish() == "€"
