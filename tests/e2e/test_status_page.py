"""The live status page in a real headless Chromium (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import COUNT_PROMPT, ready_worker, sim, wait_for

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    cfg = {"breaker": {"cooldown_s": 30.0}}
    with GatewayProcess(["--gpu", "sim:1024", "--gpu-slots", "1", "--cpu-slots", "1"], config=cfg) as g:
        yield g


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError("Debian's chromium is required (apt-get install chromium); scripts/test-all installs it")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(gw: GatewayProcess, browser: object) -> Iterator[object]:
    from playwright.sync_api import Browser

    assert isinstance(browser, Browser)
    pg = browser.new_page(viewport={"width": 1100, "height": 1300})
    pg.goto(gw.url + "/")
    yield pg
    pg.close()


def test_page_shows_normal_mode_ledger_and_workers(gw: GatewayProcess, page: object) -> None:
    """The page renders the mode, the sim GPU ledger bar, lanes, both workers and what the CPU lane serves."""
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    expect(page.locator("#mode")).to_have_text("normal", timeout=10_000)
    expect(page.locator("#device")).to_contain_text("sim:1024 (simulated)")
    expect(page.locator("#ledger-bar")).to_be_visible()
    expect(page.locator("#workers tbody tr")).to_have_count(2)
    expect(page.locator("#lanes tbody tr")).to_have_count(2)
    expect(page.locator("#models")).to_contain_text("CPU lane is an exact replica")


def test_page_shows_degraded_within_2s_of_breaker_opening(gw: GatewayProcess, page: object) -> None:
    """After an injected allocation failure opens the breaker, the page says degraded within 2 s;
    a screenshot is saved as a test artifact."""
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    ready_worker(gw, "gpu")
    sim(gw).fail_next(1)
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.headers["x-spillover-route"] == "cpu"
    opened = time.monotonic()
    assert gw.status()["breaker"]["circuit"] == "open"
    expect(page.locator("#mode")).to_have_text("degraded", timeout=2_000)
    assert time.monotonic() - opened < 2.0
    expect(page.locator("#breaker")).to_have_text("open")
    expect(page.locator("#reasons")).to_contain_text("gpu breaker open")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "status-page-degraded.png"), full_page=True)
    assert (ARTIFACTS / "status-page-degraded.png").stat().st_size > 10_000


def test_cancel_a_queued_request_from_the_page(gw: GatewayProcess, page: object) -> None:
    """Clicking 'cancel' on a queued CPU request removes it and the journal says CANCELLED."""
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    # Greedy, so the model really counts for 900 tokens (~12 s here) and the second request is
    # still queued while the page is driven; a sampled run may stop after a few dozen tokens.
    body = {"prompt": COUNT_PROMPT, "max_tokens": 900, "temperature": 0, "spillover": {"prefer": "cpu"}}
    results: list[httpx.Response] = []
    ts = [
        threading.Thread(target=lambda: results.append(httpx.post(gw.url + "/v1/completions", json=body, timeout=120)))
        for _ in range(2)
    ]
    for t in ts:
        t.start()
        time.sleep(0.3)
    queued = wait_for(
        lambda: next((lane["queued"] for lane in gw.status()["lanes"] if lane["queued"]), None), 10, "a queued request"
    )
    rid = queued[0]["rid"]
    button = page.locator(f"button.cancel[data-rid='{rid}']")
    expect(button).to_be_visible(timeout=3_000)
    button.click()
    expect(page.locator(f"button.cancel[data-rid='{rid}']")).to_have_count(0, timeout=3_000)
    doc = httpx.get(f"{gw.url}/v1/requests/{rid}").json()
    assert doc["state"] == "cancelled"
    for t in ts:
        t.join(120)
    assert sorted(r.status_code for r in results) == [200, 409]


def test_page_lists_each_service_where_it_runs_and_why(browser: object) -> None:
    """With the embeddings service on, the Services table has a row for the chat model and one
    for bge-small-en, which runs on the GPU because it fits; a screenshot is saved as an artifact."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    with GatewayProcess(["--gpu", "sim:1024"], services=("chat", "embeddings")) as g:
        pg = browser.new_page(viewport={"width": 1100, "height": 1300})
        try:
            pg.goto(g.url + "/")
            table = pg.locator("#services")
            expect(table).to_be_visible(timeout=10_000)
            expect(table.locator("tbody tr")).to_have_count(2)
            chat = table.locator("tbody tr", has_text="smollm2-135m-instruct")
            expect(chat).to_have_count(1)
            expect(chat).to_contain_text("chat · interactive")
            # its CPU replica: auto, picked by the recovery budget, with each mode's measured recovery
            expect(chat).to_contain_text("auto: the cheapest mode within the recovery budget", timeout=10_000)
            expect(chat).to_contain_text("budget 1000 ms")
            expect(chat).to_contain_text(re.compile(r"recovery warm \d+ ms · mmap \d+ ms · on_demand \d+ ms"))
            bge = table.locator("tbody tr", has_text="bge-small-en")
            expect(bge).to_have_count(1)
            expect(bge).to_contain_text("embeddings · batch")
            expect(bge.locator("td.where")).to_have_text("GPU")
            expect(bge).to_contain_text("the GPU has room for it")
            expect(bge).to_contain_text("not demoted")
            expect(pg.locator("#workers tbody tr")).to_have_count(4)  # the chat model's two and the service's two
            ARTIFACTS.mkdir(exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / "status-page-services.png"), full_page=True)
        finally:
            pg.close()


