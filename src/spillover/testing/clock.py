"""A fake monotonic clock for tests that never sleep."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FakeClock"]


@dataclass
class FakeClock:
    """Call it for the time; ``advance`` moves it."""

    now_s: float = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> float:
        self.now_s += seconds
        return self.now_s
