"""Gateway side of the worker channel: spawn a worker process, talk JSON lines to it.

A worker's death is an event (``on_exit``), never a gateway crash: every request in
flight on it receives a ``WorkerGone`` item and its caller turns that into a typed error.

A worker's standard error passes through to the gateway's as it comes (what llama.cpp prints
is for the operator). A process that ends without its last word (an abort inside the engine,
such as llama.cpp's ``GGML_ASSERT``) is named by what it said there: the engine's abort line,
else its last line that reads as an error, after its exit code and signal
(``exit_words``), so a start that fails says why in ``/v1/status`` and in the refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spillover.runtime.events import FINAL, Failed, Interrupted, RequestEvent, WorkerGone, decode_request_event

__all__ = ["WORKER_TRANSITIONS", "WorkerClient", "WorkerGone", "WorkerSpec", "WorkerState", "WorkerStatistics"]

log = logging.getLogger("spillover.worker_client")
_LINE_LIMIT = 8 * 1024 * 1024
# How many of a readiness step's latest measurements after its first are kept (``step_samples``):
# the recovery prediction takes the slowest of them (``runtime.readiness``).
STEP_SAMPLES = 5
_SAID_LIMIT = 4096  # bytes of one standard-error line kept (the rest passes through unread)
DRAIN_TIMEOUT_S = 5.0  # longest a message to a worker may wait for room in its channel: past it, the worker is hung
_ABORT = re.compile(rb"GGML_ASSERT|GGML_ABORT|terminate called|Assertion .* failed")
_ERROR = re.compile(rb"error|fatal|exception", re.IGNORECASE)


def exit_words(rc: int, said: str | None) -> str:
    """How a worker process that ended without its last word went: its exit code, the signal
    that ended it, and what it said (``_Channel.said``) when it failed of itself. A process
    killed from outside (SIGKILL, SIGTERM: the supervisor, the OOM killer) is not named by
    what it said before."""
    how = f"worker exited with code {rc}"
    if rc < 0:
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-rc).name})"
    failed_itself = rc > 0 or (rc < 0 and -rc not in (signal.SIGKILL, signal.SIGTERM))
    return f"{how}: {said}" if said and failed_itself else how


class WorkerState(str, Enum):
    """Life of one worker process, as the gateway sees it."""

    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


_W = WorkerState
WORKER_TRANSITIONS: frozenset[tuple[WorkerState, WorkerState]] = frozenset(
    {
        (_W.STOPPED, _W.STARTING),  # first start
        (_W.DEAD, _W.STARTING),  # restart
        (_W.STARTING, _W.READY),
        (_W.STARTING, _W.DEAD),  # failed to load, or killed while loading
        (_W.READY, _W.DEAD),
        (_W.STARTING, _W.STOPPED),
        (_W.READY, _W.STOPPED),
        (_W.DEAD, _W.STOPPED),
        (_W.STOPPED, _W.STOPPED),
    }
)


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker."""

    worker_id: str
    lane: str  # "gpu" | "cpu"
    device: str  # "cpu" | "cuda:N" | "sim:<mib>"
    model_path: str
    state_dir: str
    slots: int
    n_ctx: int
    n_threads: int
    n_batch: int
    weights_bytes: int = 0
    sim_name: str = "sim0"
    readiness: str = "warm"  # what the engine keeps ready between requests (``Engine``, ``ModelHolder``)
    gpu_layers: int = -1  # chat on a device: layers placed there (-1 all; a split worker fewer)
    kind: str = "chat"  # "chat" | "embeddings"
    batch_size: int = 32  # embeddings: inputs per encoder run

    @property
    def weights_holder(self) -> str:
        """The device ledger's holder of this worker's weights (a GPU worker's)."""
        return f"weights:{self.worker_id}"

    def argv(self) -> list[str]:
        """Command line of the worker process."""
        return [
            sys.executable,
            "-m",
            "spillover.engine.worker",
            "--worker-id", self.worker_id,
            "--kind", self.kind,
            "--batch-size", str(self.batch_size),
            "--model", self.model_path,
            "--device", self.device,
            "--sim-name", self.sim_name,
            "--state-dir", self.state_dir,
            "--slots", str(self.slots),
            "--n-ctx", str(self.n_ctx),
            "--n-threads", str(self.n_threads),
            "--n-batch", str(self.n_batch),
            "--weights-bytes", str(self.weights_bytes),
            "--readiness", self.readiness,
            "--gpu-layers", str(self.gpu_layers),
        ]  # fmt: skip


