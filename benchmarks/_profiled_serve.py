"""``spillover serve`` under a profiler, for ``benchmarks.request_cost --breakdown``: the same
command line as the CLI's, run with cProfile on the event loop's thread, timed in that thread's
CPU time (not wall time), so what it shows is where the loop's CPU goes.

Nothing is counted until SIGUSR2, which starts a count: the profile is cleared, and each
thread's CPU so far is noted. SIGUSR1 ends it: the profile is written to the file named by
``$SPILLOVER_PROFILE_OUT``, and beside it (``<file>.threads.json``) each of the gateway's threads'
CPU seconds over the count, by thread name. Both handlers run on the event loop's thread
(Python runs signal handlers on the main thread), where the profiler hooks in.

    python -m benchmarks._profiled_serve serve --port ... (what ``spillover serve`` takes)
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from benchmarks._common import thread_cpu_s
from spillover.cli import main

PROFILE = cProfile.Profile(time.thread_time)
_since: dict[int, float] = {}  # each thread's CPU seconds when the count started


def threads_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of each of this process's threads, by native id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            out[int(tid)] = thread_cpu_s("self", tid)
    return out


def _start(*_: Any) -> None:
    PROFILE.disable()
    PROFILE.clear()
    _since.clear()
    _since.update(threads_cpu_s())
    PROFILE.enable()


def _stop(*_: Any) -> None:
    PROFILE.disable()
    path = os.environ["SPILLOVER_PROFILE_OUT"]
    PROFILE.dump_stats(path)
    names = {t.native_id: t.name for t in threading.enumerate()}
    spent: dict[str, float] = {}
    for tid, cpu in threads_cpu_s().items():
        name = "event loop" if tid == os.getpid() else names.get(tid, "other")
        spent[name] = spent.get(name, 0.0) + cpu - _since.get(tid, 0.0)
    with open(f"{path}.threads.json", "w") as f:
        json.dump(spent, f)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR2, _start)
    signal.signal(signal.SIGUSR1, _stop)
    sys.argv[0] = "spillover"
    sys.exit(main())
