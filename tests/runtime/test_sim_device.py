"""The sim device: one ledger shared by processes, failing exactly at capacity, with faults."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spillover.engine.sim import MIB, SimDevice
from spillover.runtime.events import Done, Failed, RequestEvent, Started
from spillover.runtime.worker_client import WorkerClient, WorkerGone, WorkerSpec


def tenant(state: Path, mib: int, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spillover.cli",
            "tenant",
            "--state-dir",
            str(state),
            "--mib",
            str(mib),
            "--name",
            name,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def end(p: subprocess.Popen[str], kill: bool = False) -> str:
    """Stop a tenant and collect its stderr (closing the pipe)."""
    if p.poll() is None:
        p.kill() if kill else p.terminate()
    return p.communicate(timeout=30)[1]


def wait_used(dev: SimDevice, want: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while dev.snapshot().used_bytes != want:
        if time.monotonic() > deadline:
            raise TimeoutError(dev.snapshot())
        time.sleep(0.02)


def test_two_processes_share_one_ledger_and_the_second_fails_at_capacity(tmp_path: Path) -> None:
    """Tenant A holds 60 of 100 MiB; tenant B asking for 50 MiB is refused; 40 MiB fits."""
    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    a = tenant(tmp_path, 60, "a")
    try:
        wait_used(dev, 60 * MIB)
        b = tenant(tmp_path, 50, "b")
        assert b.wait(30) == 1 and "refused" in end(b)
        assert dev.snapshot().alloc_failures == 1
        c = tenant(tmp_path, 40, "c")
        wait_used(dev, 100 * MIB)
        end(c)
    finally:
        end(a)
    wait_used(dev, 0)


def test_every_write_moves_the_change_counter_and_a_reading_does_not(tmp_path: Path) -> None:
    """The mapped change counter moves with each write, from another process too (a tenant),
    and not with a reading; the gateway's device reading is the same object while it stays."""
    from spillover.runtime.devices import GpuDevice

    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    seen = dev.change_count()
    assert dev.allocate("a", MIB, "t") and dev.change_count() == seen + 1
    dev.snapshot()
    assert dev.change_count() == seen + 1
    gpu = GpuDevice("sim", 100, str(tmp_path))
    first = gpu.read()
    assert gpu.read() is first and first.used_bytes == MIB
    a = tenant(tmp_path, 30, "a")
    try:
        wait_used(dev, 31 * MIB)
        assert dev.change_count() > seen + 1
        assert gpu.read().used_bytes == 31 * MIB  # the counter moved: read in full
    finally:
        end(a)


def test_dead_process_memory_is_released(tmp_path: Path) -> None:
    """A SIGKILLed holder's allocation disappears, as a driver frees a dead process's memory."""
    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    a = tenant(tmp_path, 30, "a")
    wait_used(dev, 30 * MIB)
    end(a, kill=True)
    wait_used(dev, 0)


def test_faults_in_process(tmp_path: Path) -> None:
    """fail_next, capacity change and reset act on the very next operations."""
    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    dev.fail_next(1)
    assert not dev.allocate("x", MIB, "t")
    assert dev.allocate("x", MIB, "t")
    dev.set_capacity(2 * MIB)
    assert not dev.allocate("y", 2 * MIB, "t")
    epoch = dev.snapshot().epoch
    dev.reset()
    snap = dev.snapshot()
    assert snap.used_bytes == 0 and snap.epoch == epoch + 1 and snap.alloc_failures == 2


def spec(tmp_path: Path, model_path: str) -> WorkerSpec:
    return WorkerSpec(
        worker_id="gpu0",
        lane="gpu",
        device="sim:512",
        model_path=model_path,
        state_dir=str(tmp_path),
        slots=1,
        n_ctx=256,
        n_threads=1,
        n_batch=256,
        weights_bytes=100 * MIB,
    )


async def run_job(w: WorkerClient, rid: str, reserve: int) -> list[RequestEvent]:
    w.claim_slot(rid)
    job = {
        "rid": rid,
        "tokens": [1, 2, 3],
        "max_tokens": 4,
        "temperature": 0,
        "kv_tokens": 64,
        "reserve_bytes": reserve,
    }
    try:
        return [ev async for ev in w.generate(job)]
    finally:
        w.release_slot(rid)  # the slot's owner (the Execution, in the gateway) gives it back


