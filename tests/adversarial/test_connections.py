"""Idle and slow connections cannot exhaust the gateway: at most ``max_connections`` are
open (one more gets a 503 and is closed at once), a request head must be complete within
``header_timeout_s`` (trickled bytes do not restart the clock; idle keep-alive is bounded
too), the log stays small, and the workers never notice."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from spillover.testing import GatewayProcess

pytestmark = pytest.mark.e2e

MAX_CONNECTIONS = 8
HEADER_TIMEOUT_S = 4.0
BODY_TIMEOUT_S = 2.0
EXTRA = 300  # the count of slow connections, on top of the ones the gateway holds
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayProcess]:
    """A gateway (sim GPU) that holds at most 8 connections and gives each 4 s for its head
    and 2 s for its body."""
    cfg = {
        "server": {
            "max_connections": MAX_CONNECTIONS,
            "header_timeout_s": HEADER_TIMEOUT_S,
            "body_timeout_s": BODY_TIMEOUT_S,
        }
    }
    with GatewayProcess(["--gpu", "sim:1024"], config=cfg) as g:
        yield g


def connect(gw: GatewayProcess) -> socket.socket:
    u = urlparse(gw.url)
    return socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=10)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def close_times(socks: list[socket.socket], t0: float, deadline_s: float) -> dict[int, float]:
    """Seconds after ``t0`` at which the server closed each socket (EOF or reset); sockets
    still open at ``deadline_s`` are missing."""
    closed: dict[int, float] = {}
    pending = {s.fileno(): s for s in socks}
    while pending and time.monotonic() - t0 < deadline_s:
        ready, _, _ = select.select(list(pending.values()), [], [], 0.2)
        for s in ready:
            try:
                data = s.recv(4096)
            except (ConnectionResetError, TimeoutError):
                data = b""
            if not data:
                closed[s.fileno()] = time.monotonic() - t0
                del pending[s.fileno()]
    return closed


def read_response(s: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body (the first, when more follow)."""
    return read_responses(s, 1)[0]


def read_responses(s: socket.socket, n: int) -> list[bytes]:
    """``n`` HTTP/1.1 responses with Content-Length bodies, however the reads split them."""
    data, out = b"", []
    while len(out) < n:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.split(b"\r\n")
            length = next(int(h.split(b":")[1]) for h in lines if h.lower().startswith(b"content-length:"))
            if len(rest) >= length:
                out.append(head + sep + rest[:length])
                data = rest[length:]
                continue
        chunk = s.recv(4096)
        assert chunk, (out, data)
        data += chunk
    return out


def test_connections_past_the_limit_are_refused_and_slow_heads_closed(gw: GatewayProcess) -> None:
    """With the limit held by idle and half-sent requests, 300 more connections each get a 503
    at once and cost the gateway no descriptor; the holders are closed once header_timeout_s
    passes; then /health answers, the GPU worker is the same ready process, and the log grew
    by a few lines only."""
    assert gw.proc is not None
    gpu = gw.worker("gpu")
    assert gpu["state"] == "ready"
    log_before = os.path.getsize(gw.log_path)
    fds_before = open_fds(gw.proc.pid)
    holders: list[socket.socket] = []
    extras: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for i in range(MAX_CONNECTIONS):
            s = connect(gw)
            if i % 2:
                s.sendall(PARTIAL_HEAD)
            holders.append(s)
        refused = []
        for _ in range(EXTRA):  # each is answered before the next connects: no SYN is dropped
            extras.append(connect(gw))
            refused.append(read_response(extras[-1]))
        extras_took_s = time.monotonic() - t0
        assert extras_took_s < HEADER_TIMEOUT_S, f"connecting took {extras_took_s:.1f}s: the holders timed out"
        fds_held = open_fds(gw.proc.pid)
        assert all(r.startswith(b"HTTP/1.1 503 ") for r in refused), refused[0]
        assert all(b"too_many_connections" in r and b"retry-after: 1" in r.lower() for r in refused), refused[0]
        assert all(s.recv(1) == b"" for s in extras[:20]), "refused connections are closed"
        assert fds_held <= fds_before + MAX_CONNECTIONS + 12, (fds_before, fds_held)

        closed = close_times(holders, t0, HEADER_TIMEOUT_S + 6)
        assert len(closed) == MAX_CONNECTIONS, f"still open after {HEADER_TIMEOUT_S + 6}s: {closed}"
        assert min(closed.values()) >= HEADER_TIMEOUT_S - 0.5, closed
    finally:
        for s in holders + extras:
            s.close()

    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
    after = gw.worker("gpu")
    assert after["state"] == "ready" and after["pid"] == gpu["pid"], after
    assert open_fds(gw.proc.pid) <= fds_before + 4
    grown = os.path.getsize(gw.log_path) - log_before
    assert grown < 8 * 1024, gw.tail(grown)
    counted = gw.status()["connections"]  # what was refused and timed out is visible
    assert counted["refused"] >= EXTRA and counted["head_timeouts"] >= MAX_CONNECTIONS // 2, counted
    assert counted["max_connections"] == MAX_CONNECTIONS, counted
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert f"spillover_connections_refused_total {float(counted['refused'])}" in metrics