def test_services_section_hides_without_the_key_and_escapes_its_text(gw: GatewayProcess, browser: object) -> None:
    """Fed an older gateway's status (no services key) the page still renders and hides the
    Services table; fed a demoted service whose name is markup, it shows the name as text and
    the demotion with its reason and 'waiting for room to load', and its worker's row what the
    load waits for (markup as text too)."""
    from playwright.sync_api import Browser, Route, expect

    assert isinstance(browser, Browser)
    evil = '<img src=x onerror="window.pwned=1">'
    demoted = {
        "name": evil,
        "kind": "embeddings",
        "priority": "batch",
        "aliases": [],
        "where": "cpu",
        "why": "demoted",
        "queued": 3,
        "running": 1,
        "eta_s": 2.5,
        "served": {"gpu": 7, "cpu": 2},
        "failovers": 0,
        "breaker": "closed",
        "weights_bytes": 0,
        "reserved_bytes": 0,
        "load_waiting": True,
        "demoted": True,
        "demotions": 1,
        "promotions": 0,
        "ladder": [{"t_s": 1.0, "event": "demoted", "reason": "chat needed 64 MiB"}],
        "workers": [  # its GPU worker's load waits for room (``waiting``), its text markup too
            {
                "worker_id": "bge-gpu",
                "device": "sim",
                "state": "stopped",
                "pid": None,
                "busy": 0,
                "starts": 0,
                "waiting": f"room on the device for its 1024 bytes of weights {evil}",
            },
        ],
    }
    services: list[list[dict[str, object]] | None] = [None]

    def fake_status(route: Route) -> None:
        doc = route.fetch().json()
        doc.pop("services", None)
        if services[0] is not None:
            doc["services"] = services[0]
        route.fulfill(json=doc)

    pg = browser.new_page()
    try:
        pg.route("**/v1/status", fake_status)
        pg.goto(gw.url + "/")
        expect(pg.locator("#mode")).not_to_have_text("…", timeout=10_000)
        expect(pg.locator("#workers tbody tr")).to_have_count(2)
        expect(pg.locator("#services-section")).to_be_hidden()

        services[0] = [demoted]
        row = pg.locator("#services tbody tr")
        expect(row).to_have_count(1, timeout=5_000)
        expect(row.locator("td").first).to_contain_text(evil)
        expect(row.locator("td.where")).to_have_text("CPU")
        expect(row).to_contain_text("moved off the GPU to make room for interactive work")
        expect(row).to_contain_text("demoted (off the GPU)")
        expect(row).to_contain_text("waiting for room to load")
        expect(row).to_contain_text("last demoted")
        expect(row).to_contain_text("chat needed 64 MiB")
        waiting = pg.locator("#workers tbody tr").nth(2)
        expect(waiting).to_contain_text("stopped — waiting for room on the device for its 1024 bytes of weights")
        expect(waiting).to_contain_text(evil)
        assert pg.locator("#services img").count() == 0 and pg.locator("#workers img").count() == 0
        assert pg.evaluate("window.pwned") is None
        ARTIFACTS.mkdir(exist_ok=True)
        pg.locator("#services").screenshot(path=str(ARTIFACTS / "status-page-services-demoted.png"))
    finally:
        # a poll's handler may still be reading its fetched status when the page closes: that
        # read's "Response has been disposed" is the closing's, not the page's (CI saw it once)
        pg.unroute_all(behavior="ignoreErrors")
        pg.close()


