# ruff: noqa: E501  (the table of sentences reads best one row per line)
"""What an error answer says: a plain sentence for people, the details for developers, and
whether a retry can help."""

from __future__ import annotations

import json

import pytest

from spillover.errors import (
    BodyTimeout,
    CapacityError,
    ClientDisconnected,
    ContextLengthExceeded,
    FailoverInterrupted,
    IdempotencyInFlight,
    IdempotencyMismatch,
    InvalidRequest,
    QueueFull,
    RequestCancelled,
    RequestTimedOut,
    RestartInterrupted,
    SpilloverError,
    WorkerFailed,
    to_http,
)
from spillover.http.ollama import ollama_error_body


@pytest.mark.parametrize(
    ("exc", "message", "retry"),
    [
        (RequestCancelled("request r1 was cancelled"), "This request was cancelled before it finished. Send it again, with a new Idempotency-Key if it had one, if you still want an answer.", "false"),
        (QueueFull("the gpu queue is full (8 waiting)", retry_after_s=2.2), "The server is busy right now. Please try again in 3 seconds.", "true"),
        (QueueFull("full", retry_after_s=0.3), "The server is busy right now. Please try again in a second.", "true"),
        (CapacityError("no capacity (margin+too_long_for_cpu)", retry_after_s=5, code="too_long_for_cpu"),
         "The GPU is full and this conversation is too long for the slower CPU path. Try again in 5 seconds, or start a shorter conversation.", "true"),
        (WorkerFailed("request r1 failed: crash on the cpu worker", retry_after_s=1.0), "The model stopped while answering. Please try again in a second.", "true"),
        (FailoverInterrupted("gpu oom after 7 tokens", retry_after_s=1.0),
         "The GPU failed partway through this answer, and the rest could not be produced identically elsewhere. Please try again.", "true"),
        (RestartInterrupted("the gateway restarted while request r1 was streaming", retry_after_s=1.0),
         "The server restarted partway through this answer, and the rest could not be produced identically. Please try again.", "true"),
        (RequestTimedOut("ran past 600 s"), "This answer took too long and was stopped. Try a shorter request or a smaller answer length.", "false"),
        (ContextLengthExceeded("needs 5000 tokens; the longest context is 2048", param="messages"),
         "This conversation is too long for the model. Shorten it or start a new one.", "false"),
        (IdempotencyInFlight("key k in flight"), "This request is still being answered. Wait for it to finish.", "true"),
        (ClientDisconnected("request r1: the client went away"), "The connection closed before this answer was complete. Send it again (with the same Idempotency-Key it runs once).", "true"),
        (BodyTimeout("no body within 30s"), "The request arrived too slowly and was dropped. Please send it again.", "true"),  # never accepted: a retry is safe
    ],
)  # fmt: skip
def test_errors_people_read_say_what_happened_and_what_to_do(exc: SpilloverError, message: str, retry: str) -> None:
    """The message is the plain sentence; the technical account moves to detail; the code
    stays; x-should-retry says whether sending it again can help."""
    e = to_http(exc, "r1")
    assert e.body["error"]["message"] == message
    assert e.body["error"]["detail"] == exc.message and e.body["error"]["code"] == exc.code
    assert e.headers["x-should-retry"] == retry


@pytest.mark.parametrize(
    "exc",
    [
        InvalidRequest("'temperature' must be between 0.0 and 2.0", param="temperature"),
        IdempotencyMismatch("this Idempotency-Key was used with a different request body"),
        SpilloverError("internal error: KeyError"),
    ],
)
def test_developer_errors_keep_their_technical_message(exc: SpilloverError) -> None:
    """A developer's mistake (or a bug) keeps its exact message, no detail, no retry."""
    e = to_http(exc)
    assert e.body["error"]["message"] == exc.message and "detail" not in e.body["error"]
    assert e.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("name", ["\ud800x", "a\udfffb", "\udc80"])
def test_a_lone_surrogate_a_client_sent_is_quoted_escaped_not_a_failed_answer(name: str) -> None:
    """An unknown field whose name holds a lone surrogate (JSON's "\\ud800"): the 400 quoting
    it encodes as UTF-8 (it failed there, and the client got a bare 500), in both shapes."""
    err = InvalidRequest(f"unknown field {name!r}", param=name)
    body = to_http(err).body
    text = json.dumps(body, ensure_ascii=False).encode("utf-8").decode("utf-8")
    assert "\\\\ud" in text, text  # the escape, as text
    assert body["error"]["param"] == name.encode("utf-8", "backslashreplace").decode()
    json.dumps(ollama_error_body(err), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("path", ["/api/chat", "/api/anything", "/v1/chat/completions", "/"])
def test_an_unexpected_error_answers_in_the_shape_of_its_route(path: str) -> None:
    """A bug's 500 (the app's last handler) is Ollama's ``{"error": "..."}`` under /api/ (an
    Ollama client reads its message there), and OpenAI's error object elsewhere; both say
    ``internal_error`` and carry a request id."""
    from spillover.http.app import _unrouted_error

    r = _unrouted_error(RuntimeError("a bug"), path)
    body = json.loads(bytes(r.body))
    assert r.status_code == 500 and r.headers["x-spillover-request-id"]
    if path.startswith("/api/"):
        assert body == {"error": "internal error: RuntimeError", "code": "internal_error", "param": None}
    else:
        assert body["error"]["code"] == "internal_error" and body["error"]["message"] == "internal error: RuntimeError"


@pytest.mark.parametrize("generate", [False, True])
def test_an_ollama_refusal_says_the_wait_it_was_refused_for_in_its_body_as_in_its_header(generate: bool) -> None:
    """A 503 for capacity under /api/: the ``spillover`` object's ``estimated_delay_ms`` is the
    wait the header gives (round 66: the body said 0 beside ``X-Spillover-Estimated-Delay-Ms:
    2500``)."""
    from types import SimpleNamespace

    from spillover.errors import CapacityError
    from spillover.http.ollama import NdjsonEncoding

    run = SimpleNamespace(
        rid="r1",
        info=None,
        req=SimpleNamespace(kind="chat", stream=False),
        prep=SimpleNamespace(max_tokens=8, seed=1),
        exe=SimpleNamespace(attempt=1),
        degraded=lambda: False,
        reason=lambda: None,
        served_model=lambda: "m",
        on_fallback=lambda: False,
    )
    err = CapacityError("the CPU lane would finish it late", retry_after_s=2.5, code="deadline_exceeded")
    out = NdjsonEncoding(run, generate=generate).error(err, committed=False)  # type: ignore[arg-type]
    body = json.loads(b"".join(out.frames))
    assert out.status == 503 and out.headers["X-Spillover-Estimated-Delay-Ms"] == "2500"
    assert body["spillover"]["estimated_delay_ms"] == 2500
