"""Prometheus metrics (``/metrics``): conventional ``spillover_`` names, base units.

Events are counted as they happen (requests, tokens, failovers, latencies); the state of
lanes, devices, breaker, workers and host memory is read from ``Gateway.status()`` at
scrape time, so /metrics and /v1/status never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spillover.errors import SpilloverError

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BREAKER = {"closed": 0, "half_open": 1, "open": 2}
_MODES = ("normal", "degraded", "unavailable")


class _StateCollector(Collector):
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        mode = GaugeMetricFamily("spillover_mode", "1 for the current service mode", labels=["mode"])
        for m in _MODES:
            mode.add_metric([m], 1.0 if st["mode"] == m else 0.0)
        yield mode
        depth = GaugeMetricFamily("spillover_queue_depth", "requests waiting in a lane", labels=["lane"])
        age = GaugeMetricFamily(
            "spillover_queue_oldest_age_seconds", "age of the oldest waiting request", labels=["lane"]
        )
        running = GaugeMetricFamily("spillover_lane_running", "requests running in a lane", labels=["lane"])
        delay = GaugeMetricFamily(
            "spillover_lane_estimated_delay_seconds", "estimated wait for a new request", labels=["lane"]
        )
        shed = CounterMetricFamily("spillover_queue_shed", "requests refused because a lane was full", labels=["lane"])
        for lane in st["lanes"]:
            depth.add_metric([lane["lane"]], lane["depth"])
            age.add_metric([lane["lane"]], lane["oldest_age_s"])
            running.add_metric([lane["lane"]], lane["running"])
            delay.add_metric([lane["lane"]], lane["estimated_delay_ms"] / 1000)
            shed.add_metric([lane["lane"]], lane["shed_total"])
        yield from (depth, age, running, delay, shed)
        dev = st.get("device")
        if dev:
            mem = GaugeMetricFamily("spillover_device_memory_bytes", "device memory by kind", labels=["device", "kind"])
            led = dev["ledger"]
            for kind, key in (
                ("capacity", "capacity_bytes"),
                ("margin", "margin_bytes"),
                ("predicted", "predicted_bytes"),
                ("observed", "observed_bytes"),
                ("headroom", "headroom_bytes"),
            ):
                if led.get(key) is not None:
                    mem.add_metric([dev["spec"], kind], led[key])
            yield mem
            fails = CounterMetricFamily(
                "spillover_device_allocation_failures", "allocations the device refused", labels=["device"]
            )
            fails.add_metric([dev["spec"]], dev["alloc_failures"])
            yield fails
        if st.get("breaker"):
            b = GaugeMetricFamily(
                "spillover_breaker_state",
                "a device worker's breaker (gpu0; split0): 0 closed, 1 half-open, 2 open",
                labels=["worker"],
            )
            for w in st["workers"]:  # the resident worker's, where one runs (not in the split or cpu profile)
                if w["lane"] == "gpu":
                    b.add_metric([w["worker_id"]], _BREAKER[st["breaker"]["circuit"]])
            if st.get("split_breaker"):
                b.add_metric([st["split_breaker"]["worker_id"]], _BREAKER[st["split_breaker"]["circuit"]])
            yield b
        up = GaugeMetricFamily("spillover_worker_up", "1 when the worker is ready", labels=["worker", "lane"])
        restarts = CounterMetricFamily("spillover_worker_restarts", "worker restarts", labels=["worker"])
        for w in st["workers"]:
            up.add_metric([w["worker_id"], w["lane"]], 1.0 if w["state"] == "ready" else 0.0)
            restarts.add_metric([w["worker_id"]], w["restarts"])
        svc_where = GaugeMetricFamily(
            "spillover_service_on_gpu", "1 when a service's requests start on the GPU now", labels=["service", "kind"]
        )
        svc_queue = GaugeMetricFamily("spillover_service_queue_depth", "requests waiting", labels=["service"])
        for svc in st.get("services", []):
            svc_where.add_metric([svc["name"], svc["kind"]], 1.0 if svc["where"] == "gpu" else 0.0)
            svc_queue.add_metric([svc["name"]], svc["queued"])
            for w in svc.get("workers", []):
                up.add_metric([w["worker_id"], w["lane"]], 1.0 if w["state"] == "ready" else 0.0)
                restarts.add_metric([w["worker_id"]], w["restarts"])
        yield from (up, restarts, svc_where, svc_queue)
        dec = CounterMetricFamily("spillover_admission_decisions", "admission decisions", labels=["decision", "reason"])
        for key, n in st["decision_counts"].items():
            decision, _, reason = key.partition(":")
            dec.add_metric([decision, reason], n)
        yield dec
        loops = CounterMetricFamily(
            "spillover_loop_restarts", "gateway loops restarted after a failure", labels=["loop"]
        )
        for name, n in st["loop_restarts"].items():
            loops.add_metric([name], n)
        yield loops
        if st.get("connections"):
            c = st["connections"]
            yield GaugeMetricFamily("spillover_connections_open", "client connections open", value=c["open"])
            yield CounterMetricFamily(
                "spillover_connections_refused", "connections refused past max_connections", value=c["refused"]
            )
            yield CounterMetricFamily(
                "spillover_connections_header_timeouts",
                "connections closed for not sending a request head in time",
                value=c["head_timeouts"],
            )
            yield CounterMetricFamily(
                "spillover_connections_heads_too_large",
                "connections answered 431: a request head over the listener's bound",
                value=c["heads_too_large"],
            )
            yield CounterMetricFamily(
                "spillover_connections_send_timeouts",
                "connections aborted for taking no response bytes within send_timeout_s",
                value=c["send_timeouts"],
            )
            yield CounterMetricFamily(
                "spillover_connections_not_http",
                "requests the listener could not parse as HTTP, answered 400 invalid_http",
                value=c["not_http"],
            )
        host = GaugeMetricFamily(
            "spillover_host_memory_bytes", "gateway and workers RSS, and the budget", labels=["kind"]
        )
        host.add_metric(["rss"], st["host"]["observed_rss_bytes"])
        host.add_metric(["peak_rss"], st["host"]["peak_rss_bytes"])
        host.add_metric(["budget"], st["host"]["budget_bytes"])
        yield host


class Metrics:
    """The registry plus the event counters the request path feeds."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("spillover_requests", "finished requests", ["route", "outcome", "reason"], registry=r)
        self.tokens = Counter("spillover_generated_tokens", "tokens generated", ["route"], registry=r)
        self.failovers = Counter("spillover_failovers", "GPU attempts that failed over", ["kind"], registry=r)
        self.service_ladder = Counter(
            "spillover_service_ladder_events",
            "services demoted from the GPU for interactive work, and promoted back",
            ["service", "event"],
            registry=r,
        )
        self.degraded = Counter(
            "spillover_degraded_responses", "responses served degraded (CPU or fallback)", registry=r
        )
        self.duration = Histogram(
            "spillover_request_duration_seconds", "request wall time", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "spillover_time_to_first_token_seconds",
            "time to the first token",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "spillover_queue_wait_seconds", "time queued before a slot", ["lane"], buckets=_LATENCY_BUCKETS, registry=r
        )
        r.register(_StateCollector(status))

    def request_done(self, route: str, outcome: str, reason: str, seconds: float, tokens: int) -> None:
        self.requests.labels(route, outcome, reason).inc()
        self.duration.labels(route).observe(seconds)
        if tokens:
            self.tokens.labels(route).inc(tokens)
        if route not in ("gpu", "none"):
            self.degraded.inc()

    def request_refused(self, error: SpilloverError) -> None:
        """A request refused before it was accepted (a bad or slow body, a full queue, a context
        too long, a model that cannot load; nothing journaled, no route): counted with its error
        code as the reason, not timed."""
        self.requests.labels("none", "rejected", error.code or type(error).__name__).inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