@pytest.mark.timeout(120)
def test_worker_sees_injected_faults(tmp_path: Path, model_path: str) -> None:
    """A real worker: charged for weights; fail_next and a capacity cut refuse its request;
    a driver reset kills it."""
    dev = SimDevice(tmp_path)
    dev.create(512 * MIB)

    async def main() -> None:
        exits: list[WorkerGone] = []
        w = WorkerClient(spec(tmp_path, model_path), lambda _w, g: exits.append(g))
        info = await w.start(60)
        assert dev.snapshot().used_by_pid(info["pid"]) == 100 * MIB
        ok = await run_job(w, "r1", 10 * MIB)
        assert isinstance(ok[0], Started) and isinstance(ok[-1], Done)
        dev.fail_next(1)
        failed = await run_job(w, "r2", 10 * MIB)
        assert len(failed) == 1 and isinstance(failed[0], Failed) and failed[0].kind == "alloc_failed"
        dev.set_capacity(105 * MIB)
        last = (await run_job(w, "r3", 10 * MIB))[-1]
        assert isinstance(last, Failed) and last.kind == "alloc_failed"
        dev.set_capacity(512 * MIB)
        assert isinstance((await run_job(w, "r4", 10 * MIB))[-1], Done)
        assert dev.snapshot().used_by_pid(info["pid"]) == 100 * MIB  # request memory returned
        dev.reset()
        for _ in range(200):
            if exits:
                break
            await asyncio.sleep(0.05)
        assert exits and exits[0].kind == "device_lost"
        await w.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_worker_killed_for_a_hang_says_so_in_its_exit(tmp_path: Path, model_path: str) -> None:
    """Round 19: a worker its health pings killed (SIGSTOPped) read as any exit, so its requests
    failed over as a crash; its exit is ``hung`` now. The next start's plain kill is ``exited``."""
    SimDevice(tmp_path).create(512 * MIB)

    async def main() -> None:
        exits: list[WorkerGone] = []
        w = WorkerClient(spec(tmp_path, model_path), lambda _w, g: exits.append(g))
        for why, kind in (("hung", "hung"), ("", "exited")):
            await w.start(60)
            await w.kill(why)
            for _ in range(200):
                if exits:
                    break
                await asyncio.sleep(0.05)
            assert [g.kind for g in exits] == [kind]
            exits.clear()
        await w.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_worker_refused_weights_exits(tmp_path: Path, model_path: str) -> None:
    """A worker whose weights do not fit the device fails to load with alloc_failed."""
    dev = SimDevice(tmp_path)
    dev.create(50 * MIB)

    async def main() -> None:
        exits: list[WorkerGone] = []
        w = WorkerClient(spec(tmp_path, model_path), lambda _w, g: exits.append(g))
        with pytest.raises(RuntimeError, match="alloc_failed"):
            await w.start(60)
        assert exits[0].kind == "alloc_failed"

    asyncio.run(main())


def test_a_gateway_start_keeps_a_live_tenants_memory(tmp_path: Path) -> None:
    """A card keeps another program's memory across the gateway's restart: the sim did not (its
    start cleared every allocation, and the workers loaded into the tenant's room). A dead
    process's allocation is still reaped by the next full reading."""
    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    a = tenant(tmp_path, 30, "a")
    try:
        wait_used(dev, 30 * MIB)
        done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        assert dev.allocate("old-worker", 10 * MIB, "gone", pid=int(done.stdout))  # its process has exited
        from spillover.runtime.devices import GpuDevice

        gpu = GpuDevice("sim", 200, str(tmp_path))
        gpu.init()
        reading = gpu.read()
        assert reading.used_bytes == 30 * MIB and reading.capacity_bytes == 200 * MIB
    finally:
        end(a)


def test_a_full_disk_writes_the_ledger_over_its_own_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 49b: with the state folder's disk full the ledger's next copy could not be made;
    a GPU worker's free raised, its request never ended and the worker was killed as hung.
    The state goes over the ledger's own blocks instead, and no copy is left behind."""
    import builtins
    import errno

    import spillover.engine.sim as sim_module

    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    assert dev.allocate("weights", 40 * MIB, owner="gpu0")
    assert dev.allocate("req:a", 8 * MIB, owner="gpu0")
    real_open = builtins.open

    def full_disk(path: object, *args: object, **kwargs: object) -> object:
        if ".tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(sim_module, "open", full_disk, raising=False)
    before, size = dev.change_count(), dev.path.stat().st_size
    assert dev.free("req:a")
    # a shorter state padded to the old length, never cut: a process killed after its write
    # leaves a whole ledger
    assert dev.path.stat().st_size == size and json.loads(dev.path.read_bytes())["allocs"]
    assert dev.allocate("req:b", 2 * MIB, owner="gpu0")
    snap = dev.snapshot()
    assert [(tag, nbytes) for tag, _, nbytes, _ in snap.allocations] == [("req:b", 2 * MIB), ("weights", 40 * MIB)]
    assert dev.change_count() == before + 2
    assert not list(tmp_path.glob("*.tmp*"))
    big = "x" * (dev.path.stat().st_blocks * 512)  # more than the file's blocks hold: the full disk's error
    with pytest.raises(OSError):
        dev.allocate(f"req:{big}", MIB, owner="gpu0")
    monkeypatch.undo()
    assert SimDevice(tmp_path).snapshot().used_bytes == 42 * MIB  # what another process reads, whole


