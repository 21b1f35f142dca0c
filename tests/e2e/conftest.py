"""Real gateway processes with real workers and the real default model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from spillover.testing import GatewayProcess
from tests.e2e.helpers import healthy_client


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    """A gateway on a 1 GiB sim GPU plus a CPU worker, shared by a test module."""
    with GatewayProcess(["--gpu", "sim:1024"]) as gw:
        yield gw


@pytest.fixture()
def client(gateway: GatewayProcess) -> openai.OpenAI:
    """The official OpenAI client pointed at the gateway."""
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def http(gw: GatewayProcess) -> Iterator[httpx.Client]:
    """An httpx client to the module's own ``gw`` once both its workers are ready and its GPU
    breaker is closed again."""
    with healthy_client(gw) as c:
        yield c
