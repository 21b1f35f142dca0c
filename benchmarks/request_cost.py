"""Gateway CPU per request: what the gateway process itself spends (HTTP, validation, template
and tokenization, journal, scheduling, the worker channel) on many small requests.

Sends ``--requests`` requests at ``--concurrency`` (httpx clients in threads) of each kind:
1-token chat completions, and single-input embeddings. The gateway's own CPU time (user +
system of its process, not its workers') over the run, divided by the requests, is printed
with the requests per second.

    .venv/bin/python -m benchmarks.request_cost [--requests 200] [--concurrency 4] [--streams 6]
        [--no-breakdown]

Issue 13's target is <= 1 ms of gateway CPU per request; this prints where it stands, and how
much of it the gateway's idle loops (device and host-memory readings, health pings, the
HTTP server's tick: measured first, with no request) spend over the run's wall time. It then
streams ``--streams`` chat completions one after another and prints the gateway's CPU per
streamed token (what item 4's ratio at threads = cores pays for each token), idle loops included.

Each figure comes with the gateway's wake-ups (voluntary context switches of all its threads)
per request or token, and four floors measured on the same machine in the same run: ``GET
/health`` through the same server (the HTTP server and framework alone, no gateway work); after
the streams, a bare ASGI app under uvicorn (``benchmarks._bare_stream``, no framework)
streaming as many chunks at the same rate (the server stack's own cost a streamed token); and
what one thread's wake-up from a sleep costs here. A request crosses several wake-ups (the
HTTP read, the journal thread and back for each durable write, the worker and back), so the
machine's wake-up cost times their number is a floor under what a request can cost. The last
floor is SQLite alone (``journal_floor``: no gateway, no thread, no event loop) making the two
commits a request's durability needs, with the journal's schema and pragmas: the accept, fsynced
before the first byte, and the answer, committed before the client has it. After it, the journal
alone (``journal_alone``: ``runtime.journal.Journal`` in this process, an embedding's four writes
a request at the same concurrency, less the same tasks without it): the floor plus the journal's
thread hand-offs and its own Python, which a gateway with a durable accept a request cannot shed.

Each kind's figure is also given for the event loop's thread alone (both are read in the
kernel's clock ticks of 10 ms, so at 200 requests each is good to about 0.05 ms), and, unless
``--no-breakdown``, a second gateway (``benchmarks._profiled_serve``: its event loop under
cProfile, timed in the thread's CPU time) runs the same requests and the output says where the
loop's CPU goes: the share of each part (chat template, tokenization, journal, JSON, HTTP
server, validation, worker channel, admission, metrics, idle loops, the request lifecycle,
asyncio), how much of the loop's CPU the profiler saw as Python (the rest is uvloop's own C code
and system calls), and the gateway's CPU by thread (the event loop, the journal's). The profiler
slows every call, so its shares lean towards the parts that make many small calls; the figures
per request are the first gateway's, which runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil

if not __package__:  # run as a file (python benchmarks/x.py): import the package from the folder above
    sys.path.insert(0, f"{sys.path[0]}/..")

from benchmarks._common import cpu_s, sse_token_times, thread_cpu_s
from spillover.runtime import journal_bounds
from spillover.runtime.journal_records import SCHEMA
from spillover.testing import GatewayProcess
from spillover.testing.process import free_port

KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat, 1 token": (
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0},
    ),
    "embeddings, 1 input": ("/v1/embeddings", {"model": "bge-small-en", "input": "The cat sits on the mat."}),
}


HEALTH = "GET /health (HTTP only)"


def gateway_cpu_s(gw: GatewayProcess) -> float:
    assert gw.proc is not None
    return cpu_s(psutil.Process(gw.proc.pid))


def wakeups(gw: GatewayProcess) -> tuple[int, int]:
    """Voluntary context switches so far: of all the gateway's threads, and of its main thread
    (the event loop) alone (psutil's figure is the main thread's only)."""
    assert gw.proc is not None
    return process_wakeups(gw.proc.pid)


def process_wakeups(pid: int) -> tuple[int, int]:
    """``wakeups`` of any process: all its threads', and its main thread's."""
    total = main = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                n = int(f.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        total += n
        main += n if int(tid) == pid else 0
    return total, main


def loop_cpu_s(gw: GatewayProcess) -> float:
    """CPU seconds so far of the gateway's main thread, its event loop (user + system)."""
    assert gw.proc is not None
    return thread_cpu_s(gw.proc.pid, gw.proc.pid)


