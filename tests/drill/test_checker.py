"""The drill's checker on hand-written histories: it must catch each kind of violation."""

from __future__ import annotations

from typing import Any

from spillover.drill.checker import check


def op(n: int, kind: str = "ok", **res: Any) -> list[dict[str, Any]]:
    base = {"scenario": "s", "op": n, "t": float(n)}
    out = {
        "route": "gpu",
        "degraded_header": "0",
        "degraded_body": False,
        "latency_s": 0.1,
        "request_id": f"r{n}",
        "status": 200,
    } | res
    return [{"type": "invoke", **base, "name": f"op{n}"}, {"type": kind, **base, **out}]


def final(rid: str, state: str | None) -> dict[str, Any]:
    return {"type": "final", "t": 99.0, "request_id": rid, "state": state, "accepted": state is not None}


def test_clean_history_passes() -> None:
    """A history with every rule kept passes, with the counts right."""
    h = (
        op(1)
        + op(2, route="cpu", degraded_header="1", degraded_body=True)
        + [final("r1", "completed"), final("r2", "completed")]
    )
    f = check(h, "s")
    assert f.passed, f.failures
    assert (f.invoked, f.ok, f.accepted, f.completed, f.degraded_served, f.degraded_flagged) == (2, 2, 2, 2, 1, 1)


def test_lost_request_is_caught() -> None:
    """An accepted request whose journal state never became terminal is lost."""
    h = op(1, kind="info", request_id="r1") + [final("r1", "running")]
    f = check(h, "s")
    assert f.lost == ["r1"] and not f.passed


def test_accepted_request_missing_from_journal_is_lost() -> None:
    """A request id the gateway handed out that the journal no longer knows is lost."""
    h = op(1, request_id="r1")
    f = check(h, "s")
    assert f.lost == ["r1"] and not f.passed


def test_refused_request_is_not_counted_as_accepted() -> None:
    """A 503 queue_full before acceptance (not in the journal) is not a loss."""
    h = op(1, kind="fail", status=503, error_code="queue_full") + [final("r1", None)]
    f = check(h, "s")
    assert f.passed and f.accepted == 0 and f.failed == 1


def test_duplicate_tool_execution_is_caught() -> None:
    """The same tool call applied twice, or one agent step applied under two ids, is caught."""
    tools = [
        {"type": "tool", "t": 1.0, "scenario": "s", "agent": "a", "step": 1, "tool_call_id": "c1"},
        {"type": "tool", "t": 2.0, "scenario": "s", "agent": "a", "step": 1, "tool_call_id": "c2"},
    ]
    f = check(op(1) + [final("r1", "completed")] + tools, "s")
    assert f.duplicate_tool_effects == 1 and not f.passed


def test_unflagged_degraded_and_false_flag_are_caught() -> None:
    """A CPU response without the degraded flag, and a GPU response with it, both fail."""
    h = (
        op(1, route="cpu", degraded_header="0", degraded_body=False)
        + op(2, degraded_header="1")
        + [final("r1", "completed"), final("r2", "completed")]
    )
    f = check(h, "s")
    assert f.degraded_served == 1 and f.degraded_flagged == 0 and f.false_flags == 1
    assert len(f.failures) == 2


def test_non_equivalent_tokens_are_caught() -> None:
    """A greedy run whose text differs from its uninterrupted reference fails equivalence."""
    h = op(1, text="1, 2, 3", reference_text="1, 2, 4") + [final("r1", "completed")]
    f = check(h, "s")
    assert f.equivalence_failed == ["r1"] and not f.passed


def test_fallback_answers_are_not_held_to_equivalence_but_must_be_flagged() -> None:
    """A fallback model's different text is no equivalence failure; an unflagged one still fails."""
    fb = {"route": "cpu", "model_fallback": True, "text": "other", "reference_text": "ref"}
    ok = check(op(1, degraded_header="1", degraded_body=True, **fb) + [final("r1", "completed")], "s")
    assert ok.passed and ok.equivalence_checked == 0 and ok.degraded_flagged == 1
    bad = check(op(1, **fb) + [final("r1", "completed")], "s")
    assert not bad.passed and bad.degraded_flagged == 0


def test_host_budget_overrun_is_caught() -> None:
    """A sample with RSS above the budget fails the host criterion."""
    h = op(1) + [
        final("r1", "completed"),
        {"type": "sample", "t": 1.0, "scenario": "s", "lanes": [], "host_rss": 900, "host_budget": 800},
    ]
    f = check(h, "s")
    assert not f.passed and "budget" in f.failures[0]


def test_failed_assertion_is_a_failure() -> None:
    """A scenario's own expectation that did not hold fails the scenario."""
    h = op(1) + [final("r1", "completed"), {"type": "assert", "t": 1.0, "scenario": "s", "name": "x", "ok": False}]
    assert not check(h, "s").passed


def test_stream_that_moved_to_cpu_is_flagged_in_band() -> None:
    """A stream whose headers said GPU and which moved to CPU counts as flagged when its
    spillover chunk says degraded, and as unflagged when it does not."""
    moved = op(1, stream=True, header_route="gpu", route="cpu", degraded_header="0", degraded_body=True)
    silent = op(2, stream=True, header_route="gpu", route="cpu", degraded_header="0", degraded_body=False)
    f = check(moved + silent + [final("r1", "completed"), final("r2", "completed")], "s")
    assert (f.degraded_served, f.degraded_flagged) == (2, 1) and len(f.failures) == 1
