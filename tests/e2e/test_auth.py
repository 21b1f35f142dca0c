"""An API key, once set, guards every route but /health, and the official client uses it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e
KEY = "s3cret-key"
GUARDED = [
    ("GET", "/v1/models"),
    ("GET", "/v1/status"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/v1/requests/nope"),
    ("DELETE", "/v1/requests/nope"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "none", "--cpu-slots", "1"], api_key=KEY) as g:
        yield g


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_guarded_routes_refuse_a_missing_or_wrong_key(gw: GatewayProcess, method: str, path: str) -> None:
    """No key, a wrong key, or another scheme: 401 in the OpenAI error shape, with the request id header."""
    body = {"prompt": "Hi", "max_tokens": 2} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.request(method, gw.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert "x-spillover-request-id" in r.headers


def test_the_right_key_opens_every_route_and_health_is_open(gw: GatewayProcess) -> None:
    """With the key the routes answer as usual (404 for an unknown request); /health and the static
    status page / (its script asks for the key) need none."""
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(gw.url + "/health", timeout=30).status_code == 200
    page = httpx.get(gw.url + "/", timeout=30)
    assert page.status_code == 200 and "sessionStorage" in page.text and KEY not in page.text
    for method, path in GUARDED:
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0} if method == "POST" else None
        if path == "/v1/chat/completions":
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        r = httpx.request(method, gw.url + path, json=body, headers=auth, timeout=120)
        expected = 404 if path.endswith("/nope") else 200
        assert r.status_code == expected, (path, r.text)


def test_official_client_with_the_key(gw: GatewayProcess) -> None:
    """The openai package sends the key as a Bearer token; a wrong key is an AuthenticationError."""
    good = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in good.models.list()] == ["smollm2-135m-instruct"]
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
