"""The journal's one thread (``runtime.journal``: its SQLite work runs here, in order).

A ``ThreadPoolExecutor`` of one worker did this; each of its jobs made a future with its
condition and lock, a work item, and took and gave back a semaphore: about 6 us more of the
caller's CPU than a bare queue a hand-off, and more on the thread (issue 13 item 5). Rules,
the pool's, kept:

1. Jobs run in order, one at a time, on one thread, started with the first job. A start the
   system refuses raises to that job's caller, and the next job tries again; a start
   interrupted after the thread runs (a KeyboardInterrupt) keeps that thread as the queue's
   one (a second would break the order).
2. ``shutdown`` refuses new jobs (RuntimeError), runs the queued ones and waits for the
   thread's end. A submit checks and queues under the same lock as ``shutdown``, so no job is
   queued behind the end and lost.
3. The interpreter's exit runs the queued jobs before the process ends (the writes queued
   then are made), as the pool's hook did, and refuses new ones.
4. A ``JournalThread`` collected unclosed ends its thread: the thread holds the queue, not
   its owner, and drops each job once run (a read's job holds its result).
5. A job's exception is logged (the pool kept it in a future nobody read).
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["JournalThread"]

log = logging.getLogger("spillover.journal")

_Job = tuple[Callable[..., Any], tuple[Any, ...]] | None  # None: the thread ends
_LOCK = threading.Lock()  # every journal thread's submit, shutdown and the exit's hook
_LIVE: set[queue.SimpleQueue[_Job]] = set()  # the queues of journal threads that run
_exiting = False  # the interpreter's exit began: no new job (as a pool's)


def _at_exit() -> None:
    """Rule 3, before the exit joins the threads (an ``atexit`` hook runs after it; the pool's
    hook runs here too): each journal thread runs what is queued, then ends."""
    global _exiting
    with _LOCK:
        _exiting = True
        for jobs in _LIVE:
            jobs.put(None)


threading._register_atexit(_at_exit)  # type: ignore[attr-defined]


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    """A journal thread's life: each job in order until a None (its ``shutdown``, the exit's
    hook, or its owner collected unclosed). It holds the queue, not its owner, and drops each
    job once run (rule 4)."""
    try:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except BaseException:
                log.exception("journal: %s failed on the journal thread", getattr(fn, "__name__", fn))
            del job, fn, args
    finally:
        with _LOCK:
            _LIVE.discard(jobs)


class JournalThread:
    """The journal's one thread: runs what is queued on it, in order (the rules above)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; RuntimeError once shut down, or once the exit began."""
        with _LOCK:  # checked and queued at once: never queued behind the end
            if self._closed or _exiting:
                raise RuntimeError("cannot schedule new jobs after shutdown")
            if self._thread is None:
                thread = threading.Thread(target=_serve, args=(self._jobs,), name=self.name)
                try:
                    thread.start()
                except BaseException as exc:
                    # The system refused it (RuntimeError): nothing runs, the next job tries again.
                    # Interrupted as it started (a KeyboardInterrupt): it may run, so it is the
                    # queue's one thread (a second would break the order).
                    if not isinstance(exc, Exception):
                        self._own(thread)
                    raise
                self._own(thread)
            self._jobs.put((fn, args))

    def _own(self, thread: threading.Thread) -> None:
        """``thread`` serves this queue (``_LOCK`` held)."""
        self._thread = thread
        _LIVE.add(self._jobs)
        weakref.finalize(self, self._jobs.put, None)  # collected unclosed: its thread ends

    def shutdown(self) -> None:
        """Refuse new jobs, run the queued ones, and wait for the thread's end (not from the
        thread itself: a job that shuts its own thread down ends it after itself)."""
        with _LOCK:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