def test_a_body_sent_too_slowly_gets_408_and_nothing_runs(gw: GatewayProcess) -> None:
    """A request whose head arrives but whose body stalls is answered 408 body_timeout (OpenAI
    shape) after body_timeout_s, and nothing was journaled or run for it."""
    before = gw.status()["decision_counts"]
    s = connect(gw)
    try:
        body = b'{"prompt": "hi", "max_tokens": 2}'
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )
        t0 = time.monotonic()
        reply = read_response(s)
        took = time.monotonic() - t0
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "body_timeout" and error["type"] == "invalid_request_error", error
    assert BODY_TIMEOUT_S - 0.5 <= took <= BODY_TIMEOUT_S + 3, took
    assert gw.status()["decision_counts"] == before


def test_trickled_head_and_idle_keep_alive_are_closed_after_header_timeout(gw: GatewayProcess) -> None:
    """A head sent one byte every 0.3 s is closed header_timeout_s after connecting (its
    bytes do not restart the clock), and an idle keep-alive connection header_timeout_s
    after its response; a complete request on a fresh connection is still served."""
    keep = connect(gw)
    keep.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert read_response(keep).startswith(b"HTTP/1.1 200 ")
    t_keep = time.monotonic()
    trickle = connect(gw)
    t_trickle = time.monotonic()
    head = PARTIAL_HEAD + b"x" * 200
    closed_at: dict[str, float] = {}
    try:
        sent = 0
        while len(closed_at) < 2 and time.monotonic() - t_keep < HEADER_TIMEOUT_S + 6:
            if "trickle" not in closed_at and sent < len(head):
                try:
                    trickle.sendall(head[sent : sent + 1])
                    sent += 1
                except (BrokenPipeError, ConnectionResetError):
                    closed_at["trickle"] = time.monotonic() - t_trickle
            for name, s, t in (("keep", keep, t_keep), ("trickle", trickle, t_trickle)):
                if name in closed_at:
                    continue
                ready, _, _ = select.select([s], [], [], 0.15)
                if ready:
                    try:
                        gone = s.recv(4096) == b""
                    except ConnectionResetError:
                        gone = True
                    if gone:
                        closed_at[name] = time.monotonic() - t
    finally:
        keep.close()
        trickle.close()
    assert set(closed_at) == {"keep", "trickle"}, closed_at
    assert HEADER_TIMEOUT_S - 0.5 <= closed_at["trickle"] <= HEADER_TIMEOUT_S + 3, closed_at
    assert closed_at["keep"] <= HEADER_TIMEOUT_S + 3, closed_at
    assert sent < len(head), "the head never completed"
    with connect(gw) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200 ")


