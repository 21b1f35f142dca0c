"""DegradedAnswers: the mode is degraded while answers are pushed off the GPU, and only then."""

from __future__ import annotations

from spillover.runtime.status import DegradedAnswers


def test_pushed_answers_count_within_the_window_and_name_the_latest_reason() -> None:
    """Answers served on the CPU because of the GPU count for window_s, the latest reason
    is named, and they age out exactly after the window."""
    d = DegradedAnswers(window_s=60.0)
    d.note(10.0, "cpu", "observed_pressure")
    d.note(20.0, "cpu", "failover:crash")
    assert d.recent(20.0) == (2, "failover:crash")
    assert d.recent(70.0) == (2, "failover:crash")  # the first is exactly 60 s old: still in
    assert d.recent(70.5) == (1, "failover:crash")
    assert d.recent(80.0) == (1, "failover:crash")
    assert d.recent(80.5) == (0, None)


def test_gpu_answers_and_chosen_cpu_answers_do_not_count() -> None:
    """GPU answers, the CPU canary and a client's own prefer:cpu are not degradation."""
    d = DegradedAnswers()
    d.note(1.0, "gpu", "fits")
    d.note(1.0, "none", None)
    d.note(1.0, "cpu", "canary")
    d.note(1.0, "cpu", "client_prefers_cpu")
    assert d.recent(1.0) == (0, None)
    d.note(2.0, "cpu", None)
    assert d.recent(2.0) == (1, "cpu")