def wake_cost_us(n: int = 200, sleep_s: float = 0.01) -> float:
    """CPU microseconds one thread spends per wake-up from a short sleep on this machine (the
    scheduler's and the kernel's share of any hand-off between threads or processes)."""
    c0 = time.thread_time()
    for _ in range(n):
        time.sleep(sleep_s)
    return 1e6 * (time.thread_time() - c0) / n


def idle_cpu(gw: GatewayProcess, seconds: float = 5.0) -> float:
    """The gateway's CPU seconds per second with no request (its loops)."""
    c0, w0 = gateway_cpu_s(gw), time.perf_counter()
    time.sleep(seconds)
    return (gateway_cpu_s(gw) - c0) / (time.perf_counter() - w0)


class Cost(NamedTuple):
    """What the gateway spent on a run of requests, per request."""

    ms: float  # CPU ms, all its threads
    loop_ms: float  # of it, the event loop's thread
    rps: float  # requests per second
    wakes: float  # wake-ups, all its threads
    loop_wakes: float  # of them, the event loop's


def run(gw: GatewayProcess, path: str, body: dict[str, Any] | None, n: int, concurrency: int) -> Cost:
    """What ``n`` requests at ``concurrency`` cost the gateway; a GET when ``body`` is None."""
    method = "GET" if body is None else "POST"
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for _ in range(10):  # warm-up
            assert c.request(method, path, json=body).status_code == 200
    errors: list[int] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            for _ in range(n // concurrency):
                r = c.request(method, path, json=body)
                if r.status_code != 200:
                    errors.append(r.status_code)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    c0, l0, v0, w0 = gateway_cpu_s(gw), loop_cpu_s(gw), wakeups(gw), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c1, l1, v1, w1 = gateway_cpu_s(gw), loop_cpu_s(gw), wakeups(gw), time.perf_counter()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {sorted(set(errors))}")
    done = (n // concurrency) * concurrency
    return Cost(
        1000 * (c1 - c0) / done,
        1000 * (l1 - l0) / done,
        done / (w1 - w0),
        (v1[0] - v0[0]) / done,
        (v1[1] - v0[1]) / done,
    )


STREAM = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
    "max_tokens": 200,
    "temperature": 0,
}


def stream_cost(gw: GatewayProcess, streams: int) -> tuple[float, float, float]:
    """(gateway CPU us per streamed token, tokens per second, gateway wake-ups per token) over
    ``streams`` streams in a row."""
    with httpx.Client(base_url=gw.url, timeout=300) as c:
        sse_token_times(c, "/v1/chat/completions", STREAM)  # warm-up
        c0, v0, w0, tokens = gateway_cpu_s(gw), wakeups(gw), time.perf_counter(), 0
        for _ in range(streams):
            tokens += sse_token_times(c, "/v1/chat/completions", STREAM).tokens
        c1, v1, w1 = gateway_cpu_s(gw), wakeups(gw), time.perf_counter()
    return 1e6 * (c1 - c0) / max(1, tokens), tokens / (w1 - w0), (v1[0] - v0[0]) / max(1, tokens)


def stream_floor(tokens: int, tps: float) -> tuple[float, float]:
    """(CPU us per chunk, wake-ups per chunk) of a bare ASGI app (``benchmarks._bare_stream``)
    under uvicorn, with the gateway's event loop and HTTP parser, streaming ``tokens`` chunks
    at ``tps`` a second: what the server stack costs a streamed token before any gateway work."""
    port = free_port()
    root = str(Path(__file__).resolve().parents[1])  # where ``benchmarks`` is, from any working folder
    argv = [sys.executable, "-m", "uvicorn", "benchmarks._bare_stream:app", "--app-dir", root, "--port", str(port)]
    proc = subprocess.Popen([*argv, "--loop", "auto", "--http", "httptools", "--log-level", "warning"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            for _ in range(100):  # until it listens
                try:
                    c.get("/", params={"n": "0"})
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            p = psutil.Process(proc.pid)
            query = {"n": str(tokens), "every_s": str(1 / tps)}
            c0, v0 = cpu_s(p), p.num_ctx_switches().voluntary  # one thread: psutil's figure is all of it
            with c.stream("POST", "/", params=query) as r:
                got = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
            c1, v1 = cpu_s(p), p.num_ctx_switches().voluntary
    finally:
        proc.terminate()
        proc.wait()
    return 1e6 * (c1 - c0) / max(1, got), (v1 - v0) / max(1, got)


# Where the event loop's CPU goes (``--breakdown``): each function's own time in a profile of
# the loop's thread, put in the first part whose test its file (or a built-in's name) passes.
# A function that passes none (a built-in such as ``isinstance`` or a socket write, the standard
# library's ``re`` or ``dataclasses``) is counted in its callers' parts, as much in each as the
# profile says it spent called from there.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("chat template (Jinja)", ("/jinja2/", "llama_chat_format", "<template>")),
    # prepare.py's own time (its checks and limits too) counts as tokenization: most of it is
    ("tokenization", ("/llama_cpp/", "tokenizers", "spillover/engine/llama_engine.py", "spillover/runtime/prepare.py")),
    ("journal (SQLite)", ("spillover/runtime/journal", "sqlite3")),
    ("JSON", ("/json/", "orjson", "_json.")),  # the module's name, not a function's (app._read_json)
    ("HTTP server (uvicorn, Starlette)", ("/uvicorn/", "/starlette/", "httptools", "spillover/http/server.py")),
    ("validation, answers (spillover.http)", ("spillover/http/",)),
    ("worker channel", ("spillover/runtime/worker_client.py", "spillover/runtime/events.py")),
    ("admission, scheduling", ("spillover/runtime/scheduler.py", "spillover/core/", "spillover/runtime/service.py")),
    ("metrics (Prometheus)", ("prometheus_client", "spillover/metrics.py")),
    (
        "idle loops",
        (
            "spillover/runtime/loops.py",
            "spillover/runtime/hostmem.py",
            "spillover/runtime/devices.py",
            "spillover/runtime/supervisor.py",
            "spillover/runtime/ticks.py",
            "spillover/runtime/readiness.py",
            "spillover/engine/sim.py",
            "_observe_loop",
        ),
    ),
    ("request lifecycle", ("spillover/",)),
    ("asyncio, contextlib", ("/asyncio/", "_asyncio", "contextlib")),
]
OTHER = "other"  # a function none of whose callers the profile knows
Key = tuple[str, int, str]  # pstats: (file, line, function)


def part_of(key: Key) -> str | None:
    """The part ``key``'s own time goes to; None when its callers decide."""
    where = f"{key[0]}:{key[2]}"
    for part, marks in PARTS:
        if any(mark in where for mark in marks):
            return part
    return None


def attribute(stats: dict[Key, Any], key: Key, seconds: float, spent: dict[str, float], depth: int = 0) -> None:
    """Add ``seconds`` of ``key``'s own time to its part, or share them among its callers' parts."""
    part = part_of(key)
    callers: dict[Key, Any] = stats[key][4]
    if part is None and depth < 8 and callers:
        total = sum(c[2] for c in callers.values()) or 1.0  # each caller's share of the own time
        for caller, c in callers.items():
            if caller in stats:
                attribute(stats, caller, seconds * c[2] / total, spent, depth + 1)
        return
    part = part or OTHER
    spent[part] = spent.get(part, 0.0) + seconds


class Breakdown(NamedTuple):
    """Where a run's event-loop CPU went, from a profile of the loop's thread."""

    shares: dict[str, float]  # each part's share of the Python time the profiler saw
    seen: float  # the profiler's Python time over the loop thread's CPU (the rest: the loop's own C code)
    threads: dict[str, float]  # CPU seconds of each of the gateway's threads over the run, by name


def breakdown(out: Path) -> Breakdown:
    """Read what ``benchmarks._profiled_serve`` wrote at the end of a count."""
    stats: dict[Key, Any] = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    spent: dict[str, float] = {}
    for key, (_, _, own_s, _, _) in stats.items():
        attribute(stats, key, own_s, spent)
    python_s = sum(spent.values())
    threads: dict[str, float] = json.loads(Path(f"{out}.threads.json").read_text())
    return Breakdown(
        {part: s / python_s for part, s in spent.items()},
        python_s / max(threads.get("event loop", 0.0), 1e-9),
        threads,
    )


class ProfiledGateway(GatewayProcess):
    """A gateway whose event loop runs under the profiler (``benchmarks._profiled_serve``)."""

    module = "benchmarks._profiled_serve"


def profiled(gw: GatewayProcess, out: Path, path: str, body: dict[str, Any] | None, n: int, conc: int) -> Breakdown:
    """Run the requests with the profiler counting (SIGUSR2 starts it, SIGUSR1 writes it)."""
    assert gw.proc is not None
    run(gw, path, body, 10, 1)  # warm-up, not counted
    os.kill(gw.proc.pid, signal.SIGUSR2)
    time.sleep(0.2)  # the handler runs at the loop's next Python step
    run(gw, path, body, n, conc)
    os.kill(gw.proc.pid, signal.SIGUSR1)
    for _ in range(100):
        if Path(f"{out}.threads.json").exists():
            break
        time.sleep(0.05)
    time.sleep(0.2)  # written whole
    found = breakdown(out)
    out.unlink()
    Path(f"{out}.threads.json").unlink()
    return found


def print_breakdowns(found: dict[str, Breakdown]) -> None:
    parts = [part for part, _ in PARTS] + [OTHER]
    print(
        "where the event loop's CPU goes (a second gateway, its loop under cProfile in thread CPU time: shares"
        " of the Python time the profiler saw; the profiler's own cost inflates the parts with many calls)"
    )
    print(f"{'part':<38}" + "".join(f"{kind:>22}" for kind in found))
    for part in parts:
        print(f"{part:<38}" + "".join(f"{100 * b.shares.get(part, 0.0):>21.1f}%" for b in found.values()))
    print(
        f"{'Python seen by the profiler':<38}"
        + "".join(f"{100 * min(b.seen, 1.0):>21.0f}%" for b in found.values())
        + "  of the loop's CPU (the rest: uvloop's C code, system calls)"
    )
    for kind, b in found.items():
        total = sum(b.threads.values())
        others = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in sorted(b.threads.items()) if s > 0)
        print(f"  {kind}: the gateway's CPU by thread: {others}")


def journal_floor(n: int, body: dict[str, Any], answer: bytes) -> float:
    """CPU ms a request of SQLite alone writing what the journal writes for one request
    (``runtime.journal``: the accept with its transitions, committed with synchronous=FULL;
    the terminal move with the stored answer and its transition, synchronous=NORMAL), on the
    journal's schema and pragmas, one request after another on this thread."""
    text = json.dumps(body)
    with tempfile.TemporaryDirectory() as d:
        db = sqlite3.connect(Path(d) / "journal.db", isolation_level=None)
        journal_bounds.configure(db, 256 * 1024 * 1024)
        db.executescript(SCHEMA)
        add = "INSERT INTO transitions (rid, t_s, from_state, to_state, route, attempt) VALUES (?,?,?,?,?,?)"

        def one() -> None:
            rid, now = uuid.uuid4().hex, time.time()
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT INTO requests (id, idem_key, body_hash, kind, stream, body, model, state, attempts,"
                " created_s, updated_s) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (rid, None, "0" * 64, "embeddings", 0, text, body["model"], "queued", 0, now, now),
            )
            moves = [(rid, now, "received", "accepted", None, 0), (rid, now, "accepted", "queued", None, 0)]
            db.executemany(add, moves)
            db.execute("COMMIT")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE requests SET state=?, updated_s=?, finished_s=?, status_code=?, response=?, content_type=?"
                " WHERE id=?",
                ("completed", now, now, 200, answer, "application/json", rid),
            )
            db.execute(add, (rid, now, "running", "completed", "gpu", 0))
            db.execute("COMMIT")

        for _ in range(20):  # warm-up
            one()
        c0 = time.thread_time()
        for _ in range(n):
            one()
        ms = 1000 * (time.thread_time() - c0) / n
        db.close()
    return ms


