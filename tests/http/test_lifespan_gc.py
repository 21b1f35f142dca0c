"""``spillover serve`` moves what its start made out of the garbage collector's generations
(``GatewayLifespan.freeze_gc``, issue 13 item 5); a lifespan in a process hosting others does not.
Each case runs in a process of its own: a freeze would outlive it in the test process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, sys
    from starlette.applications import Starlette
    import spillover.http.app as app_module
    from spillover.http.app import GatewayLifespan

    class Gateway:
        async def start(self):
            self.made = [[i] for i in range(1000)]  # what a start makes, and keeps

        async def stop(self):
            pass

    async def main(freeze):
        app_module.sweep_uploads = lambda gw: 0  # no uploads folder here
        lifespan = GatewayLifespan(Starlette(), Gateway())
        lifespan.freeze_gc = freeze
        sent, events = [], asyncio.Queue()
        await events.put({"type": "lifespan.startup"})

        async def send(message):
            sent.append(message["type"])
            if message["type"] == "lifespan.startup.complete":
                print(sent[-1], gc.get_freeze_count() > 1000)  # the start's lists among them
                await events.put({"type": "lifespan.shutdown"})

        await lifespan({"type": "lifespan"}, events.get, send)

    asyncio.run(main(sys.argv[1] == "freeze"))
    """
)


@pytest.mark.parametrize(("how", "frozen"), [("freeze", True), ("keep", False)])
def test_the_start_freezes_what_it_made_only_when_asked(how: str, frozen: bool) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lifespan.startup.complete", str(frozen)]


def test_serve_asks_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's gateway is the process's alone: ``spillover serve`` sets the flag on
    the app it hands the server (the server's run is stood in for: nothing starts)."""
    from spillover import cli
    from spillover.http.server import TickingServer

    seen: list[bool] = []

    def run(self: TickingServer) -> None:
        seen.append(self.config.app.freeze_gc)
        self.started = True

    monkeypatch.setattr(TickingServer, "run", run)
    assert cli.main(["serve", "--state-dir", str(tmp_path), "--port", "0", "--chat-only"]) == 0
    assert seen == [True]
