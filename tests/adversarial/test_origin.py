"""Host, Origin and Content-Type checks (item 13): a page in the user's browser, through DNS
rebinding or a cross-site form, can neither read the gateway nor start or cancel work."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from spillover.config import ServerConfig, load_config
from spillover.errors import ConfigError
from spillover.http.origin import HostPolicy
from spillover.testing import GatewayProcess

e2e = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def _refusal(server: ServerConfig, host: str, origin: str | None = None, **kw: str) -> str | None:
    """The error code the policy of ``server`` answers, or None when it lets the request through."""
    headers = [(b"host", host.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    method = kw.pop("method", "GET")
    headers += [(k.replace("_", "-").encode(), v.encode()) for k, v in kw.items()]
    err = HostPolicy.from_config(server).refusal(method, headers)
    return None if err is None else err.code


LOOPBACK = ServerConfig()
PROXIED = ServerConfig(allowed_hosts=("gw.example", "*"), allowed_origins=("https://ui.example",))


@pytest.mark.parametrize(
    ("server", "host", "origin", "expected"),
    [
        (LOOPBACK, "127.0.0.1:8000", None, None),
        (LOOPBACK, "localhost:8000", None, None),
        (LOOPBACK, "LOCALHOST.:8000", None, None),
        (LOOPBACK, "[::1]:8000", None, None),
        (LOOPBACK, "127.0.0.1:2222", None, None),  # a forwarded port: the port is not compared
        (LOOPBACK, "evil.example:8000", None, "forbidden_host"),
        (LOOPBACK, "127.0.0.1.evil.example", None, "forbidden_host"),
        (LOOPBACK, "localhost@evil.example", None, "forbidden_host"),
        (LOOPBACK, "192.168.1.5:8000", None, "forbidden_host"),
        (LOOPBACK, "::1", None, "forbidden_host"),  # IPv6 without brackets is malformed
        (LOOPBACK, "127.0.0.1:99999", None, "forbidden_host"),
        (LOOPBACK, "", None, "forbidden_host"),
        (LOOPBACK, "127.0.0.1:8000", "http://127.0.0.1:8000", None),
        (LOOPBACK, "localhost", "http://localhost", None),
        (LOOPBACK, "[::1]:8000", "http://[::1]:8000", None),
        (LOOPBACK, "127.0.0.1:8000", "http://evil.example", "forbidden_origin"),
        (LOOPBACK, "127.0.0.1:8000", "http://localhost:8000", "forbidden_origin"),
        (LOOPBACK, "127.0.0.1:8000", "http://127.0.0.1:3000", "forbidden_origin"),
        (LOOPBACK, "127.0.0.1:8000", "null", "forbidden_origin"),
        (LOOPBACK, "127.0.0.1:8000", "file://", "forbidden_origin"),
        (LOOPBACK, "127.0.0.1:8000", "ftp://127.0.0.1:8000", "forbidden_origin"),
        (LOOPBACK, "127.0.0.1:8000", "http://127.0.0.1:8000/x", "forbidden_origin"),
        (ServerConfig(allowed_hosts=("gw.example",)), "gw.example:443", None, None),
        (ServerConfig(allowed_hosts=("gw.example",)), "gw.example", "https://gw.example", None),
        (ServerConfig(allowed_hosts=("gw.example",)), "gw.example", "https://gw.example:8443", "forbidden_origin"),
        (ServerConfig(allowed_hosts=("gw.example",)), "evil.example", None, "forbidden_host"),
        (PROXIED, "anything.example", None, None),
        (PROXIED, "anything.example", "https://evil.example", "forbidden_origin"),
        (PROXIED, "127.0.0.1:8000", "https://ui.example", None),
        (PROXIED, "127.0.0.1:8000", "https://ui.example:443", None),
        (PROXIED, "127.0.0.1:8000", "http://ui.example", "forbidden_origin"),
        (ServerConfig(host="192.168.1.5", api_key="k"), "192.168.1.5:8000", None, None),
        (ServerConfig(host="192.168.1.5", api_key="k"), "192.168.1.6:8000", None, "forbidden_host"),
        (ServerConfig(host="0.0.0.0", api_key="k"), "10.1.2.3:8000", None, None),
        (ServerConfig(host="0.0.0.0", api_key="k"), "[fe80::1]:8000", None, None),
        (ServerConfig(host="0.0.0.0", api_key="k"), "evil.example:8000", None, "forbidden_host"),
    ],
)
def test_host_and_origin_rules(server: ServerConfig, host: str, origin: str | None, expected: str | None) -> None:
    """Each row: a Host (and Origin) and whether the policy of that [server] config refuses it, and how."""
    assert _refusal(server, host, origin) == expected


def test_duplicate_host_or_origin_headers_are_refused() -> None:
    """Two Host headers, or two Origin headers, are refused rather than guessed between."""
    policy = HostPolicy.from_config(LOOPBACK)
    two_hosts = policy.refusal("GET", [(b"host", b"127.0.0.1"), (b"host", b"evil.example")])
    assert two_hosts is not None and two_hosts.code == "forbidden_host"
    origin = (b"origin", b"http://127.0.0.1")
    two_origins = policy.refusal("GET", [(b"host", b"127.0.0.1"), origin, (b"origin", b"http://evil.example")])
    assert two_origins is not None and two_origins.code == "forbidden_origin"


@pytest.mark.parametrize(
    ("method", "headers", "expected"),
    [
        ("POST", {"content_type": "application/json", "content_length": "10"}, None),
        ("POST", {"content_type": "Application/JSON; charset=utf-8", "content_length": "10"}, None),
        ("POST", {"content_type": 'application/json; charset="UTF-8"', "content_length": "10"}, None),
        # another charset was read as UTF-8 all the same
        (
            "POST",
            {"content_type": "application/json; charset=latin-1", "content_length": "10"},
            "unsupported_media_type",
        ),
        ("POST", {"content_type": "text/plain", "content_length": "10"}, "unsupported_media_type"),
        (
            "POST",
            {"content_type": "text/plain;charset=UTF-8", "transfer_encoding": "chunked"},
            "unsupported_media_type",
        ),
        (
            "POST",
            {"content_type": "application/x-www-form-urlencoded", "content_length": "3"},
            "unsupported_media_type",
        ),
        ("POST", {"content_type": "multipart/form-data; boundary=x", "content_length": "3"}, "unsupported_media_type"),
        ("POST", {"content_length": "10"}, "unsupported_media_type"),  # a Blob body: no type at all
        ("POST", {"content_type": "application/jsonx", "content_length": "10"}, "unsupported_media_type"),
        ("DELETE", {"content_type": "text/plain", "content_length": "2"}, "unsupported_media_type"),
        ("DELETE", {}, None),  # no body, no type needed
        ("POST", {"content_length": "0"}, None),
        ("GET", {"content_type": "text/plain", "content_length": "10"}, None),
    ],
)
def test_content_type_rule(method: str, headers: dict[str, str], expected: str | None) -> None:
    """Each row: a request with or without a body, and whether its Content-Type is refused (415)."""
    assert _refusal(LOOPBACK, "127.0.0.1:8000", None, method=method, **headers) == expected


def test_allow_lists_load_from_toml_and_are_validated(tmp_path: Path) -> None:
    """allowed_hosts/allowed_origins read as TOML lists; a port, a path, '*' origins or non-strings are refused."""
    f = tmp_path / "c.toml"
    f.write_text('[server]\nallowed_hosts = ["gw.example", "[::1]", "*"]\nallowed_origins = ["https://ui.example"]\n')
    server = load_config(str(f)).server
    assert server.allowed_hosts == ("gw.example", "[::1]", "*")
    assert server.allowed_origins == ("https://ui.example",)
    for bad in (
        'allowed_hosts = ["gw.example:8000"]',
        'allowed_hosts = ["http://gw.example"]',
        "allowed_hosts = [1]",
        'allowed_hosts = "gw.example"',
        'allowed_origins = ["*"]',
        'allowed_origins = ["null"]',
        'allowed_origins = ["https://ui.example/"]',
        'allowed_origins = ["ui.example"]',
    ):
        f.write_text(f"[server]\n{bad}\n")
        with pytest.raises(ConfigError):
            load_config(str(f))


# ---- a real gateway ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "none", "--cpu-slots", "1"]) as g:
        yield g


def _host(gw: GatewayProcess) -> str:
    return f"127.0.0.1:{gw.port}"


def _call(gw: GatewayProcess, method: str, path: str, headers: dict[str, str], body: Any = None) -> httpx.Response:
    content = None if body is None else json.dumps(body).encode()
    return httpx.request(method, gw.url + path, content=content, headers=headers, timeout=120)


def _assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code
    assert err["type"] == ("permission_error" if status == 403 else "invalid_request_error")
    assert r.headers["x-spillover-request-id"] and r.headers["x-spillover-route"] == "none"


ROUTES = [
    ("GET", "/v1/status", None),
    ("GET", "/v1/requests/x", None),
    ("GET", "/health", None),
    ("GET", "/", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("DELETE", "/v1/requests/x", None),
]
JSON = {"Content-Type": "application/json"}


@e2e
def test_a_foreign_host_is_refused_on_every_route(gw: GatewayProcess) -> None:
    """A DNS-rebound page (Host: evil.example:PORT) gets 403 forbidden_host everywhere, /health included."""
    for method, path, body in ROUTES:
        r = _call(gw, method, path, {"Host": f"evil.example:{gw.port}", **JSON}, body)
        _assert_refused(r, 403, "forbidden_host")


@e2e
def test_an_absolute_form_target_is_judged_by_its_own_authority(gw: GatewayProcess) -> None:
    """``GET http://evil.example/v1/status`` with a loopback Host header was served: the
    target's authority is the request's host (RFC 9112 3.2.2), which the guard refuses."""

    def raw(target: str) -> bytes:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nConnection: close\r\n\r\n".encode())
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        return got

    assert raw(f"http://evil.example:{gw.port}/v1/status").startswith(b"HTTP/1.1 403")
    assert b"forbidden_host" in raw("http://evil.example/health")
    assert raw(f"http://127.0.0.1:{gw.port}/health").startswith(b"HTTP/1.1 200")
    assert raw(f"http://[::1]:{gw.port}/health").startswith(b"HTTP/1.1 200")  # an IPv6 literal keeps its brackets
    assert raw(f"http://127.0.0.1:{gw.port}@evil.example/health").startswith(b"HTTP/1.1 403")  # userinfo is not a host
    assert raw("/health").startswith(b"HTTP/1.1 200")


@e2e
def test_loopback_names_on_any_port_are_served(gw: GatewayProcess) -> None:
    """localhost, 127.0.0.1 and [::1] are served, also under a forwarded port."""
    for host in (f"localhost:{gw.port}", _host(gw), f"[::1]:{gw.port}", "127.0.0.1:2222", "localhost"):
        r = _call(gw, "GET", "/v1/status", {"Host": host})
        assert r.status_code == 200, (host, r.text)


@e2e
def test_a_foreign_origin_is_refused(gw: GatewayProcess) -> None:
    """Origin: http://evil.example (or null, or another local origin) gets 403 forbidden_origin, DELETE included."""
    for origin in ("http://evil.example", "null", f"http://localhost:{gw.port}", "http://127.0.0.1:1"):
        for method, path, body in ROUTES:
            r = _call(gw, method, path, {"Host": _host(gw), "Origin": origin, **JSON}, body)
            _assert_refused(r, 403, "forbidden_origin")


