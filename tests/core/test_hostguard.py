"""The CPU lane's host-RAM guard, row by row, at every boundary, with the verdict written out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spillover.core.hostguard import HostView, may_start_cpu

MIB = 1024 * 1024

# Two slots, one running and holding the only context: the next request needs a new context of
# 100 MiB. Budget 1000 MiB, 600 MiB used (predicted), 500 MiB available, 200 MiB to keep free.
BASE = HostView(
    running=1,
    contexts=1,
    slots=2,
    predicted_bytes=600 * MIB,
    observed_bytes=500 * MIB,
    slot_bytes=100 * MIB,
    budget_bytes=1000 * MIB,
    available_bytes=500 * MIB,
    min_free_bytes=200 * MIB,
)

ROWS: list[tuple[str, dict[str, int], bool, tuple[bool, str]]] = [
    ("room in budget and in free memory", {}, True, (True, "fits")),
    ("every slot busy", {"running": 2, "contexts": 2}, True, (False, "cpu_slots_busy")),
    ("more running than slots", {"running": 3, "contexts": 3}, True, (False, "cpu_slots_busy")),
    ("every slot busy, guard off", {"running": 2}, False, (False, "cpu_slots_busy")),
    ("zero slots", {"running": 0, "contexts": 0, "slots": 0}, True, (False, "cpu_slots_busy")),
    ("one slot left", {"running": 0, "contexts": 0, "slots": 1}, True, (True, "fits")),
    ("guard off ignores the budget", {"predicted_bytes": 5000 * MIB}, False, (True, "host_guard_disabled")),
    ("guard off ignores free memory", {"available_bytes": 0}, False, (True, "host_guard_disabled")),
    (
        "an idle context costs nothing",
        {"contexts": 2, "predicted_bytes": 5000 * MIB, "available_bytes": 0},
        True,
        (True, "context_free"),
    ),
    ("used + slot exactly the budget", {"predicted_bytes": 900 * MIB}, True, (True, "fits")),
    ("used + slot one byte over the budget", {"predicted_bytes": 900 * MIB + 1}, True, (False, "host_budget")),
    ("observed above predicted counts", {"observed_bytes": 900 * MIB + 1}, True, (False, "host_budget")),
    (
        "predicted above observed counts",
        {"predicted_bytes": 950 * MIB, "observed_bytes": 100 * MIB},
        True,
        (False, "host_budget"),
    ),
    (
        "observed exactly at the limit",
        {"predicted_bytes": 0, "observed_bytes": 900 * MIB},
        True,
        (True, "fits"),
    ),
    ("keeps exactly min_free available", {"available_bytes": 300 * MIB}, True, (True, "fits")),
    ("would keep one byte less than min_free", {"available_bytes": 300 * MIB - 1}, True, (False, "host_available")),
    # rule 4: an unloaded model's first context (100 MiB, 60 of them weights mapped from its file)
    (
        "mapped weights take no available memory",
        {"contexts": 0, "running": 0, "mapped_bytes": 60 * MIB, "available_bytes": 240 * MIB},
        True,
        (True, "fits"),
    ),
    (
        "the rest of it does",
        {"contexts": 0, "running": 0, "mapped_bytes": 60 * MIB, "available_bytes": 240 * MIB - 1},
        True,
        (False, "host_available"),
    ),
    (
        "mapped weights count against the budget",
        {"contexts": 0, "running": 0, "mapped_bytes": 60 * MIB, "predicted_bytes": 900 * MIB + 1},
        True,
        (False, "host_budget"),
    ),
    (
        "budget checked before free memory",
        {"predicted_bytes": 950 * MIB, "available_bytes": 0},
        True,
        (False, "host_budget"),
    ),
]


@pytest.mark.parametrize(("why", "changes", "enabled", "verdict"), ROWS, ids=[r[0] for r in ROWS])
def test_may_start_cpu(why: str, changes: dict[str, int], enabled: bool, verdict: tuple[bool, str]) -> None:
    """Each row: the host as the guard sees it, and the verdict and reason written out by hand."""
    assert may_start_cpu(replace(BASE, **changes), enabled=enabled) == verdict, why


def test_guard_is_on_by_default() -> None:
    """Without ``enabled``, the guard applies: a context over budget is refused."""
    assert may_start_cpu(replace(BASE, predicted_bytes=2000 * MIB)) == (False, "host_budget")
