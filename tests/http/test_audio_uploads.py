"""``http.audio`` rule 4 without a model: an upload is deleted once nothing uses it. Requests
that send the same bytes share one file; one of them ending (refused, answered, replayed)
never deletes it while another still holds it (being read or checked) or runs it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from spillover.http.audio import UploadHold, _closed, _forget_upload, uploads_dir
from spillover.runtime.unary import UnaryRun

DIGEST = "ab" * 32


def gateway(tmp_path: Path) -> Any:
    gw = SimpleNamespace(
        upload_holds={}, requests=SimpleNamespace(live={}), cfg=SimpleNamespace(state_path=lambda: tmp_path)
    )
    uploads_dir(gw).mkdir()  # type: ignore[arg-type]
    (uploads_dir(gw) / DIGEST).write_bytes(b"RIFF")  # type: ignore[arg-type]
    return gw


def test_a_request_ending_keeps_an_upload_another_still_holds(tmp_path: Path) -> None:
    """B stored the bytes and is still checking them; C sent the same bytes and was refused:
    C's end leaves the file to B; B's end deletes it."""
    gw = gateway(tmp_path)
    b, c = UploadHold(gw), UploadHold(gw)
    b.take(DIGEST)
    c.take(DIGEST)
    c.release()
    assert (uploads_dir(gw) / DIGEST).exists() and gw.upload_holds == {DIGEST: 1}
    _forget_upload(gw, DIGEST, "another-run")  # a run that used the same bytes ends meanwhile
    assert (uploads_dir(gw) / DIGEST).exists()
    b.release()
    assert not (uploads_dir(gw) / DIGEST).exists() and gw.upload_holds == {}
    b.release()  # released twice: nothing more happens
    c.release()


def test_a_run_keeps_its_upload_after_its_http_request_is_answered(tmp_path: Path) -> None:
    """A streamed request is answered (its hold released) while its run still reads the file:
    the file stays until the run ends, then goes."""
    gw = gateway(tmp_path)
    run = UnaryRun.__new__(UnaryRun)
    run.req = SimpleNamespace(upload=DIGEST)
    gw.requests.live["r1"] = run
    hold = UploadHold(gw)
    hold.take(DIGEST)
    hold.release()
    assert (uploads_dir(gw) / DIGEST).exists()
    _forget_upload(gw, DIGEST, "r1")  # the run's own end
    assert not (uploads_dir(gw) / DIGEST).exists()


def test_a_body_cut_short_is_told_from_one_without_a_file() -> None:
    ctype = "multipart/form-data; boundary=xyz"
    assert _closed(ctype, b"...\r\n--xyz--\r\n")
    assert not _closed(ctype, b'...\r\n--xyz\r\nContent-Disposition: form-data; name="file"\r\n\r\nRIFF')
    assert _closed('multipart/form-data; Boundary="a b"', b"x\r\n--a b--")
    assert _closed("multipart/form-data", b"")  # no boundary named: nothing to tell
