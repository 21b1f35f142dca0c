"""What an outside check sent at the HTTP layer, each a clear answer now: a compressed body
(gzip and deflate are read, bounded after decompression; any other coding is a 415), headers a
request may carry once given twice, or with whitespace around them, Starlette's own refusals
with a code (and a 405's Allow), a multipart type in capitals, bodies /api/show could not read,
``stream_options``/``spillover`` that are not objects, Ollama's ``keep_alive`` of any shape,
and a field named with a lone surrogate (a bare 500 before)."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import ready_worker

pytestmark = pytest.mark.e2e

LIMIT = 64 * 1024
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
OLLAMA = {"model": "smollm2", "messages": CHAT["messages"], "stream": False, "options": {"num_predict": 2}}


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    with GatewayProcess(["--gpu", "sim:2048", "--max-body-bytes", str(LIMIT)]) as g:
        ready_worker(g, "gpu")
        yield g


@pytest.fixture
def c(gw: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.url, timeout=120) as client:
        yield client


def post(c: httpx.Client, path: str, raw: bytes, **headers: str) -> httpx.Response:
    return c.post(path, content=raw, headers={"Content-Type": "application/json", **headers})


def error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()["error"]


def test_a_gzip_or_deflate_body_is_read_and_any_other_coding_refused(c: httpx.Client) -> None:
    raw = json.dumps(CHAT).encode()
    plain = post(c, "/v1/chat/completions", raw).json()["choices"][0]["message"]["content"]
    for coded, name in ((gzip.compress(raw), "gzip"), (zlib.compress(raw), "deflate"), (raw, "identity")):
        r = post(c, "/v1/chat/completions", coded, **{"Content-Encoding": name})
        assert r.status_code == 200, (name, r.text)
        assert r.json()["choices"][0]["message"]["content"] == plain
    r = c.post(
        "/api/chat",
        content=gzip.compress(json.dumps(OLLAMA).encode()),
        headers={"Content-Type": "application/json", "Content-Encoding": "GZIP"},
    )
    assert r.status_code == 200, r.text
    for name in ("br", "zstd", "gzip, br"):
        err = error(post(c, "/v1/chat/completions", raw, **{"Content-Encoding": name}), 415)
        assert err["code"] == "unsupported_media_type" and err["param"] == "Content-Encoding"
    members = gzip.compress(raw[:10]) + gzip.compress(raw[10:])  # a gzip stream of two members: one body
    r = post(c, "/v1/chat/completions", members, **{"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain, r.text
    err = error(post(c, "/v1/chat/completions", gzip.compress(raw) + b"junk", **{"Content-Encoding": "gzip"}), 400)
    assert "not valid gzip or deflate" in err["message"]  # what follows a member is read, not dropped
    err = error(post(c, "/v1/chat/completions", raw, **{"Content-Encoding": "gzip"}), 400)  # not gzip at all
    assert "not valid gzip or deflate" in err["message"]
    err = error(post(c, "/v1/chat/completions", gzip.compress(raw)[:-9], **{"Content-Encoding": "gzip"}), 400)
    assert "ends early" in err["message"]
    bomb = gzip.compress(b'{"prompt": "' + b" " * (LIMIT * 40) + b'"}')  # small, and 40 limits unpacked
    assert len(bomb) < LIMIT
    err = error(post(c, "/v1/completions", bomb, **{"Content-Encoding": "gzip"}), 413)
    assert "decompressed" in err["message"]


def test_a_header_a_request_carries_once_given_twice_is_a_400_and_whitespace_is_not_its_value(
    c: httpx.Client,
) -> None:
    raw = json.dumps(CHAT).encode()
    for name, values in (("Idempotency-Key", ["k-a", "k-b"]), ("X-Spillover-Deadline-Ms", ["60000", "abc"])):
        r = c.post(
            "/v1/chat/completions",
            content=raw,
            headers=[("Content-Type", "application/json"), *((name, v) for v in values)],
        )
        err = error(r, 400)
        assert err["param"] == name and "2 times" in err["message"]
    url = urlparse(str(c.base_url))
    for name, value in (("Idempotency-Key", "spaced-key \t "), ("X-Spillover-Deadline-Ms", "60000  ")):
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)  # httpx refuses the spaces
        conn.request("POST", "/v1/chat/completions", raw, {"Content-Type": "application/json", name: value})
        got = conn.getresponse()
        assert got.status == 200, (name, got.read())
        conn.close()
    again = post(c, "/v1/chat/completions", raw, **{"Idempotency-Key": "spaced-key"})
    assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"  # the same key


def test_starlettes_own_refusals_have_a_code_and_a_405_its_allow(c: httpx.Client) -> None:
    r = c.put("/v1/chat/completions", json=CHAT)
    err = error(r, 405)
    assert err["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    assert len(r.headers["x-spillover-request-id"]) == 24  # an id to name it by, not an empty header
    r = c.post("/v1/audio/transcriptions", content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"})
    err = error(r, 400)  # no boundary: Starlette's own 400, which said internal_error
    assert err["code"] == "invalid_request" and "multipart" in err["message"]
    r = c.post(
        "/v1/audio/transcriptions",
        content=b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n--b--\r\n',
        headers={"Content-Type": "Multipart/Form-Data; boundary=b"},
    )
    assert error(r, 400)["param"] == "file"  # read as multipart: it is the file that is missing
    for coding in (["gzip"], ["identity", "gzip"]):  # every Content-Encoding header counts
        r = c.post(
            "/v1/audio/transcriptions",
            content=b"--b--\r\n",
            headers=[("Content-Type", "multipart/form-data; boundary=b"), *(("Content-Encoding", v) for v in coding)],
        )
        assert error(r, 415)["param"] == "Content-Encoding"


def test_bodies_that_are_not_what_a_route_reads_are_400s(c: httpx.Client) -> None:
    for raw in (b"[]", b'"x"', b"null", b"1", b"{}", b'{"model": 5}'):
        r = post(c, "/api/show", raw)
        assert r.status_code == 400, (raw, r.status_code, r.text)
        assert "error" in r.json()
    assert post(c, "/api/show", b'{"model": "smollm2"}').status_code == 200
    for field, value in (("stream_options", []), ("stream_options", ""), ("stream_options", 0), ("spillover", "")):
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True, field: value})
        assert error(r, 400)["param"] == field, (field, value)
    assert c.post("/v1/chat/completions", json={**CHAT, "stream_options": None, "spillover": None}).status_code == 200
    body = OLLAMA
    for bad in ([[[]]], {"a": 1}, True, "five minutes", "9" * 40):
        r = c.post("/api/chat", json={**body, "keep_alive": bad})
        assert r.status_code == 400 and r.json()["param"] == "keep_alive", (bad, r.text)
    for good in ("5m", "1h30m", "-1", 0, 300, -1, "0"):
        r = c.post("/api/chat", json={**body, "keep_alive": good})
        assert r.status_code == 200, (good, r.text)


def test_a_field_named_with_a_lone_surrogate_is_a_400_naming_it_escaped(c: httpx.Client) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/api/chat", OLLAMA)):
        raw = json.dumps(body)[:-1].encode() + b', "\\ud800x": 1}'
        r = post(c, path, raw)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "\\\\ud800x" in r.text  # the escape, as text
    raw = json.dumps({**OLLAMA, "options": {}})[:-2].encode() + b'"\\udfff": 1}}'
    assert post(c, "/api/chat", raw).status_code == 400


def test_a_route_with_a_trailing_slash_is_a_404_that_names_the_route(c: httpx.Client) -> None:
    """``/v1/chat/completions/`` is no route: a 404 in the route's error shape that names the
    path without the slash, not Starlette's bare 307 (which a POST client does not follow, and
    so read as an empty answer). Nothing runs."""
    raw = json.dumps(CHAT).encode()
    err = error(post(c, "/v1/chat/completions/", raw), 404)
    assert err["code"] == "not_found" and "without the trailing slash: /v1/chat/completions" in err["message"], err
    assert "without the trailing slash: /v1/models" in error(c.get("/v1/models/"), 404)["message"]
    r = post(c, "/api/chat/", raw)  # an Ollama route: Ollama's shape
    assert r.status_code == 404 and "without the trailing slash: /api/chat" in r.json()["error"], r.text
    assert error(c.get("/nope"), 404)["message"] == "no route GET /nope"  # no slash, no hint
