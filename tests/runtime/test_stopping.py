"""The gateway's own stop (Ctrl-C, SIGTERM): open requests keep their grace, and end as
they would (a client that goes away cancels); ``STOP_AHEAD_S`` before uvicorn's grace ends the
gateway stops what still runs, resumable, and refuses what comes after."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace
from typing import Any

import pytest

from spillover.core.lifecycle import State
from spillover.errors import ClientDisconnected, ServerStopping
from spillover.runtime.gateway import STOP_AHEAD_S, Gateway
from spillover.runtime.outcomes import classify_error, stopped
from spillover.runtime.requests import Refused, RequestService


def test_the_gateway_stops_its_requests_only_shortly_before_the_grace_ends() -> None:
    async def main() -> None:
        cancelled: list[float] = []
        gw: Any = SimpleNamespace(stopping=False)
        gw.requests = SimpleNamespace(cancel_all=lambda: cancelled.append(asyncio.get_running_loop().time()))
        gw.stop_requests = functools.partial(Gateway.stop_requests, gw)
        t0 = asyncio.get_running_loop().time()
        Gateway.begin_stop(gw, STOP_AHEAD_S + 1.0)
        await asyncio.sleep(0.1)
        assert not gw.stopping and not cancelled  # the grace: a client going away still stops its own
        assert isinstance(stopped("r", server_stopping=gw.stopping), ClientDisconnected)
        await asyncio.sleep(1.4)  # margins of a loaded machine's late wakes, either side
        assert gw.stopping and len(cancelled) == 1 and 0.95 <= cancelled[0] - t0 < 1.5
        err = stopped("r", server_stopping=gw.stopping)
        assert isinstance(err, ServerStopping) and classify_error(err) is State.RESUMABLE_ERROR

    asyncio.run(main())


def test_a_request_after_the_gateway_stopped_its_requests_is_refused_resumable() -> None:
    svc = RequestService(SimpleNamespace(stopping=True))  # type: ignore[arg-type]
    svc.endpoints["chat"] = SimpleNamespace()  # type: ignore[assignment]
    with pytest.raises(Refused) as e:
        asyncio.run(svc.submit("chat", {}, idem_key=None, deadline_ms=None))
    assert isinstance(e.value.error, ServerStopping) and e.value.error.retry_after_s >= 1
