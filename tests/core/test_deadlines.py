"""A client's deadline on the GPU lane (``core.deadlines``), rule by rule, at its boundaries
(the scheduler's scenarios on a fake clock are in ``tests/runtime/test_deadlines.py``)."""

from __future__ import annotations

import math

import pytest

from spillover.core.deadlines import (
    CPU_SPARE,
    WAITS_FOR,
    DeadlineFacts,
    device_too_slow,
    late_everywhere,
    may_wait,
    wait_ends_s,
)
from spillover.core.reasons import Reason

INF = math.inf


def facts(
    now: float = 100.0, *, device: float = 2.0, cpu: float = 4.0, measured: bool = True, slack: float = 0.25
) -> DeadlineFacts:
    """A job with a deadline at 110 (ten seconds from the default ``now``)."""
    return DeadlineFacts(
        now_s=now, deadline_s=110.0, device_s=device, cpu_s=cpu, device_measured=measured, slack_s=slack
    )


@pytest.mark.parametrize(
    ("f", "cpu", "device"),
    [
        (facts(device=10.0, cpu=10.0), True, True),  # finishing at the deadline is in time
        (facts(device=10.5, cpu=10.5), False, False),
        (facts(106.0, device=4.0, cpu=4.5), False, True),
        (facts(cpu=INF), False, True),  # the CPU lane cannot take it
    ],
)
def test_rule_1_a_lane_is_in_time_when_it_finishes_by_the_deadline(f: DeadlineFacts, cpu: bool, device: bool) -> None:
    """Rule 1: now plus the lane's estimate at or before the deadline."""
    assert (f.cpu_in_time, f.device_in_time) == (cpu, device)


@pytest.mark.parametrize(
    ("f", "ends"),
    [
        (facts(cpu=4.0), 110.0 - 4.0 * 1.5 - 0.25),  # the CPU lane in time: its last start, half again to spare
        (facts(cpu=4.0, slack=0.0), 104.0),
        (facts(cpu=8.0), 110.0 - 12.0 - 0.25),  # past already: admission decides now
        (facts(device=3.0, cpu=INF), 110.0 - 3.0 - 0.25),  # no CPU lane: the device's own last start
        (facts(device=3.0, cpu=12.0), 106.75),  # the CPU lane too slow: the device's
        (facts(103.0, device=3.0, cpu=7.0), 110.0 - 7.0 * 1.5 - 0.25),  # the CPU lane just in time still decides
    ],
)
def test_rule_2_the_wait_for_the_device_ends_at_the_last_start_that_keeps_the_deadline(
    f: DeadlineFacts, ends: float
) -> None:
    """Rule 2: while the CPU lane is in time, its last start with ``CPU_SPARE`` to spare; else
    the device's own; each ``slack_s`` early."""
    assert CPU_SPARE == 0.5
    assert wait_ends_s(f) == pytest.approx(ends, abs=1e-12)


@pytest.mark.parametrize(
    ("now", "waits"),
    [(103.74, True), (103.75, False), (104.0, False)],
)
def test_rule_2_a_job_waits_only_before_its_wait_ends(now: float, waits: bool) -> None:
    """Rule 2: ``may_wait`` is strictly before ``wait_ends_s`` (103.75 with the CPU lane at 4 s,
    decided as at ``now``: the CPU lane's estimate does not move with it here)."""
    assert wait_ends_s(facts(now)) == 103.75
    assert may_wait(facts(now)) is waits


@pytest.mark.parametrize(
    ("f", "late"),
    [
        (facts(device=11.0, cpu=11.0), True),
        (facts(device=11.0, cpu=INF), True),
        (facts(device=10.0, cpu=11.0), False),  # the device alone in time
        (facts(device=11.0, cpu=10.0), False),  # the CPU lane alone
        (facts(device=11.0, cpu=10.0, measured=False), False),
        (facts(device=1.0, cpu=1.0), False),
    ],
)
def test_rule_3_refused_only_when_no_lane_is_in_time(f: DeadlineFacts, late: bool) -> None:
    """Rule 3: the device's estimate alone does not refuse a job the CPU lane would finish."""
    assert late_everywhere(f) is late


@pytest.mark.parametrize(
    ("f", "slow"),
    [
        (facts(device=11.0, cpu=10.0), True),  # measured late, the CPU lane in time
        (facts(device=11.0, cpu=10.0, measured=False), False),  # a first guess is not evidence
        (facts(device=10.0, cpu=1.0), False),  # the device in time, however much faster the CPU lane
        (facts(device=11.0, cpu=11.0), False),  # late everywhere: rule 3's refusal, not a route
        (facts(device=11.0, cpu=INF), False),
    ],
)
def test_rule_4_a_measured_device_that_would_be_late_leaves_the_job_to_a_cpu_lane_in_time(
    f: DeadlineFacts, slow: bool
) -> None:
    """Rule 4: ``cpu_meets_deadline`` only on a measured device's estimate."""
    assert device_too_slow(f) is slow


def test_rule_5_only_a_busy_device_is_waited_for() -> None:
    """Rule 5: the reasons a device frees as its running requests end; not a dead device, an
    open breaker, a stale reading or a job too long for it."""
    assert {Reason.GPU_BUSY, Reason.MARGIN, Reason.OBSERVED_PRESSURE, Reason.KV_PAGES_EXHAUSTED} == WAITS_FOR
