"""The host guard's /proc readings with the files kept open (``runtime.devices.ProcReader``):
the same figures as the one-shot functions, one file a process for as long as it is asked for
and alive, and none left behind."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from spillover.runtime.devices import ProcReader, host_available_bytes, processes_rss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
MIB = 1024 * 1024


def proc_files() -> list[str]:
    """The /proc files this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own
            continue
        if target.startswith("/proc/") and not target.startswith("/proc/self/fd"):
            out.append(target)
    return out


def statm_fds(pid: int) -> int:
    return proc_files().count(f"/proc/{pid}/statm")


@contextlib.contextmanager
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child holding 64 MiB, once it does (its RSS stays put while it sleeps)."""
    code = "import sys, time; b = bytearray(64 << 20); print('ready', flush=True); time.sleep(60)"
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            yield child
        finally:
            child.kill()


def test_the_readings_are_the_one_shot_functions_figures() -> None:
    with sleeper() as child:
        reader = ProcReader()
        pids = [os.getpid(), child.pid]
        for _ in range(3):  # the first reading opens, the later ones read the kept files again
            kept, fresh = reader.rss(pids), processes_rss(pids)
            assert abs(kept - fresh) <= 8 * MIB and kept > 0
            assert abs(reader.available() - host_available_bytes()) <= 256 * MIB


def test_a_process_that_ended_counts_zero_and_its_file_is_closed() -> None:
    reader = ProcReader()
    alone = reader.rss([os.getpid()])
    with sleeper() as child:
        assert reader.rss([os.getpid(), child.pid]) > alone + 64 * MIB
        assert statm_fds(child.pid) == 1
    assert abs(reader.rss([os.getpid(), child.pid]) - alone) <= 8 * MIB  # gone: 0, not its last figure
    assert statm_fds(child.pid) == 0
    assert reader.rss([os.getpid(), 2**22 + 12345]) > 0  # a pid that never was: 0, nothing kept
    assert statm_fds(2**22 + 12345) == 0


def test_files_of_pids_no_longer_asked_for_are_closed_and_none_outlive_the_reader() -> None:
    before = proc_files()
    with sleeper() as child:
        reader = ProcReader()
        for _ in range(50):
            reader.rss([os.getpid(), child.pid])
            reader.available()
        assert sorted(set(proc_files()) - set(before)) == sorted(
            [f"/proc/{os.getpid()}/statm", f"/proc/{child.pid}/statm", "/proc/meminfo"]
        )  # one a file, not one a reading
        assert len(proc_files()) == len(before) + 3
        reader.rss([os.getpid()])
        assert statm_fds(child.pid) == 0
        del reader
        gc.collect()
        assert proc_files() == before


def test_the_anonymous_part_leaves_out_pages_mapped_from_a_file(tmp_path: os.PathLike[str]) -> None:
    """``anon``: a process's resident memory less its file-backed pages (a model llama.cpp
    maps), what the machine's available memory gets back when it ends; the host guard counts a
    restarting worker's memory on the machine's side by it (round 40a: the whole RSS counted
    the page cache as taken)."""
    path = os.path.join(tmp_path, "weights.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(1024) * (48 * 1024))  # 48 MiB
    code = (
        "import mmap, sys, time\n"
        "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "s = sum(m[i] for i in range(0, len(m), 4096))  # every page resident\n"
        "b = bytearray(16 << 20)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            each: dict[int, int] = {}
            anon: dict[int, int] = {}
            ProcReader().rss([child.pid], each, anon)
            assert each[child.pid] >= 64 * MIB  # the mapped file and the bytearray
            assert 16 * MIB <= anon[child.pid] <= each[child.pid] - 40 * MIB  # the bytearray, not the file
        finally:
            child.kill()
