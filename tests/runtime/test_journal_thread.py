"""The journal's own thread (``runtime.journal._Thread``): what the ``ThreadPoolExecutor`` of one
worker it replaced promised, kept: order, a job that raises does not end it, ``shutdown`` runs
what is queued and refuses what comes after, and an exit without ``shutdown`` still runs the
queued jobs (the writes queued then) before the process ends."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading

import pytest

from spillover.runtime.journal import _Thread


def test_jobs_run_in_order_on_one_thread_and_a_failing_one_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    t = _Thread("journal")
    ran: list[tuple[int, str]] = []

    def boom() -> None:
        raise ValueError("a bug")

    with caplog.at_level(logging.ERROR, logger="spillover.journal"):
        for i in range(50):
            t.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
            if i == 10:
                t.submit(boom)
        t.shutdown()
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"journal"}
    assert "boom failed on the journal thread" in caplog.text and "ValueError: a bug" in caplog.text
    with pytest.raises(RuntimeError):
        t.submit(print)


def test_shutdown_before_any_job_starts_nothing() -> None:
    t = _Thread("journal")
    t.shutdown()
    with pytest.raises(RuntimeError):
        t.submit(print)


def test_the_exit_runs_the_queued_jobs_first() -> None:
    code = textwrap.dedent(
        """
        import time
        from spillover.runtime.journal import _Thread
        t = _Thread("journal")
        t.submit(time.sleep, 0.3)
        t.submit(print, "ran")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "ran\n"), out.stderr
