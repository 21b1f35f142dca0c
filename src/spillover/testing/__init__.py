"""Fakes and harnesses shipped with the product: used by the tests, the drill and benchmarks."""

from spillover.testing.clock import FakeClock
from spillover.testing.process import GatewayProcess, free_port, tree_rss

__all__ = ["FakeClock", "GatewayProcess", "free_port", "tree_rss"]
