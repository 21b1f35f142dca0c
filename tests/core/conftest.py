"""Core-tier fixtures: the real default model's spec, read once per process.

Parsing the GGUF takes seconds. Mutation testing (scripts/mutation-check) runs a fresh pytest
session per mutant in processes forked from one that has already read it, so the spec is
memoized at module level rather than only per session.
"""

from __future__ import annotations

import functools

import pytest

from spillover.config import default_model_path
from spillover.core.memory import ModelSpec


@functools.cache
def _default_spec() -> ModelSpec:
    from spillover.engine.gguf_meta import read_model_spec

    return read_model_spec(default_model_path())


@pytest.fixture(scope="session")
def smol_spec() -> ModelSpec:
    """ModelSpec read from the real default GGUF (once per process)."""
    return _default_spec()