@dataclass(frozen=True)
class WorkerStatistics:
    """Frozen snapshot for /v1/status and tests."""

    worker_id: str
    lane: str
    device: str
    state: str
    pid: int | None
    slots: int
    busy: int
    starts: int
    exits: int
    last_exit: str | None
    last_pong_age_s: float | None
    progress_tokens: int
    alloc_failures: int
    contexts: int
    fingerprint: dict[str, str] | None
    info: dict[str, Any] | None
    waiting: str | None  # what its next start waits for (room on the device), None when it does not wait


class _Channel(asyncio.subprocess.SubprocessStreamProtocol):
    """A worker process's pipes, whose output is read as JSON lines in the protocol's own
    callback: each message is dispatched as its bytes arrive, with no reader task woken per
    line (a streamed token is one line). A line that is not JSON is skipped; one longer
    than ``_LINE_LIMIT`` calls ``on_overflow`` (the worker is killed)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[dict[str, Any]], None],
        on_overflow: Callable[[], None],
    ) -> None:
        super().__init__(limit=_LINE_LIMIT, loop=loop)
        self._on_message = on_message
        self._on_overflow = on_overflow
        self._partial: list[bytes] = []  # the start of a line whose end has not come yet
        self._partial_bytes = 0
        self._err_partial = b""  # the same for standard error (at most ``_SAID_LIMIT``)
        self._abort: bytes | None = None  # the engine's first abort line on standard error
        self._error: bytes | None = None  # the last line there that reads as an error
        self.ended: asyncio.Future[None] = loop.create_future()  # the output is over

    @property
    def said(self) -> str | None:
        """What the worker said on standard error that names its failure: the engine's abort
        line, else the last that reads as an error; a source path is cut to its file name."""
        line = self._abort or self._error
        if line is None:
            return None
        text = line.decode("utf-8", "replace").strip()
        return re.sub(r"^\S*/(?=[^/\s]+:\d+:)", "", text)[:300]

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if fd == 2 and isinstance(data, bytes):
            self._standard_error(data)
            return
        if fd != 1 or isinstance(data, str):
            super().pipe_data_received(fd, data)
            return
        if b"\n" not in data:
            self._keep(data)
            return
        if self._partial:
            data = b"".join(self._partial) + data
            self._partial, self._partial_bytes = [], 0
        *lines, rest = data.split(b"\n")
        for line in lines:
            self._line(line)
        if rest:
            self._keep(rest)

    def _standard_error(self, data: bytes) -> None:
        """Pass the worker's standard error through, and note the lines that name a failure."""
        with contextlib.suppress(OSError):  # a gateway whose own standard error is gone
            os.write(2, data)
        *lines, rest = (self._err_partial + data).split(b"\n")
        self._err_partial = rest[-_SAID_LIMIT:]
        for line in lines:
            line = line[:_SAID_LIMIT]
            if self._abort is None and _ABORT.search(line):
                self._abort = line
            elif _ERROR.search(line) and line.strip():
                self._error = line

    def _keep(self, data: bytes) -> None:
        self._partial.append(data)
        self._partial_bytes += len(data)
        if self._partial_bytes > _LINE_LIMIT:
            self._partial, self._partial_bytes = [], 0
            self._on_overflow()

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = json.loads(line)
        except ValueError:  # not JSON (or not UTF-8): not a message
            return
        if not isinstance(msg, dict):
            return
        try:
            self._on_message(msg)
        except Exception:  # a bug in one message's handling must not stop the channel
            log.exception("worker message %.200r could not be handled", msg)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:
            if self._partial:  # a last line without its newline
                line, self._partial, self._partial_bytes = b"".join(self._partial), [], 0
                self._line(line)
            if not self.ended.done():
                self.ended.set_result(None)
        super().pipe_connection_lost(fd, exc)


