"""Real gateway processes with real workers and the real default model."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from spillover.testing import GatewayProcess


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    """A gateway on a 1 GiB sim GPU plus a CPU worker, shared by a test module."""
    with GatewayProcess(["--gpu", "sim:1024"]) as gw:
        yield gw


@pytest.fixture()
def client(gateway: GatewayProcess) -> openai.OpenAI:
    """The official OpenAI client pointed at the gateway."""
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