def test_an_oversized_head_gets_431_and_a_large_body_does_not(gw: GatewayProcess) -> None:
    """A request head past MAX_HEAD_BYTES, sent at full speed in one header, in many, or
    behind empty lines, is answered 431 and closed (the parser itself bounds nothing), and
    counted; a body far larger than that after a normal head is read as a body, also when
    the head's last bytes come in the same read as the body."""
    from spillover.http.server import MAX_HEAD_BYTES

    before = gw.status()["connections"]["heads_too_large"]
    one = b"x" * (MAX_HEAD_BYTES + 1024)
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"y" * 100) for i in range(MAX_HEAD_BYTES // 100 + 10))
    heads = [
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + one + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\n" + many,
        b"\r\n\r\nGET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + one + b"\r\n\r\n",
    ]
    for head in heads:
        with connect(gw) as s:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(head)
            got = read_response(s)
            assert got.startswith(b"HTTP/1.1 431 "), got[:200]
            assert _json_answer(got)[2]["error"]["code"] == "request_head_too_large", got[:300]  # rule 7
            assert s.recv(4096) == b""  # closed
    assert gw.status()["connections"]["heads_too_large"] == before + len(heads)
    body = json.dumps(
        {"model": "nobody", "messages": [{"role": "user", "content": "z" * (4 * MAX_HEAD_BYTES)}]}
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    for cut in (0, 1, 2, 3):  # the head's end split across two reads, or not
        with connect(gw) as s:
            s.sendall(head[: len(head) - cut])
            time.sleep(0.2)
            s.sendall(head[len(head) - cut :] + body)
            got = read_response(s)
            assert got.startswith(b"HTTP/1.1 404 "), (cut, got[:300])  # unknown model: the body was read whole
            assert b"model_not_found" in got


def _json_answer(got: bytes) -> tuple[int, dict[str, str], Any]:
    """A whole response's status, headers (lower-cased names) and JSON body."""
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    assert headers["content-type"] == "application/json", got[:300]
    return int(lines[0].split()[1]), headers, json.loads(body)


EMB = b"POST /v1/embeddings HTTP/1.1\r\nHost: h\r\n"  # a request line and Host, the faults after them


@pytest.mark.parametrize(
    ("head", "fault"),
    [
        (EMB + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", "Content-Length"),
        (EMB + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Content-Length"),
        (EMB + b"Content-Length: -1\r\n\r\n", "Content-Length"),
        (b"BREW /v1/models HTTP/1.1\r\nHost: h\r\n\r\n", "method"),
        (b"GET /health HTTP/1.1\r\nHost: h\r\nX-A\x01: b\r\n\r\n", "header"),
        (b"POST /api/chat HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Content-Length"),
    ],
)
def test_a_request_that_is_not_http_gets_a_json_400_naming_the_fault(
    gw: GatewayProcess, head: bytes, fault: str
) -> None:
    """What llhttp cannot parse is answered as the app answers errors (rule 7): a JSON 400
    ``invalid_http`` whose message names the parser's fault, a request id, connection closed;
    under /api/ in Ollama's shape. (uvicorn's own answer was plain text.)"""
    with connect(gw) as s:
        s.sendall(head)
        got = read_response(s)
        assert s.recv(4096) == b""  # closed
    status, headers, body = _json_answer(got)
    assert status == 400 and headers["connection"] == "close" and headers["x-spillover-request-id"], got
    assert headers["x-should-retry"] == "false", got
    if b" /api/" in head.split(b"\r\n")[0]:
        assert body["code"] == "invalid_http" and fault.lower() in body["error"].lower(), body
    else:
        assert body["error"]["code"] == "invalid_http" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith("the request cannot be read as HTTP: "), body
        assert fault.lower() in body["error"]["message"].lower(), body


def test_what_is_not_http_is_counted_not_logged_line_by_line(gw: GatewayProcess) -> None:
    """Rules 4 and 7: 30 unparseable requests raise ``connections.not_http`` by 30 and add no
    line each to the log (uvicorn wrote "Invalid HTTP request received." for every one)."""
    before = gw.status()["connections"]["not_http"]
    with open(gw.log_path, "rb") as f:
        lines_before = f.read().count(b"Invalid HTTP request received")
    for _ in range(30):
        with connect(gw) as s:
            s.sendall(b"BREW /v1/models HTTP/1.1\r\nHost: h\r\n\r\n")
            assert read_response(s).startswith(b"HTTP/1.1 400 ")
    assert gw.status()["connections"]["not_http"] == before + 30
    time.sleep(0.5)  # the log is written by the gateway's own process
    with open(gw.log_path, "rb") as f:
        assert f.read().count(b"Invalid HTTP request received") == lines_before


def test_a_bad_chunk_in_a_body_refuses_that_request_at_once_with_one_answer(gw: GatewayProcess) -> None:
    """A chunked body whose chunk size is garbage: the request being read is the one refused,
    at once (it waited for the body time-out, 30 s, answered 408, and then sent the 400 as a
    second answer): its only answer is the 400 ``invalid_http``, in Ollama's shape on
    /api/chat, and nothing is logged for it (its app saw the client go away: that was a
    traceback each). One the app answered already (415: no JSON Content-Type) before its body
    broke gets no second answer: the connection closes."""
    head = b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
    t0 = time.monotonic()
    with connect(gw) as s:
        s.sendall(head + b"Content-Type: application/json\r\n\r\n5\r\n" + b'{"a":' + b"\r\nZZ\r\n")
        got = b""
        while chunk := s.recv(4096):  # until the server closes
            got += chunk
    assert time.monotonic() - t0 < 5 and got.count(b"HTTP/1.1 ") == 1, got
    status, _, body = _json_answer(got)
    assert status == 400 and body["code"] == "invalid_http" and "chunk" in body["error"].lower(), got
    with open(gw.log_path, "rb") as f:
        log_before = f.read().count(b"\n")
    for path in (b"/v1/chat/completions", b"/api/chat"):  # its app sees the client gone: no traceback logged
        for _ in range(10):
            with connect(gw) as s:
                s.sendall(
                    b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                    b"Content-Type: application/json\r\n\r\na\r\n" + b'{"model":"' + b"\r\nZZ\r\n"
                )
                assert read_response(s).startswith(b"HTTP/1.1 400 ")
    time.sleep(0.5)
    with open(gw.log_path, "rb") as f:
        grown = f.read().split(b"\n")[log_before:]
    assert len(grown) < 5 and not any(b"Traceback" in line or b"ClientDisconnect" in line for line in grown), grown
    with connect(gw) as s:
        s.sendall(head + b"\r\n5\r\n" + b'{"a":' + b"\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 415 ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"ZZ\r\n")
        rest = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(4096):
                rest += chunk
    assert rest == b"", rest
    assert httpx.get(gw.url + "/health").status_code == 200


def test_an_oversized_head_in_one_read_is_answered_in_its_routes_shape(gw: GatewayProcess) -> None:
    """A head over the bound is answered in the shape of its target's route, Ollama's under
    /api/, however its bytes were split: in one read (its request line not parsed yet), or cut
    inside its request line, its method included (both were OpenAI's)."""
    from spillover.http.server import MAX_HEAD_BYTES

    big = b"x" * (MAX_HEAD_BYTES + 1024)
    for target, ollama in ((b"/api/tags", True), (b"/v1/models", False)):
        head = b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + big + b"\r\n\r\n"
        for cut in (0, 1, 3, 5, 9):  # whole, or its request line split (inside the method too)
            with connect(gw) as s:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    if cut:
                        s.sendall(head[:cut])
                        time.sleep(0.1)
                    s.sendall(head[cut:])
                status, _, body = _json_answer(read_response(s))
            assert status == 431, (cut, body)
            code = body["code"] if ollama else body["error"]["code"]
            assert code == "request_head_too_large" and isinstance(body["error"], str) is ollama, (cut, body)


def test_a_body_left_unread_by_an_early_answer_is_not_a_head(gw: GatewayProcess) -> None:
    """The app may answer before reading a body (415 here): the body's bytes that follow are
    neither a head (no 431) nor another request; the answer is the only one."""
    from spillover.http.server import MAX_HEAD_BYTES

    with connect(gw) as s:
        n = 2 * MAX_HEAD_BYTES
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n{" % n)
        first = read_response(s)
        assert first.startswith(b"HTTP/1.1 415 "), first[:300]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"z" * (n - 1))
        s.settimeout(1.0)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            assert b"431" not in s.recv(4096)


def test_a_bad_request_behind_a_good_one_waits_for_its_answer(gw: GatewayProcess) -> None:
    """A request that cannot be parsed, pipelined behind a good one, does not take the good
    one's answer: 200 first, then the 400, then the connection closes."""
    with connect(gw) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGARBAGE\x01 / HTTP/1.1\r\n\r\n")
        got = b""
        while chunk := s.recv(4096):  # until the server closes
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 "), got[:300]
        assert got.count(b"HTTP/1.1 ") == 2 and got.index(b"HTTP/1.1 400 ") > got.index(b'{"status":"ok"}'), got


def test_pipelined_requests_are_all_answered_in_order(gw: GatewayProcess) -> None:
    """Three requests sent in one write on one connection get three answers, in order, and
    the connection then waits for the next head as usual."""
    with connect(gw) as s:
        s.sendall(
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        answers = read_responses(s, 3)
        assert [a.split(b" ", 2)[1] for a in answers] == [b"200"] * 3
        assert b'"object":"list"' in answers[1].replace(b" ", b"")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200 ")
