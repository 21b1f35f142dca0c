"""A client's deadline on the GPU lane: which lane may take a job, and how long it may wait
for the device (``runtime.scheduler`` gathers the lanes' estimates and acts on the answers).

A job's ``DeadlineFacts`` hold, at ``now_s``, its client's ``deadline_s``, the device's
estimate of its own work (``device_s``: the GPU lane's measured speed, fed by the resident's
and the split's runs; before any, the lanes' common first guess) and the CPU lane's from now
(``cpu_s``: the work queued ahead of it and its own, at the ``max_tokens`` it would run with
there, not its running requests', which may end at any token; infinite when the CPU lane
could not take it: no ready worker, no place in its queue, held by the host-RAM guard, no CPU
route, or the job too long for its context). Each lane's
estimate is at the ``max_tokens`` the job runs with there (a shrinkable job cut to its context).

Rules:

1. A lane is *in time* when ``now_s + its estimate <= deadline_s``.
2. While the CPU lane is in time, the job may wait for the device until the CPU lane's last
   start with half its estimate to spare (``CPU_SPARE``: an estimate on busy cores is
   optimistic; round 51's answers came up to 0.7 s late at the last moment), less
   ``slack_s`` (a pass may come a tick late): ``deadline - cpu_s * (1 + CPU_SPARE) -
   slack_s``. Once it is not, until the device's own last start: ``deadline - device_s -
   slack_s``. Past that moment, admission decides as after its delay bound.
3. A job the device would start now is refused (``deadline_exceeded``) when no lane is in
   time. The device's estimate alone does not refuse it: an unmeasured one is a guess. Late
   binding starts no such job on the device either.
4. A job on the GPU lane goes to the CPU lane (``cpu_meets_deadline``), whether the device is
   free or busy, when the device, *measured* (``device_measured``: a run fed its estimate
   lately; the runtime says how lately), is not in time and the CPU lane is. Late binding
   never moves a job onto a device measured not in time for it.
5. A job sent off a busy device (``WAITS_FOR``: a slot or memory that frees as running
   requests end) that the CPU lane cannot finish in time waits for the device while rule 2
   lets it; a dead device or an open breaker is not waited for.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillover.core.reasons import Reason

__all__ = ["CPU_SPARE", "WAITS_FOR", "DeadlineFacts", "device_too_slow", "late_everywhere", "may_wait", "wait_ends_s"]

CPU_SPARE = 0.5  # rule 2: the CPU lane's estimate, and half of it again to spare
WAITS_FOR = frozenset({Reason.GPU_BUSY, Reason.MARGIN, Reason.OBSERVED_PRESSURE, Reason.KV_PAGES_EXHAUSTED})


@dataclass(frozen=True)
class DeadlineFacts:
    """What a deadline decision needs about one job at ``now_s`` (the module's docstring)."""

    now_s: float
    deadline_s: float
    device_s: float
    cpu_s: float  # math.inf: the CPU lane could not take it
    device_measured: bool
    slack_s: float  # a pass may come this late (the runtime's tick)

    @property
    def cpu_in_time(self) -> bool:
        """Rule 1, the CPU lane."""
        return self.now_s + self.cpu_s <= self.deadline_s

    @property
    def device_in_time(self) -> bool:
        """Rule 1, the device."""
        return self.now_s + self.device_s <= self.deadline_s


def wait_ends_s(f: DeadlineFacts) -> float:
    """Rule 2: until when the job may wait for the device."""
    if f.cpu_in_time:  # a pass late past the CPU lane's last start still sends it there
        return f.deadline_s - f.cpu_s * (1 + CPU_SPARE) - f.slack_s
    return f.deadline_s - f.device_s - f.slack_s


def may_wait(f: DeadlineFacts) -> bool:
    """Rule 2: whether the job may wait for the device now."""
    return f.now_s < wait_ends_s(f)


def late_everywhere(f: DeadlineFacts) -> bool:
    """Rule 3: no lane would finish the job in time."""
    return not (f.cpu_in_time or f.device_in_time)


def device_too_slow(f: DeadlineFacts) -> bool:
    """Rule 4: the measured device would be late where the CPU lane would not."""
    return f.device_measured and not f.device_in_time and f.cpu_in_time
