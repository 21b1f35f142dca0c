"""The journal's own thread (``runtime.journal_thread``): what the ``ThreadPoolExecutor`` of one
worker it replaced promised, kept: order, a job that raises does not end it, ``shutdown`` runs
what is queued and refuses what comes after (never a job queued behind its end), an exit
without ``shutdown`` still runs the queued jobs (the writes queued then) before the process
ends, a thread that cannot start is tried again, and one whose ``JournalThread`` is dropped unclosed
ends (round 78's review found the last three, and the race, broken in the first version), and
one interrupted as it starts stays the queue's only thread (round 79)."""

from __future__ import annotations

import gc
import logging
import queue
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

import pytest

from spillover.runtime.journal_thread import JournalThread


def test_jobs_run_in_order_on_one_thread_and_a_failing_one_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    t = JournalThread("journal")
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
    t = JournalThread("journal")
    t.shutdown()
    with pytest.raises(RuntimeError):
        t.submit(print)


def test_the_exit_runs_the_queued_jobs_first() -> None:
    code = textwrap.dedent(
        """
        import time
        from spillover.runtime.journal_thread import JournalThread
        t = JournalThread("journal")
        t.submit(time.sleep, 0.3)
        t.submit(print, "ran")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "ran\n"), out.stderr


def test_a_thread_that_cannot_start_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused start (a process limit) raises to its caller; the next job starts the thread
    (the first version kept the unstarted thread: every later job waited for ever)."""
    real = threading.Thread.start
    refused: list[str] = []

    def start_once_refused(self: threading.Thread) -> None:
        if self.name == "journal-start" and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_refused)
    t = JournalThread("journal-start")
    with pytest.raises(RuntimeError, match="can't start"):
        t.submit(print)
    done = threading.Event()
    t.submit(done.set)
    assert done.wait(10)
    t.shutdown()


def test_a_thread_dropped_unclosed_ends() -> None:
    """A journal nobody closed and nobody holds lets its thread go (as the pool's did)."""
    t = JournalThread("journal-dropped")
    ran = threading.Event()
    t.submit(ran.set)
    assert ran.wait(10)
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None
    for _ in range(500):
        if not any(th.name == "journal-dropped" for th in threading.enumerate()):
            break
        time.sleep(0.01)
    assert not any(th.name == "journal-dropped" for th in threading.enumerate())


class _HeldQueue(queue.SimpleQueue[Any]):
    """A queue whose job ``put`` waits, once told to, until released: the window between a
    submit's check and its put, held open."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.inside = threading.Event()
        self.release = threading.Event()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if item is not None and self.hold.is_set():
            self.inside.set()
            self.release.wait(10)
        super().put(item)


def test_a_job_submitted_as_shutdown_comes_runs_or_is_refused() -> None:
    """A submit that passed its check when ``shutdown`` comes is queued before the end, and runs
    (the first version checked and queued apart: its job went behind the end, lost)."""
    t = JournalThread("journal-held")
    jobs = t._jobs = _HeldQueue()
    ran = threading.Event()
    t.submit(time.sleep, 0)  # the thread runs
    jobs.hold.set()
    sender = threading.Thread(target=t.submit, args=(ran.set,))
    sender.start()
    assert jobs.inside.wait(10)  # past its check, not queued yet
    stopper = threading.Thread(target=t.shutdown)
    stopper.start()
    time.sleep(0.2)  # shutdown waits for the submit (or, in the first version, queued its end)
    jobs.release.set()
    sender.join(10)
    stopper.join(10)
    assert ran.is_set()


def test_a_thread_interrupted_as_it_starts_stays_the_only_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt during the start (after the thread runs) keeps that thread as the queue's
    one: the next job does not start a second, and the order holds."""
    real = threading.Thread.start

    def start_then_interrupt(self: threading.Thread) -> None:
        real(self)
        if self.name == "journal-interrupted":
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    t = JournalThread("journal-interrupted")
    with pytest.raises(KeyboardInterrupt):
        t.submit(time.sleep, 0.2)  # queued? no: the interrupt came first; the thread runs empty
    order: list[int] = []
    t.submit(time.sleep, 0.1)
    t.submit(order.append, 1)
    t.submit(order.append, 2)
    stopper = threading.Thread(target=t.shutdown, daemon=True)  # a second thread would keep it waiting
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive()
    assert order == [1, 2]
    assert sum(th.name == "journal-interrupted" for th in threading.enumerate()) == 0


def test_a_job_is_either_refused_or_run_when_shutdown_comes_at_once() -> None:
    """Submits racing ``shutdown`` from other threads: each one raised, or its job ran (none
    queued behind the end and lost)."""
    for _ in range(50):
        t = JournalThread("journal-race")
        t.submit(time.sleep, 0.001)
        ran: list[int] = []
        refused: list[int] = []

        def send(i: int, t: JournalThread = t, ran: list[int] = ran, refused: list[int] = refused) -> None:
            try:
                t.submit(ran.append, i)
            except RuntimeError:
                refused.append(i)

        senders = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for th in senders:
            th.start()
        t.shutdown()
        for th in senders:
            th.join()
        assert sorted(ran + refused) == list(range(8))
