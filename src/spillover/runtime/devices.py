"""Device discovery and observation: sim ledger file or NVML, read off the event loop;
and the host memory of a process tree (the CPU lane's guard, the drill, the tests)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from dataclasses import dataclass

from spillover.engine.sim import MIB, SimDevice

__all__ = [
    "DeviceReading",
    "GpuDevice",
    "ProcReader",
    "cuda_available",
    "host_available_bytes",
    "processes_rss",
    "tree_rss",
]


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def processes_rss(pids: list[int]) -> int:
    """Resident memory of these processes, in bytes (one that is gone counts 0). On Linux
    one read of ``/proc/PID/statm`` each (what psutil reads, without building a Process
    that first reads its start time: the host guard reads several times a second)."""
    if sys.platform.startswith("linux"):
        total = 0
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/statm", "rb") as fh:
                total += _statm_rss(fh.read())
        return total
    import psutil

    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += int(psutil.Process(pid).memory_info().rss)
    return total


def host_available_bytes() -> int:
    """Memory the machine can still give without swapping (``MemAvailable``). On Linux the
    one line of ``/proc/meminfo`` (psutil parses the whole file and more: the host guard
    reads this several times a second, through ``ProcReader``), else psutil."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", "rb") as fh:
            return _mem_available(fh.read())
    import psutil

    return int(psutil.virtual_memory().available)


def _statm_rss(statm: bytes) -> int:
    """The resident bytes of a ``/proc/PID/statm`` text (its second field, in pages)."""
    return int(statm.split()[1]) * _PAGE_BYTES


def _mem_available(meminfo: bytes) -> int:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (ValueError when it has none)."""
    at = meminfo.index(b"\nMemAvailable:") + 14
    return int(meminfo[at : meminfo.index(b"\n", at)].split()[0]) * 1024


def _close_all(fds: dict[object, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class ProcReader:
    """``processes_rss`` and ``host_available_bytes`` for a reader that takes them several
    times a second (the host guard): the ``/proc`` files stay open and each reading is one
    ``pread``, not the open, fstat, ioctl, lseek, read and close of each ``open()`` (about
    40 us a file on a 2-core machine, against 2-10 us). A ``/proc/PID/statm`` kept open stays that
    process's: once it is gone a read fails (ESRCH), the process counts 0 and its file is
    closed, so a pid handed out again is opened afresh. The files of pids no longer asked for
    are closed at the next reading, and all of them when the reader is collected. Not Linux:
    the functions themselves."""

    def __init__(self) -> None:
        self._linux = sys.platform.startswith("linux")
        self._fds: dict[object, int] = {}  # a pid (its statm), or "meminfo"
        weakref.finalize(self, _close_all, self._fds)

    def _read(self, key: object, path: str) -> bytes:
        fd = self._fds.get(key)
        if fd is None:
            fd = self._fds[key] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, 8192, 0)
        except OSError:
            del self._fds[key]
            os.close(fd)
            raise

    def rss(self, pids: list[int], each: dict[int, int] | None = None, anon: dict[int, int] | None = None) -> int:
        """``processes_rss(pids)``; with ``each``, every pid's own RSS is put in it too, and
        with ``anon`` the part of it not shared (resident less statm's shared: its file pages,
        which stay in the page cache the machine counts as available already when the process
        ends, and shmem): about what the machine's available memory gets back. Not Linux: all of it."""
        if not self._linux:
            one_each = {pid: processes_rss([pid]) for pid in pids}
            for d in (each, anon):
                if d is not None:
                    d.update(one_each)
            return sum(one_each.values())
        for gone in [k for k in self._fds if k != "meminfo" and k not in pids]:
            os.close(self._fds.pop(gone))
        total = 0
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                statm = self._read(pid, f"/proc/{pid}/statm")
                one = _statm_rss(statm)
                total += one
                if each is not None:
                    each[pid] = one
                if anon is not None:
                    anon[pid] = max(0, one - int(statm.split()[2]) * _PAGE_BYTES)
        return total

    def available(self) -> int:
        """``host_available_bytes()``."""
        if self._linux:
            with contextlib.suppress(OSError, ValueError, IndexError):
                return _mem_available(self._read("meminfo", "/proc/meminfo"))
        return host_available_bytes()


def tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants, in bytes. Finding the
    descendants scans every process on the machine: the gateway, which knows its
    workers, uses ``processes_rss`` on a clock; this is for outside observers."""
    import psutil

    return processes_rss([pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)])


@dataclass(frozen=True)
class DeviceReading:
    """One observation of a device."""

    used_bytes: int
    capacity_bytes: int
    epoch: int = 0
    alloc_failures: int = 0
    hang: bool = False


def cuda_available(index: int = 0) -> bool:
    """True when NVML sees GPU ``index`` and llama.cpp was built with GPU offload."""
    try:
        import llama_cpp
        import pynvml

        if not llama_cpp.llama_supports_gpu_offload():
            return False
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) > index
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


class GpuDevice:
    """The GPU lane's device: ``sim:<mib>`` or ``cuda:N``."""

    def __init__(self, kind: str, index_or_mib: int, state_dir: str) -> None:
        self.kind = kind
        self.sim: SimDevice | None = None
        self.index = 0
        self._nvml_handle: object | None = None
        self._sim_last: tuple[int, float, DeviceReading] | None = None  # (change count, when, reading)
        if kind == "sim":
            self.sim = SimDevice(state_dir, "sim0")
            self.spec = f"sim:{index_or_mib}"
            self.initial_capacity_bytes = index_or_mib * MIB
        else:
            self.index = index_or_mib
            self.spec = f"cuda:{index_or_mib}"
            self.initial_capacity_bytes = 0

    def __repr__(self) -> str:
        return f"<GpuDevice {self.spec}>"

    def init(self) -> None:
        """Set the sim device's capacity (its live allocations kept, as a card keeps another
        program's memory across this gateway's restart: a ``spillover tenant``'s; the first
        full reading reaps those of processes that died) or open NVML."""
        if self.sim is not None:
            self.sim.create(self.initial_capacity_bytes, keep_allocations=True)
            return
        import pynvml

        pynvml.nvmlInit()
        self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        self.initial_capacity_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).total)

    def read(self) -> DeviceReading:
        """A blocking reading (NVML: call it in a thread). Sim: a full, locked reading when the
        ledger's change counter moved since the last one, or that one is ``FULL_READ_S``
        old (a full reading also reaps the allocations of processes that died); else the
        last reading, which the unchanged counter proves is still the ledger's content."""
        if self.sim is not None:
            seq, now = self.sim.change_count(), time.monotonic()  # the counter before the reading
            last = self._sim_last
            if last is not None and last[0] == seq and now - last[1] < self.sim.FULL_READ_S:
                return last[2]
            snap = self.sim.snapshot()
            r = DeviceReading(snap.used_bytes, snap.capacity_bytes, snap.epoch, snap.alloc_failures, snap.hang)
            self._sim_last = (seq, now, r)
            return r
        import pynvml

        info = pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle)
        return DeviceReading(int(info.used), int(info.total))

    def held_by(self, pid: int) -> int:
        """Bytes a process still holds on the device (sim only; NVML: 0 once it is dead)."""
        if self.sim is not None:
            return self.sim.snapshot().used_by_pid(pid)
        return 0

    def close(self) -> None:
        if self._nvml_handle is not None:
            import pynvml

            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