@e2e
def test_the_same_origin_is_served(gw: GatewayProcess) -> None:
    """Origin http://127.0.0.1:PORT (the status page's own) reads status, generates, and may DELETE."""
    same = {"Host": _host(gw), "Origin": f"http://127.0.0.1:{gw.port}"}
    assert _call(gw, "GET", "/v1/status", same).status_code == 200
    r = _call(gw, "POST", "/v1/chat/completions", {**same, **JSON}, CHAT)
    assert r.status_code == 200, r.text
    rid = r.headers["x-spillover-request-id"]
    gone = _call(gw, "DELETE", f"/v1/requests/{rid}", same)  # no body, so no Content-Type needed
    assert gone.status_code == 200 and gone.json()["state"] == "completed"


def _finished_requests(gw: GatewayProcess, outcome: str | None = None) -> float:
    """``spillover_requests_total`` summed: the requests that ran (any outcome but a refusal), or
    those of ``outcome``."""
    text = httpx.get(gw.url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("spillover_requests_total{")
        and (f'outcome="{outcome}"' in line if outcome else 'outcome="rejected"' not in line)
    )


@e2e
def test_a_simple_cross_site_post_runs_nothing(gw: GatewayProcess) -> None:
    """A JSON body sent as text/plain, a form type or no type (no CORS preflight) is 415, and nothing
    is journaled or run: the same Idempotency-Key then runs afresh instead of replaying. Each
    refusal is counted as one before acceptance is (round 31: the origin guard's were not)."""
    before, refused = _finished_requests(gw), _finished_requests(gw, "rejected")
    for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {"Host": _host(gw), "Idempotency-Key": "item13"} | ({"Content-Type": ctype} if ctype else {})
        _assert_refused(_call(gw, "POST", "/v1/chat/completions", headers, CHAT), 415, "unsupported_media_type")
    assert _finished_requests(gw) == before
    assert _finished_requests(gw, "rejected") == refused + 3
    metrics = httpx.get(gw.url + "/metrics", timeout=30).text
    assert 'spillover_requests_total{outcome="rejected",reason="unsupported_media_type",route="none"}' in metrics
    r = _call(gw, "POST", "/v1/chat/completions", {"Host": _host(gw), "Idempotency-Key": "item13", **JSON}, CHAT)
    assert r.status_code == 200, r.text
    assert "idempotent-replayed" not in r.headers
    assert _finished_requests(gw) == before + 1