class JournalCost(NamedTuple):
    ms: float  # process CPU a request, less the same tasks' own cost without the journal
    thread_ms: float  # of it, on the journal's thread
    wakes: float  # voluntary context switches a request, less the tasks' own


GAP_S = 0.003  # between a request's writes: the work between them (admission, the worker)


def journal_alone(n: int, conc: int, body: dict[str, Any], answer: bytes) -> JournalCost:
    """What ``runtime.journal.Journal`` itself costs a request, in this process: ``conc`` tasks
    on uvloop each writing what the gateway writes for an embedding (the accept, fsynced; two
    noted moves; the terminal move with the stored answer), ``GAP_S`` apart, less the same tasks
    with no journal. Between the SQLite floor (``journal_floor``) and what the journal costs
    inside the gateway, where its thread and the event loop also compete for the GIL."""
    import asyncio

    import uvloop

    from spillover.core.lifecycle import State
    from spillover.runtime.journal import Journal

    text = json.dumps({"endpoint": "embeddings", "body": body})

    def counters() -> tuple[float, float, int]:
        """This process's CPU, its threads' but the event loop's, and its wake-ups, as the
        gateway's are read (``gateway_cpu_s``, ``loop_cpu_s``, ``wakeups``)."""
        pid = os.getpid()
        total = cpu_s(psutil.Process(pid))
        return total, total - thread_cpu_s(pid, pid), process_wakeups(pid)[0]

    async def one(j: Journal | None) -> None:
        rid = uuid.uuid4().hex
        if j is not None:
            await j.accept(
                rid=rid, idem_key=None, body_hash="0" * 64, kind="embeddings", stream=False,
                body=text, model=body["model"], queued={"attempts": 1},
            )  # fmt: skip
        await asyncio.sleep(GAP_S)
        if j is not None:
            j.note_move(rid, State.ADMITTED, route="gpu", attempts=1)
            j.note_move(rid, State.RUNNING)
        await asyncio.sleep(GAP_S)
        if j is not None:
            await j.move(
                rid, State.COMPLETED, status_code=200, response=answer, content_type="application/json", route="gpu"
            )

    async def run(j: Journal | None) -> tuple[float, float, int]:
        async def worker() -> None:
            for _ in range(n // conc):
                await one(j)

        await asyncio.gather(*(worker() for _ in range(conc)))  # warm-up
        a = counters()
        await asyncio.gather(*(worker() for _ in range(conc)))
        b = counters()
        return b[0] - a[0], b[1] - a[1], b[2] - a[2]

    async def both() -> JournalCost:
        with tempfile.TemporaryDirectory() as d:
            j = Journal(Path(d) / "journal.sqlite3", retention_s=3600, max_requests=1_000_000)
            await j.open()
            try:
                with_j = await run(j)
            finally:
                await j.close()
        without = await run(None)
        done = (n // conc) * conc
        cpu, thread, wakes = (w - o for w, o in zip(with_j, without, strict=True))
        return JournalCost(1000 * cpu / done, 1000 * thread / done, wakes / done)

    return uvloop.run(both())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--streams", type=int, default=6, help="streamed completions for the per-token figure")
    ap.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="then, on a second gateway with its event loop under a profiler, where the loop's CPU goes",
    )
    a = ap.parse_args()
    with GatewayProcess(["--gpu", "sim:1024"], services=("chat", "embeddings")) as gw:
        time.sleep(2)  # start-up work (readiness measurements) settles
        idle = idle_cpu(gw)
        print(f"{a.requests} requests at concurrency {a.concurrency}; gateway process CPU (user + system)")
        print(f"idle gateway: {1000 * idle:.1f} ms of CPU a second")
        print(
            f"{'kind':<24} {'CPU ms/request':>15} {'(event loop)':>13} {'of it idle loops':>17} {'requests/s':>11}"
            f" {'wake-ups (event loop)':>22}"
        )
        emb_path, emb_body = KINDS["embeddings, 1 input"]
        with httpx.Client(base_url=gw.url, timeout=120) as c:  # the answer the journal stores (journal_floor)
            answer = c.post(emb_path, json=emb_body).content
        worst = 0.0
        for name, (path, body) in {**KINDS, HEALTH: ("/health", None)}.items():
            cost = run(gw, path, body, a.requests, a.concurrency)
            if name != HEALTH:  # the floor, not a kind of request the target is about
                worst = max(worst, cost.ms)
            both = f"{cost.wakes:.1f} ({cost.loop_wakes:.1f})"
            print(
                f"{name:<24} {cost.ms:>15.2f} {cost.loop_ms:>13.2f} {1000 * idle / cost.rps:>17.2f}"
                f" {cost.rps:>11.1f} {both:>22}"
            )
        if a.streams > 0:
            us, tps, token_wakes = stream_cost(gw, a.streams)
            print(
                f"streamed chat tokens (one stream at a time): {us:.0f} us of gateway CPU a token at {tps:.1f} tok/s,"
                f" {token_wakes:.1f} wake-ups a token (idle loops included)"
            )
            floor_us, floor_wakes = stream_floor(max(50, round(8 * tps)), tps)
            print(
                f"floor: a bare ASGI app under uvicorn streaming a chunk every {1000 / tps:.0f} ms: {floor_us:.0f} us"
                f" of CPU a chunk, {floor_wakes:.1f} wake-ups a chunk"
            )
    if a.breakdown:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "loop.prof"
            os.environ["SPILLOVER_PROFILE_OUT"] = str(out)  # the gateway's, from its start
            with ProfiledGateway(["--gpu", "sim:1024"], services=("chat", "embeddings")) as gw:
                time.sleep(2)
                found = {
                    name: profiled(gw, out, path, body, a.requests, a.concurrency)
                    for name, (path, body) in KINDS.items()
                }
        print_breakdowns(found)
    print(f"floor: one thread's wake-up from a sleep on this machine costs {wake_cost_us():.0f} us of CPU")
    print(
        f"floor: SQLite alone making an embedding's two journal commits (accept with fsync, answer):"
        f" {journal_floor(a.requests, emb_body, answer):.2f} ms of CPU a request"
    )
    jc = journal_alone(max(a.requests, 400), a.concurrency, emb_body, answer)
    print(
        f"the journal alone (runtime.journal, an embedding's four writes, {a.concurrency} requests at once,"
        f" {1000 * GAP_S:.0f} ms apart, on uvloop): {jc.ms:.2f} ms of CPU a request ({jc.thread_ms:.2f} on its"
        f" thread), {jc.wakes:.1f} wake-ups"
    )
    print("target: <= 1 ms of gateway CPU per request:", "MET" if worst <= 1.0 else "NOT MET")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
