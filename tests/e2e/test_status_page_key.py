"""The status page of a gateway with an API key, in a real headless Chromium: it loads without
the key, asks for it, keeps it in sessionStorage only and sends it as a Bearer header."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spillover.testing import GatewayProcess
from tests.e2e.test_status_page import CHROMIUM, FLAGS

pytestmark = pytest.mark.e2e
KEY = "page-s3cret"


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "none", "--cpu-slots", "1"], api_key=KEY) as g:
        yield g


def test_page_asks_for_the_key_then_shows_the_status(gw: GatewayProcess) -> None:
    """Without a key the page shows a key form; a wrong key is refused; the right one shows the mode,
    stays in sessionStorage (not localStorage, not the URL) across a reload, and authorizes DELETE."""
    from playwright.sync_api import expect, sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError("Debian's chromium is required (apt-get install chromium); scripts/test-all installs it")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page()
            response = page.goto(gw.url + "/")
            assert response is not None and response.status == 200
            form = page.locator("#keyform")
            expect(form).to_be_visible(timeout=10_000)
            expect(page.locator("#mode")).to_have_text("API key required")

            page.fill("#apikey", "wrong")
            page.press("#apikey", "Enter")
            expect(page.locator("#keyerror")).to_have_text("that key was refused", timeout=10_000)
            expect(form).to_be_visible()

            page.fill("#apikey", KEY)
            with page.expect_request(lambda r: r.url.endswith("/v1/status")) as first:
                page.click("#keysubmit")
            assert first.value.all_headers().get("authorization") == f"Bearer {KEY}"
            expect(page.locator("#mode")).to_have_text(gw.status()["mode"], timeout=10_000)
            expect(form).to_be_hidden()
            expect(page.locator("#workers tbody tr")).to_have_count(1)
            assert page.evaluate("sessionStorage.getItem('spillover.api_key')") == KEY
            assert page.evaluate("localStorage.length") == 0
            assert KEY not in page.url and "wrong" not in page.url

            page.reload()
            expect(page.locator("#mode")).to_have_text(gw.status()["mode"], timeout=10_000)
            expect(form).to_be_hidden()
            status = page.evaluate("api('/v1/requests/nope', {method: 'DELETE'}).then(r => r.status)")
            assert status == 404  # the cancel path carries the key too (401 without it)
        finally:
            browser.close()
