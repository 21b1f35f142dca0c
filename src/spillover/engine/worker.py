"""The worker process: one engine instance (one model on one device).

``DeviceWorker`` is what every kind shares (the channel, the device, the op loop); ``Worker``
is the chat kind (llama.cpp); ``engine.embed_worker.EmbedWorker`` the embeddings kind and
``engine.transcribe_worker.TranscribeWorker`` the transcription kind, whose ops and events
are in their own docstrings.

Channel: newline-delimited JSON over the process's stdin (gateway -> worker) and a private
duplicate of its original stdout (worker -> gateway). File descriptor 1 is pointed at
stderr at start-up, so nothing that llama.cpp or a library prints can corrupt the channel.

Gateway -> worker ops::

    {"op": "generate", "rid", "tokens", "max_tokens", "temperature", "top_p", "seed",
     "stop", "grammar", "kv_tokens", "reserve_bytes", "prefix", "frequency_penalty",
     "presence_penalty", "repeat_penalty", "top_k", "min_p", "logit_bias", "logprobs", "coalesce_s"}
    {"op": "cancel", "rid"}
    {"op": "ping", "seq"}
    {"op": "readiness", "mode"}               keep warm | mmap | on_demand ready (chat: ``Engine``;
                                              embeddings, transcription: ``engine.holder``)

Worker -> gateway events::

    {"ev": "ready", "info": {...}}            once, after the model is loaded
    {"ev": "started", "rid"}                  memory granted, generation begins
    {"ev": "token", "rid", "id", "text"[, "lp"]}  one per generated token; "lp" when logprobs
                                              were asked: [logprob, piece bytes, [[id, bytes, logprob]...]].
                                              With "coalesce_s" > 0 the tokens after the first are
                                              sent at most every coalesce_s (about: ``TokenBatch``):
                                              plain ones as one event (texts joined, "id" the last
                                              token's, "ids" every token's in order), all in one write;
                                              any write takes every request's waiting tokens along
    {"ev": "done", "rid", "finish_reason", "prompt_tokens", "completion_tokens", "timings"}
    {"ev": "error", "rid", "kind", "message"} kind: alloc_failed | oom | diverged | engine
                                              | context_overflow | bad_grammar | empty_prompt (the request's fault)
    {"ev": "pong", "seq", "progress", "contexts"}  progress: tokens generated so far, in total
    {"ev": "held", "mode", "model", "contexts", "timings"}  what the engine holds changed
                                              (timings: the latest load_ms, ctx_ms, first_ms)
    {"ev": "fatal", "kind", "message"}        then the process exits

On a ``sim`` device the worker charges the shared ledger for the weights at load and for
each request's reservation (KV pages + compute) before generating; a refused allocation is
an ``alloc_failed`` error and nothing is generated. A driver reset ("epoch" change) makes
the worker exit at once, as a real worker would lose its context. A device hang stops
token progress while pings are still answered.
"""

from __future__ import annotations

import abc
import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO, Any

from spillover.engine.holder import MODES

LOAD_POLL_S = 0.01  # how often a request waiting for its model's load looks for its cancel
SIM_WATCH_S = 0.05  # how often the sim device's change counter is looked at (a reset or hang is seen within this)

__all__ = ["main"]

EXIT_DEVICE_LOST = 75
EXIT_LOAD_FAILED = 3
PAGE_TOKENS = 16


def _error(rid: str, kind: str, message: str) -> dict[str, Any]:
    """The ``error`` event that ends a request."""
    return {"ev": "error", "rid": rid, "kind": kind, "message": message}


class Channel:
    """Thread-safe writer of JSON lines to the gateway.

    Every write takes with it the token events that wait in any request's ``TokenBatch``
    (written first, each request's in its order): a write costs the gateway a wake-up (and each
    stream's client one more) on cores the engine is using, so the tokens of the requests a
    worker runs at once go in one write instead of one write each. A waiting event only goes
    earlier than its window said, never later."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self.lock = threading.Lock()
        self.holding: list[TokenBatch] = []  # batches with events waiting (under ``lock``)

    def send(self, *msgs: dict[str, Any]) -> None:
        """Write the messages as lines, in one write, after what the batches hold."""
        lines = "".join(_line(msg) for msg in msgs)
        with self.lock:
            self.write_locked(lines)

    def write_locked(self, lines: str = "") -> None:
        """Write every batch's waiting events, then ``lines``, in one write (``lock`` held)."""
        held = [ev for batch in self.holding for ev in batch.take()]
        self.holding.clear()
        text = "".join(_line(ev) for ev in held) + lines
        if not text:
            return
        try:
            self._out.write(text)
            self._out.flush()
        except (BrokenPipeError, ValueError):
            os._exit(0)