class WorkerClient:
    """One worker process and its channel. Restarting is the supervisor's job."""

    def __init__(self, spec: WorkerSpec, on_exit: Callable[[WorkerClient, WorkerGone], None]):
        self.spec = spec
        self.state = WorkerState.STOPPED
        self._on_exit = on_exit
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[RequestEvent]] = {}
        self._claimed: set[str] = set()
        # rid -> resolved by the worker's last word on it (Done / Failed) or by its exit: until
        # then the worker may still compute for the request, so its lease is not given back.
        self._running: dict[str, asyncio.Future[None]] = {}
        self._killing = False  # killed, exit not yet seen: take no new work
        self._killed_as = ""  # why it was killed, when it was for a reason (``kill``): its exit's kind
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self.info: dict[str, Any] | None = None
        self.starts = 0
        self.exits = 0
        self.last_exit: str | None = None
        self.last_pong_s: float | None = None
        self.progress = 0
        self._ping_seq = 0
        self._last_fatal: WorkerGone | None = None
        self.alloc_failures = 0
        self.contexts = 0
        self.held: dict[str, Any] = {}  # the worker's last ``held`` report: mode, model, contexts, timings
        self.held_seq = 0  # bumped by each report
        # Each readiness step's measurements, across the worker's restarts: a report brings the
        # latest of each, and one that differs from the report before (or is the first of a new
        # process) is a new measurement. The very first (``step_first``: its start-up, beside
        # every other worker's load from a cold page cache) is kept apart from the later ones
        # (``step_samples``, the latest ``STEP_SAMPLES``, oldest first): ``runtime.readiness``.
        self.step_first: dict[str, float] = {}
        self.step_samples: dict[str, deque[float]] = {}
        self.waiting: str | None = None  # what its next start waits for (set by the supervisor's owner)
        self.waits_for_room = False  # its next start waits for room on the device (which may take any time)

    def __repr__(self) -> str:
        return f"<WorkerClient {self.spec.worker_id} {self.state.value} busy={self.busy}>"

    def _advance(self, target: WorkerState) -> None:
        """Move to ``target`` if ``WORKER_TRANSITIONS`` allows it; raise (changing nothing) if not."""
        if (self.state, target) not in WORKER_TRANSITIONS:
            raise RuntimeError(f"worker {self.spec.worker_id}: {self.state.value} -> {target.value} is not allowed")
        self.state = target

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def busy(self) -> int:
        return len(self._claimed)

    @property
    def claimed(self) -> frozenset[str]:
        """The request ids holding its slots."""
        return frozenset(self._claimed)

    def claim_slot(self, rid: str) -> None:
        """Hold a slot for ``rid`` from dispatch until ``release_slot``."""
        if self.free_slots <= 0:
            raise RuntimeError(f"{self.spec.worker_id} has no free slot")
        self._claimed.add(rid)

    def release_slot(self, rid: str) -> None:
        """Give back the slot held for ``rid`` (no-op if already gone)."""
        self._claimed.discard(rid)

    @property
    def free_slots(self) -> int:
        if self.state is not WorkerState.READY or self._killing:
            return 0
        return max(0, self.spec.slots - len(self._claimed))

    async def start(self, timeout_s: float) -> dict[str, Any]:
        """Spawn the process and wait (bounded) for its ``ready`` event."""
        self._advance(WorkerState.STARTING)
        self._killing = False
        self._killed_as = ""
        self.starts += 1
        self._last_fatal = None
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        channel = _Channel(loop, self._dispatch, self._line_too_long)
        transport, _ = await loop.subprocess_exec(
            lambda: channel,
            *self.spec.argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._proc = asyncio.subprocess.Process(transport, channel, loop)
        self._reader = asyncio.create_task(self._read_loop(self._proc, channel), name=f"read-{self.spec.worker_id}")
        try:
            info = await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            await self.kill()
            raise
        self.info = info
        self._held(info.get("held") or {})
        self._advance(WorkerState.READY)
        self.last_pong_s = time.monotonic()
        return info

    def _line_too_long(self) -> None:
        log.error("worker %s: a line of over %d bytes; killing it", self.spec.worker_id, _LINE_LIMIT)
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def _read_loop(self, proc: asyncio.subprocess.Process, channel: _Channel) -> None:
        """Wait for the end of the worker's output (its lines are dispatched as they come:
        ``_Channel``), then for its exit, and let everything waiting on it know."""
        try:
            await channel.ended
        finally:
            rc = await proc.wait()
            # killed for a reason, unless it died of something else first (its own SIGKILL's rc)
            killed_as = self._killed_as if rc == -signal.SIGKILL else ""
            gone = self._last_fatal or WorkerGone(killed_as or "exited", exit_words(rc, channel.said))
            if self.state is not WorkerState.STOPPED:
                self._advance(WorkerState.DEAD)
            self.exits += 1
            self.last_exit = f"{gone.kind}: {gone.message}"
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(RuntimeError(self.last_exit))
                self._ready.exception()  # mark retrieved; start() re-raises through wait_for
            for q in self._streams.values():
                q.put_nowait(gone)
            self._streams.clear()
            for fut in self._running.values():
                if not fut.done():
                    fut.set_result(None)
            self._running.clear()
            self._claimed.clear()
            self.held, self.contexts = {}, 0  # the process and all it held are gone
            self._on_exit(self, gone)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        ev = msg.get("ev")
        if ev == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg.get("info") or {})
        elif ev == "pong":
            self.last_pong_s = time.monotonic()
            self.progress = int(msg.get("progress") or 0)
            self.contexts = int(msg.get("contexts") or 0)
        elif ev == "held":
            self._held(msg)
        elif ev == "fatal":
            self._last_fatal = WorkerGone(str(msg.get("kind")), str(msg.get("message")))
        else:
            event = decode_request_event(msg)
            if event is None:
                log.warning("worker %s: ignoring an unknown line %.200r", self.spec.worker_id, msg)
                return
            if isinstance(event, Failed) and event.kind == "alloc_failed":
                self.alloc_failures += 1
            rid = str(msg.get("rid"))
            if isinstance(event, FINAL) and (fut := self._running.pop(rid, None)) is not None and not fut.done():
                fut.set_result(None)  # the worker is done with it: its slot and memory are free
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(event)

    def _held(self, msg: dict[str, Any]) -> None:
        before = self.held.get("timings") or {}
        for step, value in (msg.get("timings") or {}).items():
            if step not in self.step_first:
                self.step_first[step] = float(value)
            elif before.get(step) != value:
                self.step_samples.setdefault(step, deque(maxlen=STEP_SAMPLES)).append(float(value))
        self.held = {k: msg[k] for k in ("mode", "model", "contexts", "timings") if k in msg}
        self.contexts = int(msg.get("contexts") or 0)
        self.held_seq += 1

    async def set_readiness(self, mode: str) -> None:
        """Ask the worker to keep ``mode`` ready; its ``held`` report follows once done."""
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            await self._send({"op": "readiness", "mode": mode})

    async def _send(self, msg: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            raise ConnectionError("worker channel closed")
        proc.stdin.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        async with asyncio.timeout(DRAIN_TIMEOUT_S):  # not wait_for: it makes a task for every message
            await proc.stdin.drain()

    def generate(self, job: dict[str, Any]) -> AsyncGenerator[RequestEvent, None]:
        """Send one ``generate`` op (chat); its events as ``request``'s."""
        return self.request("generate", job)

    async def request(self, op: str, job: dict[str, Any]) -> AsyncGenerator[RequestEvent, None]:
        """Send one request op (``generate``, ``embed``); yield its typed events until Done /
        Failed or the worker's end (``WorkerGone``)."""
        rid = str(job["rid"])
        q: asyncio.Queue[RequestEvent] = asyncio.Queue()
        if self.state is not WorkerState.READY:
            yield WorkerGone("not_ready", f"worker {self.spec.worker_id} is {self.state.value}")
            return
        self._streams[rid] = q
        self._running[rid] = asyncio.get_running_loop().create_future()
        try:
            try:
                await self._send({"op": op, **job})
            except TimeoutError:
                # It has not read its channel for DRAIN_TIMEOUT_S: hung. The op may still be in
                # the pipe, and run once it reads again, so the worker has not let go of the
                # request: it is killed, and its exit ends this request (``WorkerGone`` "hung")
                # as it ends every other one it holds, and gives the request back.
                log.warning(
                    "worker %s did not read its channel within %.0fs: killing it", self.spec.worker_id, DRAIN_TIMEOUT_S
                )
                await self.kill("hung")
            except (ConnectionError, OSError) as exc:  # the channel is closed: the op was not sent
                self._stopped(rid)
                yield WorkerGone("exited", f"cannot reach worker: {exc}")
                return
            while True:
                item = await q.get()
                yield item
                if isinstance(item, FINAL):
                    return
        finally:
            self._streams.pop(rid, None)
            self._cancel_nowait(rid)  # the consumer left early: the worker stops it (a no-op when it ended)

    def has_event(self, rid: str) -> bool:
        """Whether an event of ``rid``'s is queued, not yet taken by its ``request``."""
        q = self._streams.get(rid)
        return q is not None and not q.empty()

    def when_stopped(self, rid: str) -> asyncio.Future[None] | None:
        """A future resolved once the worker has stopped working on ``rid`` (its last event,
        or its exit); None when it is not working on it."""
        fut = self._running.get(rid)
        return fut if fut is not None and not fut.done() else None

    def _stopped(self, rid: str) -> None:
        fut = self._running.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _cancel_nowait(self, rid: str) -> None:
        """Tell the worker to stop ``rid``, if it is working on it (no await: safe while cancelled)."""
        if rid not in self._running:
            return
        proc = self._proc
        if proc is not None and proc.stdin is not None and not proc.stdin.is_closing():
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                proc.stdin.write((json.dumps({"op": "cancel", "rid": rid}) + "\n").encode())

    def interrupt(self, rid: str) -> None:
        """Stop a running request now: tell the worker to cancel it, and wake its reader with
        an ``Interrupted`` event (the worker's own last event still follows, once its slot
        and memory are free: ``when_stopped``)."""
        q = self._streams.get(rid)
        if q is not None:
            q.put_nowait(Interrupted())
        self._cancel_nowait(rid)

    async def ping(self) -> None:
        """Send a health ping; the pong updates ``last_pong_s``."""
        self._ping_seq += 1
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            await self._send({"op": "ping", "seq": self._ping_seq})

    async def kill(self, why: str = "") -> None:
        """SIGKILL the process (used on stop, load time-outs and hangs); it takes no new work
        from now on, though its exit is only seen a moment later. ``why`` (``hung``) is the
        kind its requests' ``WorkerGone`` then carries, in place of ``exited``."""
        if self._proc is not None and self._proc.returncode is None:
            self._killing = True
            self._killed_as = why or self._killed_as
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def stop(self) -> None:
        """Stop for good: close the channel, kill, and wait for the reader to finish."""
        self._advance(WorkerState.STOPPED)
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()
        await self.kill()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 5.0)

    def statistics(self) -> WorkerStatistics:
        age = None if self.last_pong_s is None else time.monotonic() - self.last_pong_s
        return WorkerStatistics(
            worker_id=self.spec.worker_id,
            lane=self.spec.lane,
            device=self.spec.device,
            state=self.state.value,
            pid=self.pid,
            slots=self.spec.slots,
            busy=self.busy,
            starts=self.starts,
            exits=self.exits,
            last_exit=self.last_exit,
            last_pong_age_s=None if age is None else round(age, 3),
            progress_tokens=self.progress,
            alloc_failures=self.alloc_failures,
            contexts=self.contexts,
            fingerprint=(self.info or {}).get("fingerprint"),
            # what it holds now (its last ``held`` report), not what it held when it was ready
            info=self.info if self.info is None or not self.held else self.info | {"held": self.held},
            waiting=self.waiting,
        )