def test_the_page_shows_what_a_replica_holds_the_profile_and_when_its_figures_are_old(
    gw: GatewayProcess, browser: object
) -> None:
    """Round 41, in a real browser: an ``on_demand`` replica that a request made load its model
    said only "on_demand" (the README's "holds nothing"), and no replica's host bytes showed; a
    fixed mode showed "budget 50 ms (not met)" for a budget that steers auto only; the execution
    profile showed only while degraded; with the gateway gone the page kept its last figures
    without saying they were old; at a phone's 375 px the page was 750 px wide."""
    from playwright.sync_api import Browser, Route, expect

    assert isinstance(browser, Browser)
    readiness = {
        "configured": "on_demand", "mode": "on_demand", "holding": "on_demand", "why": "configured",
        "wanted": "on_demand", "recovery_budget_ms": 50.0, "recovery_ms": {"warm": 210.0, "on_demand": 640.0},
        "meets_budget": False, "model_loaded": True, "contexts": 0, "host_bytes": 236 * 2**20,
        "extra_bytes": 0, "last_failover": None,
    }  # fmt: skip
    profile = {
        "profile": "split", "resident_bytes": 243 * 2**20, "resident_tokens": 0, "split_layers": 7,
        "split_bytes": 60 * 2**20, "usable_bytes": 64 * 2**20, "split_worker": True,
        "why": "all layers and a 2048-token request need 243 MiB of 64 MiB",
    }  # fmt: skip
    down = [""]

    def fake_status(route: Route) -> None:
        if down[0] == "refused":
            route.abort()
            return
        if down[0] == "hung":  # never answered (a connection dropped on the way): the poll times out
            return
        doc = route.fetch().json()
        doc["services"][0] |= {"cpu_readiness": readiness, "profile": profile, "where": "none", "why": "gpu_busy"}
        route.fulfill(json=doc)

    pg = browser.new_page(viewport={"width": 375, "height": 900})
    try:
        pg.route("**/v1/status", fake_status)
        pg.goto(gw.url + "/")
        chat = pg.locator("#services tbody tr").first
        expect(chat).to_contain_text("holds 236.0 MiB: its model, loaded by a request and kept", timeout=10_000)
        expect(chat).to_contain_text("the budget steers auto only")
        expect(chat).not_to_contain_text("(not met)")
        expect(chat).to_contain_text("profile split (split worker: 7 layers on the device): all layers and a")
        expect(chat.locator("td.where")).to_have_text("no slot free now: it would queue")  # not "nowhere"
        expect(pg.locator("#updated")).to_contain_text("updated ")
        assert pg.evaluate("document.documentElement.scrollWidth") <= 375  # tables scroll in their place
        for how in ("refused", "hung"):  # round 43: a poll never answered stopped every later one
            down[0] = how
            expect(pg.locator("#mode")).to_have_text("unreachable", timeout=10_000)
            expect(pg.locator("#updated")).to_contain_text("the gateway does not answer; below: its last answer, at")
            assert "stale" in (pg.locator("body").get_attribute("class") or "")
            down[0] = ""
            expect(pg.locator("#mode")).not_to_have_text("unreachable", timeout=10_000)
            assert "stale" not in (pg.locator("body").get_attribute("class") or "")
        ARTIFACTS.mkdir(exist_ok=True)
        pg.screenshot(path=str(ARTIFACTS / "status-page-phone.png"), full_page=True)
    finally:
        pg.unroute_all(behavior="ignoreErrors")
        pg.close()
