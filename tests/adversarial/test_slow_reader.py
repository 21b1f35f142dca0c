"""A client that stops reading its stream cannot hold a worker slot: once the server's write
buffer stays full for ``[server].send_timeout_s`` the connection is aborted (counted as
``send_timeouts``), the request ends as a disconnected client's, and the slot is free. Before,
the stream's request held its GPU slot for as long as the client kept the socket open, past
``request_timeout_s``, and ended an internal error when it closed."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import ready_worker, wait_for

pytestmark = pytest.mark.e2e

SEND_TIMEOUT_S = 2.0
# Large frames (20 alternatives a token) fill the socket's buffers long before the answer ends.
BODY = {
    "messages": [{"role": "user", "content": "Write a very long story about a dragon and a knight."}],
    "max_tokens": 1900,
    "temperature": 0,
    "stream": True,
    "logprobs": True,
    "top_logprobs": 20,
}


def gpu_running(gw: GatewayProcess) -> int:
    return sum(lane["running"] for lane in gw.status()["lanes"] if lane["lane"] == "gpu")


def test_a_stream_nobody_reads_frees_its_slot_and_ends_as_a_disconnect() -> None:
    cfg = {"server": {"send_timeout_s": SEND_TIMEOUT_S}}
    with GatewayProcess(["--gpu", "sim:1024", "--chat-only", "--gpu-slots", "1"], config=cfg) as gw:
        ready_worker(gw, "gpu")
        url = urlparse(gw.url)
        body = json.dumps(BODY).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.connect((url.hostname, url.port))
        try:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(1)  # the head only: nothing after it is ever read
            rid = next(
                line.split(b":", 1)[1].strip().decode()
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"x-spillover-request-id")
            )
            wait_for(lambda: gpu_running(gw) == 1, 30, "the stream running")
            t0 = time.monotonic()
            wait_for(lambda: gpu_running(gw) == 0, 120, "the slot freed while the socket stays open")
            held_s = time.monotonic() - t0
            with httpx.Client(base_url=gw.url, timeout=60) as c:
                doc = wait_for(
                    lambda: (d := c.get(f"/v1/requests/{rid}").json())["state"] != "running" and d, 30, "ended"
                )
                assert doc["state"] == "resumable_error", doc  # as a client that went away
                assert "client_disconnected" in json.dumps(doc), doc
                assert gw.status()["connections"]["send_timeouts"] >= 1
                assert "spillover_connections_send_timeouts_total 1.0" in c.get("/metrics").text
                r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})  # the slot serves again
                assert r.status_code == 200 and r.headers["x-spillover-route"] == "gpu", r.text
            assert held_s < 120
        finally:
            s.close()
