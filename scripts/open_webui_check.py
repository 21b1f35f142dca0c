"""Driver of scripts/open-webui-check: a real Open WebUI, in headless Chromium, in front of a
degraded spillover gateway, with spillover's status filter installed and enabled.

Run by the Open WebUI venv's Python (it imports playwright); it talks HTTP with the standard
library only. Steps, each with a wait loop and a timeout (no fixed sleeps):

1. `spillover serve --chat-only` on a free loopback port with a fresh state folder (sim GPU);
   once its GPU worker holds its weights, `spillover tenant` takes all but a sliver of the
   simulated card, so chat requests are answered on the CPU lane.
2. Preflight: a streamed /v1/chat/completions whose first chunk must carry a `spillover`
   object with route "cpu" and a `notice`; that notice is the text the UI must show.
3. `open-webui serve` offline (fresh DATA_DIR, WEBUI_AUTH=false, OpenAI connection = the
   gateway), sign in as its single user, create the filter as a Function, turn it on and
   global, and mark the release notes as seen (no "What's New" modal over the chat).
4. Chromium: open a new chat with the model, send a message, wait for the answer to finish
   (Open WebUI's own chat record says done), assert the notice is shown in the assistant
   message's status line (not in the answer text), save the screenshot.
5. Stop everything it started (also on failure). Exit 0 on success, 1 when an assertion
   fails, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
MIB = 1024 * 1024
PROMPT = "Write one short sentence about the sea."


class CheckFailed(Exception):
    """An assertion about what the UI shows failed (exit 1)."""


class SetupError(Exception):
    """Something the check needs did not come up (exit 2)."""


def log(msg: str) -> None:
    print(f"[open-webui-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    what: str,
    probe: Callable[[], Any],
    timeout: float,
    interval: float = 0.5,
    proc: subprocess.Popen | None = None,
    logfile: Path | None = None,
) -> Any:
    """Poll probe() until it returns something truthy; SetupError after timeout, or as soon
    as proc (the server being waited for) has exited."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = logfile.read_text(errors="replace")[-3000:] if logfile and logfile.exists() else ""
            raise SetupError(f"{what}: process exited with {proc.returncode}\n{tail}")
        try:
            got = probe()
            if got:
                return got
        except Exception as e:  # a probe that fails is retried until the deadline
            last = e
        time.sleep(interval)
    raise SetupError(f"{what}: not within {timeout:.0f} s (last error: {last!r})")


def http(method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 30) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