def test_a_zombies_memory_is_released_and_a_live_process_named_like_one_keeps_its_own(tmp_path: Path) -> None:
    """Reaping reads each holder's state once: a zombie's allocations (two here) go, as a dead
    process's do; a live process whose command holds ``) Z`` (the state is the field after the
    command's last parenthesis, not its first) keeps its allocations."""
    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    code = (
        "import sys\n"
        "try:\n    open('/proc/self/comm', 'w').write('x) Z (y')\nexcept OSError:\n    print('no comm', flush=True)\n"
        "print('ready', flush=True)\nsys.stdin.read()"
    )
    live = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    doomed = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert live.stdout is not None
        if (line := live.stdout.readline().strip()) == "no comm":
            pytest.skip("this system does not let a process name itself (/proc/self/comm)")
        assert line == "ready"
        assert Path(f"/proc/{live.pid}/comm").read_text().strip() == "x) Z (y"
        assert dev.allocate("w", 10 * MIB, "doomed", pid=doomed.pid)
        assert dev.allocate("kv", 5 * MIB, "doomed", pid=doomed.pid)
        assert dev.allocate("w", 20 * MIB, "live", pid=live.pid)
        assert dev.allocate("kv", 1 * MIB, "live", pid=live.pid)
        assert dev.snapshot().used_bytes == 36 * MIB
        assert doomed.stdin is not None
        doomed.stdin.close()  # it exits; not waited for, it stays a zombie
        for _ in range(500):
            if Path(f"/proc/{doomed.pid}/stat").read_bytes().rpartition(b")")[2][1:2] == b"Z":
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the child never became a zombie")
        snap = dev.snapshot()
        assert sorted((tag, pid) for tag, pid, _, _ in snap.allocations) == [("kv", live.pid), ("w", live.pid)]
        assert snap.used_bytes == 21 * MIB
    finally:
        for p in (live, doomed):
            p.kill()
            p.communicate()  # waited for, its pipes closed


def test_an_allocation_whose_pid_names_another_process_now_is_released(tmp_path: Path) -> None:
    """Round 80's leftover: a pid the system gave to a new process kept the dead holder's
    allocations. Each allocation records its process's start time; one whose pid now starts at
    another time (a reused pid, here written into the ledger) is reaped, the live process's own
    allocation under the same pid stays, and an allocation without a start time (a ledger
    written before it was recorded) is judged by the pid alone, as before."""
    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)
    assert dev.allocate("mine", 1 * MIB, "me")
    assert dev.allocate("old", 10 * MIB, "me")
    assert dev.allocate("unrecorded", 2 * MIB, "me")
    with dev._locked() as s:
        start = s["allocs"][f"{os.getpid()}:mine"]["start"]
        assert isinstance(start, int) and start > 0  # clock ticks after boot
        s["allocs"][f"{os.getpid()}:old"]["start"] = start - 1  # the pid's earlier holder
        del s["allocs"][f"{os.getpid()}:unrecorded"]["start"]
    snap = dev.snapshot()
    assert sorted(tag for tag, _, _, _ in snap.allocations) == ["mine", "unrecorded"]
    assert snap.used_bytes == 3 * MIB


def test_another_users_process_is_judged_by_its_start_time_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 82: kill(pid, 0) on another user's process fails with EPERM, and the holder was
    taken as alive without its start time read (``/proc/<pid>/stat`` is readable by anyone): a
    pid reused by another user's process kept the dead holder's memory. Here every kill(0)
    is refused so, as another user's would be."""
    import spillover.engine.sim as sim

    dev = SimDevice(tmp_path)
    dev.create(100 * MIB)

    def refused(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(sim.os, "kill", refused)
    assert dev.allocate("mine", 1 * MIB, "me") and dev.allocate("old", 10 * MIB, "me")
    with dev._locked() as s:
        assert isinstance(s["allocs"][f"{os.getpid()}:mine"]["start"], int)  # read through the refusal
        s["allocs"][f"{os.getpid()}:old"]["start"] -= 1  # the pid's earlier holder
    assert [tag for tag, _, _, _ in dev.snapshot().allocations] == ["mine"]
