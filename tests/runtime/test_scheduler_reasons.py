"""The scheduler's reasons on the wire: a rejection's error code is the CPU lane's refusal, and
/v1/status's decision counts and recent decisions show the display text, written out by hand."""

from __future__ import annotations

import asyncio

import pytest

from spillover.config import LaneConfig
from spillover.core.admission import AdmissionPolicy
from spillover.core.ledger import DeviceLedger
from spillover.core.memory import MemoryModel
from spillover.errors import CapacityError
from spillover.runtime.scheduler import Job, Scheduler
from spillover.testing import FakeClock

MIB = 1024 * 1024


def test_reject_code_is_the_refusal_and_the_text_is_unchanged(memory: MemoryModel) -> None:
    """No GPU worker and no CPU worker: the job is rejected with code cpu_unavailable, and the
    decision is recorded as reject:gpu_unavailable+cpu_unavailable."""

    async def main() -> None:
        clock = FakeClock(100.0)
        ledger = DeviceLedger("sim", 1024 * MIB, 16 * MIB, freshness_s=1.0)
        s = Scheduler(
            gpu_lane=LaneConfig(),
            cpu_lane=LaneConfig(),
            ledger=ledger,
            policy=AdmissionPolicy(memory=memory),
            clock=clock,
        )
        job = Job(rid="r1", prompt_tokens=8, max_tokens=8, arrived_s=clock())
        s.submit_nowait(job)
        with pytest.raises(CapacityError) as err:
            await job.future
        assert err.value.code == "cpu_unavailable"
        assert "(gpu_unavailable+cpu_unavailable)" in err.value.message
        assert s.decision_counts == {"reject:gpu_unavailable+cpu_unavailable": 1}
        rec = s.decisions[-1]
        assert (rec["decision"], rec["reason"], rec["route"]) == ("reject", "gpu_unavailable+cpu_unavailable", "none")
        assert type(rec["reason"]) is str

    asyncio.run(main())