@e2e
def test_the_official_openai_client_still_works(gw: GatewayProcess) -> None:
    """The openai package (Host 127.0.0.1:PORT, application/json, no Origin) passes all three checks."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].message is not None
    assert [m.id for m in client.models.list()] == [MODEL]


@e2e
def test_a_listed_origin_gets_cors_and_no_other_does() -> None:
    """[server].allowed_origins names a web UI served elsewhere: its browser's preflight is
    answered (204, the methods, the headers it asked for) and every answer (a stream, an error)
    carries Access-Control-Allow-Origin and exposes the X-Spillover-* headers. Before, the
    preflight was a 405 and no answer had a CORS header: a browser kept all of them from the
    page the setting is for. The same origin and a foreign one get no CORS header."""
    ui = "http://ui.example:3000"
    with GatewayProcess(
        ["--gpu", "none", "--cpu-slots", "1", "--chat-only"], config={"server": {"allowed_origins": [ui]}}
    ) as g:
        host = {"Host": f"127.0.0.1:{g.port}"}
        asked = "authorization, content-type, idempotency-key, x-stainless-os"
        pre = _call(
            g,
            "OPTIONS",
            "/v1/chat/completions",
            {**host, "Origin": ui, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked},
        )
        assert pre.status_code == 204, pre.text
        assert pre.headers["access-control-allow-origin"] == ui and pre.headers["vary"] == "Origin"
        assert (
            "POST" in pre.headers["access-control-allow-methods"]
            and pre.headers["access-control-allow-headers"] == asked
        )
        r = _call(g, "POST", "/v1/chat/completions", {**host, "Origin": ui, **JSON}, {**CHAT, "stream": True})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui and "data: [DONE]" in r.text
        assert "X-Spillover-Request-Id" in r.headers["access-control-expose-headers"]
        bad = _call(g, "POST", "/v1/chat/completions", {**host, "Origin": ui, **JSON}, {"messages": []})
        assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == ui  # the page reads why
        plain = _call(g, "POST", "/v1/chat/completions", {**host, "Origin": ui, "Content-Type": "text/plain"}, CHAT)
        assert plain.status_code == 415 and plain.headers["access-control-allow-origin"] == ui  # the guard's own
        same = _call(g, "GET", "/v1/status", {**host, "Origin": f"http://127.0.0.1:{g.port}"})
        assert same.status_code == 200 and "access-control-allow-origin" not in same.headers
        foreign = _call(
            g,
            "OPTIONS",
            "/v1/chat/completions",
            {**host, "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        _assert_refused(foreign, 403, "forbidden_origin")
        assert "access-control-allow-origin" not in foreign.headers


def test_an_error_the_app_did_not_answer_still_carries_cors_for_a_listed_origin() -> None:
    """The app raises (a bug): Starlette answers its 500 outside this guard, without the CORS
    headers, so a browser showed the page a network error. The guard answers it, marked, and
    the error goes on to be logged."""
    import asyncio

    from starlette.responses import JSONResponse

    from spillover.http.origin import OriginGuard

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    ui = "http://ui.example:3000"
    policy = HostPolicy.from_config(ServerConfig(allowed_origins=(ui,)))
    guard = OriginGuard(
        broken, policy=policy, refuse=lambda exc, path: JSONResponse({"error": str(exc)}, status_code=500)
    )
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/status",
        "headers": [(b"host", b"127.0.0.1"), (b"origin", ui.encode())],
    }
    with pytest.raises(RuntimeError):
        asyncio.run(guard(scope, receive, send))  # type: ignore[arg-type]
    start = sent[0]
    assert start["status"] == 500 and (b"access-control-allow-origin", ui.encode()) in start["headers"]