def _line(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":")) + "\n"


class TokenBatch:
    """A request's token events on their way to the gateway.

    With ``window`` 0 each is sent as it comes. Otherwise (the gateway's choice: a stream's
    window is ``[server].stream_coalesce_ms``, a request whose tokens the client does not see
    one by one gets a longer one) the first is sent at once (it marks the first token), and a
    later one waits while tokens come less than ``window`` apart, until ``window`` has passed
    since the oldest waiting one, or until ``flush``, or until any write on the channel (another
    request's, which takes it along: ``Channel``): consecutive plain tokens become one
    event (their texts joined, ``id`` the last token's, ``ids`` every real token's in order,
    so a stream's gateway knows each token it delivered), and the waiting events go in one
    write. A token that comes ``window`` or more after the one before it is sent at once
    (with what waits), so between two writes the gateway waits at most the engine's own
    longest gap plus ``2 * window``: each channel message costs the gateway a wake-up (and a
    stream's client one more) on a machine whose cores the engine uses, and the gateway waits
    two windows longer than its stall bound for the request's tokens."""

    def __init__(self, chan: Channel, window: float) -> None:
        self._chan = chan
        self._window = window
        self._waiting: list[dict[str, Any]] = []  # under the channel's lock: another write takes them
        self._since = 0.0  # when the oldest waiting event came
        self._last = 0.0  # when the latest token came
        self._sent_any = False

    def add(self, ev: dict[str, Any]) -> None:
        if self._window <= 0:  # a stream: no clock read per token
            self._chan.send(ev)
            return
        now = time.monotonic()
        slow, self._last = now - self._last >= self._window, now
        if not self._sent_any:
            self._sent_any = True
            self._chan.send(ev)
            return
        with self._chan.lock:
            last = self._waiting[-1] if self._waiting else None
            if last is not None and "lp" not in last and "lp" not in ev:
                ids = last.get("ids")
                if ids is None:
                    ids = last["ids"] = [last["id"]] if last["id"] >= 0 else []
                if ev["id"] >= 0:  # -1: text released at the end, no token of its own
                    ids.append(ev["id"])
                    last["id"] = ev["id"]
                last["text"] += ev["text"]
            else:
                if not self._waiting:
                    self._since = now
                    self._chan.holding.append(self)
                self._waiting.append(ev)
            if slow or now - self._since >= self._window:
                self._chan.write_locked()

    def take(self) -> list[dict[str, Any]]:
        """The waiting events, now on their way (the channel's lock held)."""
        waiting, self._waiting = self._waiting, []
        return waiting

    def flush(self) -> None:
        with self._chan.lock:
            if self._waiting:
                self._chan.write_locked()


