"""``spillover sim``'s numbers and its journal: a capacity without a number is refused (it set the
card to 1 MiB), so is a number an action does not take or one below its least; ``disk-full``
acts on the journal the gateway writes, ``--journal`` naming one that ``[journal].path`` moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spillover.cli import main
from spillover.runtime.journal_bounds import disk_full_marker

MIB = 1 << 20


def sim(tmp_path: Path, *args: str) -> int:
    return main(["sim", "--state-dir", str(tmp_path), *args])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["capacity"], "capacity needs the device's MiB"),
        (["capacity", "0"], "capacity needs a number >= 1, not 0"),
        (["fail-next", "-1"], "fail-next needs a number >= 0, not -1"),
        (["oom-running", "-2"], "oom-running needs a number >= 0, not -2"),
        (["reset", "3"], "reset takes no number"),
        (["hang", "1"], "hang takes no number"),
    ],
)
def test_a_wrong_number_is_refused_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert sim(tmp_path, "capacity", "300") == 0
    capsys.readouterr()
    assert sim(tmp_path, *args) == 2
    assert words in capsys.readouterr().err
    assert sim(tmp_path, "status") == 0
    state = json.loads(capsys.readouterr().out)
    assert state["capacity_bytes"] == 300 * MIB and state["fail_next"] == 0 and not state["hang"]


def test_numbers_and_their_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim(tmp_path, "fail-next") == 0  # one allocation, by default
    assert json.loads(capsys.readouterr().out)["fail_next"] == 1
    assert sim(tmp_path, "fail-next", "0") == 0  # and none again
    assert json.loads(capsys.readouterr().out)["fail_next"] == 0
    assert sim(tmp_path, "capacity", "256") == 0
    assert json.loads(capsys.readouterr().out)["capacity_bytes"] == 256 * MIB


def test_disk_full_acts_on_the_gateways_journal(tmp_path: Path) -> None:
    own = tmp_path / "journal.sqlite3"
    moved = tmp_path / "elsewhere" / "j.sqlite3"
    moved.parent.mkdir()
    assert sim(tmp_path, "disk-full") == 0
    assert disk_full_marker(own.resolve()).exists()
    assert sim(tmp_path, "disk-full", "--journal", str(moved)) == 0
    assert disk_full_marker(moved.resolve()).exists()
    assert sim(tmp_path, "disk-ok", "--journal", str(moved)) == 0 and sim(tmp_path, "disk-ok") == 0
    assert not disk_full_marker(moved.resolve()).exists() and not disk_full_marker(own.resolve()).exists()