class Procs:
    """The processes this check started, stopped in reverse order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, subprocess.Popen]] = []
        self.state_dir: Path | None = None

    def start(
        self, name: str, argv: list[str], logfile: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        with open(logfile, "ab") as fh:
            p = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.items.append((name, p))
        log(f"started {name} (pid {p.pid}), log {logfile}")
        return p

    def stop_all(self) -> None:
        for name, p in reversed(self.items):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    log(f"{name} ignored SIGTERM; killing it")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
            log(f"stopped {name} (exit {p.returncode})")
        # The gateway stops its workers itself; any left behind (a gateway killed hard) are
        # found by this run's own, unique state folder on their command line.
        if self.state_dir is not None:
            marker = str(self.state_dir).encode()
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                try:
                    cmd = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                if marker in cmd and b"spillover" in cmd:
                    log(f"killing leftover worker {d.name}")
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(d.name), signal.SIGKILL)


def sim_status(spillover: str, state_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [spillover, "sim", "--state-dir", str(state_dir), "status"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return json.loads(out)


def start_gateway(args: argparse.Namespace, procs: Procs, run_dir: Path) -> tuple[str, str]:
    state = run_dir / "spillover-state"
    state.mkdir()
    procs.state_dir = state
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    glog = run_dir / "gateway.log"
    gw = procs.start(
        "spillover gateway",
        [args.spillover, "serve", "--chat-only", "--port", str(port), "--state-dir", str(state)],
        glog,
    )
    models = wait_for(
        "gateway /v1/models", lambda: http("GET", f"{base}/v1/models", timeout=5), timeout=120, proc=gw, logfile=glog
    )
    model = models["data"][0]["id"]

    def workers_ready() -> bool:
        workers = http("GET", f"{base}/v1/status", timeout=5)["workers"]
        return bool(workers) and all(w.get("state") == "ready" for w in workers)

    # every worker ready (before that a request is routed to the CPU as "GPU not available")
    wait_for("gateway workers ready", workers_ready, timeout=180, proc=gw, logfile=glog)
    st = sim_status(args.spillover, state)
    if not any(a.get("tag") == "weights" and a.get("owner", "").startswith("gpu") for a in st["allocations"]):
        raise SetupError(f"the GPU worker holds no weights on the sim device: {st}")
    # leave only a sliver (less than the gateway's 32 MiB margin plus one request) free
    tenant_mib = int(st["free_bytes"] // MIB) - 36
    if tenant_mib <= 0:
        raise SetupError(f"sim device has no room for a tenant: {st}")
    tlog = run_dir / "tenant.log"
    tenant = procs.start(
        "spillover tenant",
        [args.spillover, "tenant", "--state-dir", str(state), "--mib", str(tenant_mib), "--name", "open-webui-check"],
        tlog,
    )
    wait_for(
        "tenant allocation",
        lambda: any(
            a.get("owner") == "tenant:open-webui-check" for a in sim_status(args.spillover, state)["allocations"]
        ),
        timeout=30,
        proc=tenant,
        logfile=tlog,
    )
    log(f"gateway {base} serves {model}; tenant holds {tenant_mib} MiB of the sim GPU")
    return base, model


def first_spillover_object(base: str, model: str) -> dict[str, Any]:
    """Stream one chat request; return the first chunk's `spillover` object (and read the
    stream to its end so the slot is free again)."""
    body = {"model": model, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}]}
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    sp: dict[str, Any] | None = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if sp is None and isinstance(chunk.get("spillover"), dict):
                sp = chunk["spillover"]
    if sp is None:
        raise SetupError("the gateway's stream carried no `spillover` object")
    return sp


def preflight(base: str, model: str) -> str:
    """The notice the gateway gives now: two answers in a row on the CPU with the same notice."""
    seen: list[str] = []

    def degraded() -> str | None:
        sp = first_spillover_object(base, model)
        log(f"preflight: route={sp.get('route')} reason={sp.get('reason')} notice={sp.get('notice')!r}")
        seen.append(str(sp.get("notice")) if sp.get("route") == "cpu" and sp.get("notice") else "")
        return seen[-1] if len(seen) >= 2 and seen[-1] and seen[-1] == seen[-2] else None

    return str(wait_for("a steady degraded (CPU) answer from the gateway", degraded, timeout=90, interval=0.2))


def owui_env(args: argparse.Namespace, gateway: str, data_dir: Path) -> dict[str, str]:
    """Open WebUI fully offline, single user, the gateway as its only (OpenAI) connection."""
    env = dict(os.environ)
    env.update(
        {
            "DATA_DIR": str(data_dir),
            "WEBUI_AUTH": "false",  # single-user mode: no signup page
            "WEBUI_SECRET_KEY": "spillover-open-webui-check",
            "OFFLINE_MODE": "true",  # no model downloads, no version check
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "ANONYMIZED_TELEMETRY": "false",
            "SCARF_NO_ANALYTICS": "true",
            "DO_NOT_TRACK": "true",
            "ENABLE_VERSION_UPDATE_CHECK": "false",
            "ENABLE_OLLAMA_API": "false",
            "ENABLE_OPENAI_API": "true",
            "OPENAI_API_BASE_URL": f"{gateway}/v1",
            "OPENAI_API_KEY": "sk-unused",
            # no local SentenceTransformer (it would look for all-MiniLM-L6-v2 on a hub);
            # RAG embeddings would go to the gateway, not used by this check
            "RAG_EMBEDDING_ENGINE": "openai",
            "RAG_EMBEDDING_MODEL": "bge-small-en",
            "RAG_OPENAI_API_BASE_URL": f"{gateway}/v1",
            "RAG_OPENAI_API_KEY": "sk-unused",
            "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
            "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
            "WHISPER_MODEL_AUTO_UPDATE": "false",
            # background tasks would send their own requests to the one CPU lane
            "ENABLE_TITLE_GENERATION": "false",
            "ENABLE_FOLLOW_UP_GENERATION": "false",
            "ENABLE_TAGS_GENERATION": "false",
            "ENABLE_AUTOCOMPLETE_GENERATION": "false",
        }
    )
    return env


def start_open_webui(args: argparse.Namespace, procs: Procs, run_dir: Path, gateway: str) -> str:
    data_dir = run_dir / "open-webui-data"
    data_dir.mkdir()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    olog = run_dir / "open-webui.log"
    p = procs.start(
        "open-webui",
        [args.open_webui, "serve", "--host", "127.0.0.1", "--port", str(port)],
        olog,
        env=owui_env(args, gateway, data_dir),
        cwd=run_dir,
    )
    t0 = time.monotonic()
    wait_for(
        "open-webui /health",
        lambda: http("GET", f"{base}/health", timeout=5),
        timeout=300,
        interval=1,
        proc=p,
        logfile=olog,
    )
    log(f"open-webui {base} up in {time.monotonic() - t0:.0f} s")
    return base


def install_filter(args: argparse.Namespace, base: str, model: str) -> str:
    token = http("POST", f"{base}/api/v1/auths/signin", {"email": "", "password": ""})["token"]
    version = http("GET", f"{base}/api/config").get("version")
    # the "What's New" modal opens while the user's settings.version differs from the server's
    http("POST", f"{base}/api/v1/users/user/settings/update", {"ui": {"version": version}}, token)
    fid = "spillover_status"
    content = Path(args.filter).read_text()
    created = http(
        "POST",
        f"{base}/api/v1/functions/create",
        {
            "id": fid,
            "name": "spillover status",
            "content": content,
            "meta": {"description": "Shows spillover's degraded notice above the answer"},
        },
        token,
    )
    if created.get("type") != "filter":
        raise SetupError(f"Open WebUI took the file as {created.get('type')!r}, not a filter")
    fn = created
    if not fn.get("is_active"):
        fn = http("POST", f"{base}/api/v1/functions/id/{fid}/toggle", token=token)
    if not fn.get("is_global"):
        fn = http("POST", f"{base}/api/v1/functions/id/{fid}/toggle/global", token=token)
    fn = http("GET", f"{base}/api/v1/functions/id/{fid}", token=token)
    if not (fn.get("is_active") and fn.get("is_global")):
        raise SetupError(f"filter not active+global: active={fn.get('is_active')} global={fn.get('is_global')}")
    log(f"filter {fid} installed, active and global (Open WebUI {version})")

    def model_listed() -> bool:
        return any(m.get("id") == model for m in http("GET", f"{base}/api/models", token=token)["data"])

    wait_for(f"Open WebUI lists {model}", model_listed, timeout=60, interval=1)
    return token


def latest_assistant_message(base: str, token: str) -> dict[str, Any] | None:
    chats = http("GET", f"{base}/api/v1/chats/", token=token)
    if not chats:
        return None
    chat = http("GET", f"{base}/api/v1/chats/{chats[0]['id']}", token=token)
    msgs = [m for m in chat["chat"]["history"]["messages"].values() if m.get("role") == "assistant"]
    return msgs[-1] if msgs else None


async def drive_browser(args: argparse.Namespace, base: str, token: str, model: str, notice: str) -> None:
    from playwright.async_api import async_playwright

    shot = Path(args.screenshot)  # written only when the check passes
    failure_shot = Path(args.run_dir) / "failure.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = None
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 720})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(f"{base}/?models={model}", wait_until="domcontentloaded", timeout=60_000)
            await page.wait_for_selector("#chat-input", timeout=60_000)
            # a "What's New" modal is kept away through the user's settings; close one anyway
            go = page.get_by_role("button", name="Okay, Let's Go!")
            if await go.count() and await go.first.is_visible():
                await go.first.click()
            await page.click("#chat-input")
            await page.keyboard.type(PROMPT)
            await page.keyboard.press("Enter")
            log("message sent; waiting for the answer")

            # the answer is finished when Open WebUI's own record of the message says done,
            # and the page shows it finished when the message's action buttons are there
            msg = await asyncio.to_thread(
                wait_for,
                "the answer to finish",
                lambda: (lambda m: m if m and m.get("done") and m.get("content") else None)(
                    latest_assistant_message(base, token)
                ),
                180,
                0.5,
            )
            content = msg["content"]
            await page.locator("button.regenerate-response-button").first.wait_for(state="attached", timeout=60_000)
            await page.mouse.move(0, 0)  # no hover styles on the message
            status = page.locator(".chat-assistant .status-description", has_text=notice)
            try:
                await status.first.wait_for(state="visible", timeout=15_000)
            except Exception as e:
                raise CheckFailed(
                    f"no status line {notice!r} above the finished answer; page errors: {errors[:3]}"
                ) from e
            shown = (await status.first.inner_text()).strip()
            if shown != notice:
                raise CheckFailed(f"status line reads {shown!r}, expected {notice!r}")
            if notice in content:
                raise CheckFailed("the notice is in the answer text: it came from degraded_notice, not the filter")
            history = [s.get("description") for s in msg.get("statusHistory") or []]
            if notice not in history:
                raise CheckFailed(f"the chat record's statusHistory lacks the notice: {history}")
            await page.screenshot(path=str(shot))
            log(f"screenshot {shot}")
            log(f"OK: status line {shown!r} above the answer {content.strip()[:60]!r}")
        except Exception:
            if page is not None:
                with contextlib.suppress(Exception):
                    await page.screenshot(path=str(failure_shot))
                    log(f"screenshot of the failure {failure_shot}")
            raise
        finally:
            await browser.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--screenshot", required=True)
    ap.add_argument("--spillover", required=True, help="the spillover command")
    ap.add_argument("--open-webui", required=True, help="the open-webui command")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--filter", required=True, help="spillover_status.py")
    ap.add_argument("--home", default="/tmp/owui", help="folder for this run's logs and data")
    args = ap.parse_args()

    Path(args.home).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.home))
    args.run_dir = str(run_dir)
    log(f"run folder {run_dir}")
    procs = Procs()
    t0 = time.monotonic()
    try:
        gateway, model = start_gateway(args, procs, run_dir)
        notice = preflight(gateway, model)
        owui = start_open_webui(args, procs, run_dir, gateway)
        token = install_filter(args, owui, model)
        asyncio.run(drive_browser(args, owui, token, model, notice))
        log(f"passed in {time.monotonic() - t0:.0f} s")
        return 0
    except CheckFailed as e:
        log(f"FAILED: {e}")
        return 1
    except (SetupError, urllib.error.URLError, subprocess.SubprocessError, OSError) as e:
        log(f"SETUP ERROR: {e}")
        return 2
    except Exception as e:  # a browser step that timed out, an unexpected page
        log(f"FAILED: {type(e).__name__}: {e}")
        return 1
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
