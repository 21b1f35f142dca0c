"""``http.audio`` rule 4 without a model: an upload is deleted once nothing holds it. Requests
that send the same bytes share one file; one of them ending (refused, answered, replayed) or
one run of it ending never deletes it while another request or run holds it, nor while the
start-up's orphans wait for their replay."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from spillover.http.audio import UploadHold, _closed, _forget_upload, uploads_dir

DIGEST = "ab" * 32


def gateway(tmp_path: Path) -> Any:
    cfg = SimpleNamespace(state_path=lambda: tmp_path)
    gw = SimpleNamespace(upload_holds={}, requests=SimpleNamespace(orphans=set()), cfg=cfg)
    uploads_dir(gw).mkdir()
    (uploads_dir(gw) / DIGEST).write_bytes(b"RIFF")
    return gw


def stored(gw: Any) -> bool:
    return (uploads_dir(gw) / DIGEST).exists()


def test_a_request_ending_keeps_an_upload_another_still_holds(tmp_path: Path) -> None:
    """B stored the bytes and is still checking them; C sent the same bytes and was refused:
    C's end leaves the file to B; B's end deletes it."""
    gw = gateway(tmp_path)
    b, c = UploadHold(gw), UploadHold(gw)
    b.take(DIGEST)
    c.take(DIGEST)
    c.release()
    assert stored(gw) and gw.upload_holds == {DIGEST: 1}
    b.release()
    assert not stored(gw) and gw.upload_holds == {}
    b.release()  # released twice: nothing more happens
    c.release()
    assert gw.upload_holds == {}


def test_two_runs_of_one_upload_ending_together_leave_nothing(tmp_path: Path) -> None:
    """Two runs of the same bytes (a streamed request answered, and a replay) end one after
    the other: the first keeps the file for the second, the second deletes it (each checked
    the other's live request before, and both could keep it for good)."""
    gw = gateway(tmp_path)
    first, second = UploadHold(gw), UploadHold(gw)
    first.take(DIGEST)
    second.take(DIGEST)
    first.release()
    assert stored(gw)
    second.release()
    assert not stored(gw)


def test_an_upload_waits_while_the_start_ups_orphans_wait_for_their_replay(tmp_path: Path) -> None:
    """After a crash, an accepted transcription waits for its replay (an orphan, not yet
    live): a request with the same bytes, refused meanwhile, does not delete its file."""
    gw = gateway(tmp_path)
    gw.requests.orphans.add("r-before-the-crash")
    hold = UploadHold(gw)
    hold.take(DIGEST)
    hold.release()
    assert stored(gw)
    gw.requests.orphans.clear()  # replayed: its run holds the file, and its end deletes it
    run = UploadHold(gw)
    run.take(DIGEST)
    run.release()
    assert not stored(gw)


def test_a_file_that_cannot_be_deleted_is_left_not_raised(tmp_path: Path) -> None:
    gw = gateway(tmp_path)
    (uploads_dir(gw) / DIGEST).unlink()
    (uploads_dir(gw) / DIGEST).mkdir()  # unlink() of a folder: an OSError other than "not found"
    _forget_upload(gw, DIGEST)
    assert stored(gw)


def test_a_body_cut_short_is_told_from_one_without_a_file() -> None:
    ctype = "multipart/form-data; boundary=xyz"
    assert _closed(ctype, b"...\r\n--xyz--\r\n")
    assert not _closed(ctype, b'...\r\n--xyz\r\nContent-Disposition: form-data; name="file"\r\n\r\nRIFF')
    assert _closed('multipart/form-data; Boundary="a b"', b"x\r\n--a b--")
    assert _closed("multipart/form-data", b"")  # no boundary named: nothing to tell