class DeviceWorker(abc.ABC):
    """What every worker kind shares: the channel, the device handle (the sim ledger's weights
    charge, its watcher), per-request cancel flags and the op loop. A kind loads its engine
    in ``load()`` and runs one request in ``run_request()``."""

    request_op = "generate"

    def __init__(self, args: argparse.Namespace, chan: Channel) -> None:
        self.args = args
        self.chan = chan
        self.cancelled: set[str] = set()
        self.active: set[str] = set()  # requests received and not yet answered (their last event)
        self._active_lock = threading.Lock()
        self.progress = 0
        self.hang = threading.Event()
        self.oom_armed = threading.Event()
        self.sim = None
        self.sim_epoch = 0
        self.kind = args.device.split(":", 1)[0]
        if self.kind == "sim":
            from spillover.engine.sim import SimDevice

            self.sim = SimDevice(args.state_dir, args.sim_name)
            snap = self.sim.snapshot()
            self.sim_epoch = snap.epoch
            if not self.sim.allocate("weights", args.weights_bytes, owner=args.worker_id):
                chan.send(
                    {
                        "ev": "fatal",
                        "kind": "alloc_failed",
                        "message": f"sim device refused {args.weights_bytes} bytes of weights",
                    }
                )
                sys.exit(EXIT_LOAD_FAILED)
        self.fingerprint: dict[str, str] = {}
        self.ready_sent = False
        self.keeper: Any = None  # what keeps the model as ready as asked (Engine, ModelHolder); set by load()
        t0 = time.monotonic()
        self.load()
        self.load_s = time.monotonic() - t0
        self.pool = ThreadPoolExecutor(max_workers=args.slots, thread_name_prefix="slot")

    @abc.abstractmethod
    def load(self) -> None:
        """Load the kind's engine (sets ``fingerprint``)."""

    @abc.abstractmethod
    def run_request(self, msg: dict[str, Any]) -> None:
        """Run one request op; its last event is sent through ``finish``."""

    def stop_now(self, rid: str) -> None:
        """``rid`` was just marked cancelled (under ``_active_lock``): a kind whose engine can
        stop inside a step does so here. The others see the mark between steps."""
        return None

    def run_charged(self, msg: dict[str, Any], compute: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        """Run one request that holds a single reservation while it computes (embeddings,
        transcription): charge ``reserve_bytes`` (a refusal is ``alloc_failed`` and nothing
        runs), ``compute`` it, give the bytes back, then send its last event. An engine
        exception ends the request (``engine``), never the worker."""
        rid = str(msg["rid"])
        final = _error(rid, "engine", "worker interrupted")
        reserve = int(msg.get("reserve_bytes") or 0)
        charged = False
        try:
            if not self.charge(rid, reserve):
                final = _error(rid, "alloc_failed", f"device refused {reserve} bytes")
                return
            charged = True
            final = compute(rid, msg)
        except Exception as exc:  # engine failure: report, keep serving
            final = _error(rid, "engine", f"{type(exc).__name__}: {exc}")
        finally:
            if charged:
                self.uncharge(rid)
            self.finish(rid, final)

    def contexts(self) -> int:
        """Slot contexts created so far (reported in pongs)."""
        return 0

    def charge(self, rid: str, reserve: int) -> bool:
        """Charge the sim ledger for a request's reservation (``req:<rid>``); True when granted
        (always on a real device, which allocates for itself)."""
        if self.sim is None or reserve <= 0:
            return True
        return self.sim.allocate(f"req:{rid}", reserve, owner=self.args.worker_id)

    def uncharge(self, rid: str) -> None:
        """Give a request's reservation back to the sim ledger. A ledger that cannot be written
        is logged, never raised: the request's last event must still go out (a worker that
        never ends a request is killed as hung)."""
        if self.sim is None:
            return
        try:
            self.sim.free(f"req:{rid}")
        except Exception as exc:  # a ledger it cannot write or read
            print(f"could not give back req:{rid} in the sim ledger: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _held(self) -> None:
        """Tell the gateway what the engine holds now (a ``held`` event: mode, model,
        contexts and the latest load / context / first-token timings); before ``ready``
        the ready event's info carries it."""
        if self.keeper is not None and self.ready_sent:
            self.chan.send({"ev": "held", **self.keeper.held()})

    def set_readiness(self, mode: str) -> None:
        try:
            self.keeper.set_readiness(mode)
        except Exception as exc:  # a load that fails is reported, the worker keeps serving
            print(f"readiness {mode} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._held()

    def info(self) -> dict[str, Any]:
        """The ``ready`` event's info."""
        held = {"held": self.keeper.held()} if self.keeper is not None else {}
        return held | {
            "pid": os.getpid(),
            "worker_id": self.args.worker_id,
            "kind": self.args.kind,
            "device": self.args.device,
            "slots": self.args.slots,
            "load_s": round(self.load_s, 3),
            "fingerprint": self.fingerprint,
            "weights_bytes": self.args.weights_bytes,
        }

    # -- sim device watcher ---------------------------------------------------------
    def watch_device(self) -> None:
        assert self.sim is not None
        seen, last_full = -1, 0.0
        while True:
            time.sleep(SIM_WATCH_S)
            count, now = self.sim.change_count(), time.monotonic()  # a read of mapped memory per tick
            if count == seen and now - last_full < self.sim.FULL_READ_S:
                continue  # unchanged ledger: the reset, hang and fault flags are as they were
            seen, last_full = count, now
            snap = self.sim.snapshot()
            if snap.epoch != self.sim_epoch:
                self.chan.send({"ev": "fatal", "kind": "device_lost", "message": "sim driver reset"})
                os._exit(EXIT_DEVICE_LOST)
            if snap.hang:
                self.hang.set()
            else:
                self.hang.clear()
            if snap.fail_running > 0:
                self.oom_armed.set()
            else:
                self.oom_armed.clear()

    def finish(self, rid: str, final: dict[str, Any]) -> None:
        """A request's last event, sent once its slot and memory are back."""
        with self._active_lock:
            self.cancelled.discard(rid)
            self.active.discard(rid)
        self.chan.send(final)

    def serve(self, inp: IO[str]) -> None:
        if self.sim is not None:
            threading.Thread(target=self.watch_device, daemon=True, name="sim-watch").start()
        self.chan.send({"ev": "ready", "info": self.info()})
        self.ready_sent = True
        for line in inp:
            if not line.strip():
                continue
            msg = json.loads(line)
            op = msg.get("op")
            if op == self.request_op:
                with self._active_lock:
                    self.active.add(str(msg["rid"]))
                self.pool.submit(self.run_request, msg)
            elif op == "cancel":
                with self._active_lock:  # a cancel for a request already answered is dropped
                    if str(msg["rid"]) in self.active:
                        self.cancelled.add(str(msg["rid"]))
                        self.stop_now(str(msg["rid"]))
            elif op == "readiness" and self.keeper is not None:
                threading.Thread(target=self.set_readiness, args=(str(msg.get("mode")),), daemon=True).start()
            elif op == "ping":
                self.chan.send(
                    {
                        "ev": "pong",
                        "seq": msg.get("seq"),
                        "progress": self.progress,
                        "contexts": self.contexts(),
                    }
                )
        # stdin closed: the gateway is gone; leave without waiting for work.
        os._exit(0)


class UnaryWorker(DeviceWorker):
    """A kind with one whole answer per request (embeddings, transcription): one model that
    every slot shares, kept as ready as ``--readiness`` says by an ``engine.holder.ModelHolder``.
    A CPU replica probes its model once at start (the step timings its readiness is picked
    by); a worker on a device loads it and is done."""

    @abc.abstractmethod
    def load_model(self) -> Any:
        """Load the kind's model (called again after the holder dropped it)."""

    @abc.abstractmethod
    def probe(self, model: Any) -> None:
        """Run a tiny request on ``model`` (timed: the first result after a load)."""

    @abc.abstractmethod
    def model_fingerprint(self) -> dict[str, str]:
        """The fingerprint's parts (read from the files: the model need not be loaded)."""

    @abc.abstractmethod
    def compute(self, model: Any, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
        """Run one request on ``model``; its last event."""

    def load(self) -> None:
        from spillover.engine.holder import ModelHolder

        self.fingerprint = self.model_fingerprint()
        self.keeper = ModelHolder(self.load_model, self.probe, readiness=self.args.readiness, on_change=self._held)
        if self.kind == "cpu":
            self.keeper.measure()
        else:
            self.keeper.start()

    def run_request(self, msg: dict[str, Any]) -> None:
        self.run_charged(msg, self._compute)

    def between_steps(self, rid: str, part: str, *, faults: bool = True) -> dict[str, Any] | None:
        """Before each step of a request (a chunk, a segment, a window): wait while the (sim)
        device hangs; then its last event if it was cancelled, or (``faults``) if an injected
        fault fails the running ``part`` (the encoder, the decoder); None to go on."""
        while self.hang.is_set() and rid not in self.cancelled:
            time.sleep(0.01)
        if rid in self.cancelled:
            return _error(rid, "cancelled", "cancelled")
        if faults and self.sim is not None and self.oom_armed.is_set() and self.sim.take_running_fault():
            return _error(rid, "oom", f"device out of memory in the {part}")
        return None

    def _compute(self, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
        """Wait for the model (an unloaded one loads now), answering a cancel meanwhile at once:
        the gateway waits only so long for a cancelled request's end, and a load can take
        longer (``ModelHolder.load_soon``); then run the request."""
        loading = self.keeper.load_soon()
        while not wait([loading], timeout=LOAD_POLL_S).done:
            if rid in self.cancelled:
                return _error(rid, "cancelled", "cancelled")
        loading.result()  # a load that failed is this request's engine error
        with self.keeper.use() as model:
            return self.compute(model, rid, msg)


class Worker(DeviceWorker):
    """A chat worker: llama.cpp slots generating tokens. A cancel stops its request's
    running decode at once (``Engine.abort``), a long prompt's prefill included: its slot
    (and its device reservation) are not held for the rest of a prompt nobody waits for."""

    def stop_now(self, rid: str) -> None:
        if (slot := self._slot_of.get(rid)) is not None:
            self.engine.abort(slot)

    def load(self) -> None:
        from spillover.engine.llama_engine import Engine, Tokenizer, fingerprint_parts

        self._slot_of: dict[str, int] = {}  # running requests' slots, under _active_lock

        args = self.args
        self.engine = Engine(
            args.model,
            slots=args.slots,
            n_ctx=args.n_ctx,
            n_threads=args.n_threads,
            n_batch=args.n_batch,
            n_gpu_layers=args.gpu_layers if self.kind == "cuda" else 0,
            readiness=args.readiness,
            on_change=self._held,
        )
        self.keeper = self.engine
        self.engine.measure()
        tok = Tokenizer(args.model)
        backend = "cuda" if self.kind == "cuda" else "cpu"
        self.fingerprint = fingerprint_parts(
            args.model, tok, backend, cache_dir=Path(args.state_dir), n_batch=args.n_batch
        )

    def contexts(self) -> int:
        return self.engine.contexts

    def info(self) -> dict[str, Any]:
        return super().info() | {"slots": self.engine.slots, "n_ctx": self.args.n_ctx}

    def _page_fault(self) -> bool:
        """At a KV page boundary: does an injected running-OOM fault hit this request?"""
        if self.sim is None or not self.oom_armed.is_set():
            return False
        return self.sim.take_running_fault()

    # -- requests ---------------------------------------------------------------------
    def run_request(self, msg: dict[str, Any]) -> None:
        """Run one request; its last event (done or error) is sent only after its slot and
        device memory are back, so the gateway never counts them free too early."""
        from spillover.engine.llama_engine import RequestRefused

        rid = str(msg["rid"])
        final = _error(rid, "engine", "worker interrupted")
        slot = self.engine.acquire_slot()
        reserve = int(msg.get("reserve_bytes") or 0)
        charged = False
        try:
            if slot is None:
                final = _error(rid, "engine", "no free slot")
                return
            with self._active_lock:  # a cancel from now on stops the slot's decode (stop_now)
                self._slot_of[rid] = slot
            if not self.charge(rid, reserve):
                final = _error(rid, "alloc_failed", f"device refused {reserve} bytes")
                return
            charged = True
            final = self._generate(rid, slot, msg)
        except RequestRefused as exc:  # the request's own fault: never counted against the device
            final = _error(rid, exc.kind, exc.message)
        except Exception as exc:  # engine failure: report, keep serving
            final = _error(rid, "engine", f"{type(exc).__name__}: {exc}")
        finally:
            if charged:
                self.uncharge(rid)
            if slot is not None:
                with self._active_lock:  # before the slot can serve another request
                    self._slot_of.pop(rid, None)
                self.engine.release_slot(slot)
            self.finish(rid, final)

    def _generate(self, rid: str, slot: int, msg: dict[str, Any]) -> dict[str, Any]:
        from spillover.engine.llama_engine import GenerateParams, Step

        params = GenerateParams(
            max_tokens=int(msg["max_tokens"]),
            temperature=float(msg.get("temperature", 1.0)),
            top_p=float(msg.get("top_p", 1.0)),
            seed=int(msg.get("seed", 0)),
            stop=tuple(msg.get("stop") or ()),
            grammar=msg.get("grammar"),
            frequency_penalty=float(msg.get("frequency_penalty", 0.0)),
            presence_penalty=float(msg.get("presence_penalty", 0.0)),
            repeat_penalty=float(msg.get("repeat_penalty", 1.0)),
            top_k=int(msg.get("top_k", 0)),
            min_p=float(msg.get("min_p", 0.0)),
            logit_bias=tuple((int(t), float(b)) for t, b in msg.get("logit_bias") or ()),
            logprobs=int(msg.get("logprobs", -1)),
        )
        tokens = [int(t) for t in msg["tokens"]]
        prefix = [int(t) for t in msg.get("prefix") or []]
        kv_tokens = int(msg.get("kv_tokens") or self.args.n_ctx)
        self.chan.send({"ev": "started", "rid": rid})
        t0 = time.monotonic()
        t_first: float | None = None
        n = 0
        finish = "stop"
        batch = TokenBatch(self.chan, float(msg.get("coalesce_s") or 0.0))
        try:
            for item in self.engine.generate(
                slot, tokens, params, kv_tokens=kv_tokens, should_stop=lambda: rid in self.cancelled, prefix=prefix
            ):
                while self.hang.is_set() and rid not in self.cancelled:
                    time.sleep(0.01)
                if isinstance(item, Step):
                    if item.token_id >= 0:
                        n += 1
                        self.progress += 1
                        if t_first is None:
                            t_first = time.monotonic()
                        if n % PAGE_TOKENS == 0 and self._page_fault():
                            return _error(rid, "oom", "device out of memory growing the KV cache")
                    ev: dict[str, Any] = {"ev": "token", "rid": rid, "id": item.token_id, "text": item.text}
                    if item.logprob is not None:
                        ev["lp"] = [
                            item.logprob,
                            list(item.piece),
                            [[a.token_id, list(a.piece), a.logprob] for a in item.top],
                        ]
                    batch.add(ev)
                else:
                    finish = item
        finally:
            batch.flush()  # what waits goes before the request's last event
        if finish == "diverged":
            return _error(rid, "diverged", "continuation differs from the delivered tokens")
        t1 = time.monotonic()
        return {
            "ev": "done",
            "rid": rid,
            "finish_reason": finish,
            "prompt_tokens": len(tokens) + len(prefix),
            "completion_tokens": n,
            "timings": {"prefill_s": round((t_first or t1) - t0, 6), "total_s": round(t1 - t0, 6)},
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spillover-worker", description=__doc__.split("\n")[0])
    p.add_argument("--worker-id", required=True)
    p.add_argument(
        "--kind", default="chat", choices=("chat", "embeddings", "transcription"), help="what the worker serves"
    )
    p.add_argument("--batch-size", type=int, default=32, help="embeddings: inputs per encoder run")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu", help="cpu | cuda:N | sim:<capacity_mib>")
    p.add_argument("--sim-name", default="sim0")
    p.add_argument("--state-dir", default="var/spillover")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--n-threads", type=int, default=1)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--weights-bytes", type=int, default=0)
    p.add_argument(
        "--gpu-layers", type=int, default=-1, help="chat on cuda: layers on the device (-1 all; a split worker fewer)"
    )
    p.add_argument(
        "--readiness",
        default="warm",
        choices=MODES,
        help="what to keep ready between requests (warm: the model and every slot's context; mmap: the "
        "model, contexts on first use; on_demand: nothing, the model loads at the first request). Embeddings "
        "and transcription have no per-request context: warm and mmap both keep the model",
    )
    return p.parse_args(argv)


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this worker when the gateway that started it dies (Linux's
    ``PR_SET_PDEATHSIG``); False where there is no such call. A worker notices its gateway's
    end by its stdin's EOF, but a stopped or hung one (SIGSTOP, a wedged driver call) never
    reads it: it kept its device memory, and its reservations in the sim ledger, past its
    gateway's SIGKILL and beside the next gateway's workers (round 49b). A signal reaches it
    stopped or not, and its memory goes back as a dead process's does."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m spillover.engine.worker ...``."""
    die_with_parent()
    args = parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    chan = Channel(proto)
    try:
        worker: DeviceWorker
        if args.kind == "embeddings":
            from spillover.engine.embed_worker import EmbedWorker

            worker = EmbedWorker(args, chan)
        elif args.kind == "transcription":
            from spillover.engine.transcribe_worker import TranscribeWorker

            worker = TranscribeWorker(args, chan)
        else:
            worker = Worker(args, chan)
    except SystemExit:
        raise
    except Exception as exc:
        chan.send({"ev": "fatal", "kind": "load_failed", "message": f"{type(exc).__name__}: {exc}"})
        sys.exit(EXIT_LOAD_FAILED)
    worker.serve(sys.stdin)


if __name__ == "__main__":
    main()
