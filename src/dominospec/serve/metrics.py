"""Prometheus metrics of one server: its own registry, so several apps in one process never collide.

Counters and histograms are updated by the request handlers; the engine's state (queue depth,
active rows, tau, acceptance by position) is read from `Engine.stats()` when /metrics is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dominospec"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class EngineCollector:
    """Engine gauges, read at scrape time."""

    def __init__(self, engine, gate):
        self.engine, self.gate = engine, gate

    def collect(self):
        stats = {"max_queue": getattr(self.engine, "max_queue", None), **self.engine.stats()}
        for name, key, doc in (
            ("queue_depth", "queue_depth", "requests waiting for a slot"),
            ("active_rows", "active_rows", "requests decoding in the batch"),
            ("max_batch", "max_batch", "slots in the batch"),
            ("max_queue", "max_queue", "requests that may wait for a slot (beyond: 429)"),
            ("tau", "tau", "mean tokens committed per speculative cycle (0 for plain decoding)"),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(stats.get(key) or 0.0))
        accept = GaugeMetricFamily(
            f"{PREFIX}_acceptance_by_position",
            "fraction of cycles whose draft was accepted at least up to this position",
            labels=["position"],
        )
        for pos, rate in enumerate(stats.get("accept_by_position") or [], start=1):
            accept.add_metric([str(pos)], float(rate))
        yield accept
        # running totals: their rates over a window give the verify budget per request-cycle lately
        for name, key, doc in (
            ("spec_cycles", "cycles", "speculative cycles run, one per request row per engine step"),
            ("drafts_verified", "drafts_verified", "drafts the target checked, over all cycles"),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(stats.get(key) or 0))
        yield GaugeMetricFamily(f"{PREFIX}_http_in_flight", "generation requests being served", value=self.gate.active)
        yield GaugeMetricFamily(f"{PREFIX}_draining", "1 after SIGTERM, until exit", value=float(self.gate.draining))


class ServerMetrics:
    def __init__(self, engine, gate):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.finished = Counter(
            f"{PREFIX}_generations",
            "generation requests by how they ended (stop, length, cancelled, disconnected, timeout, error)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "tokens generated and returned", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "request arrival to its first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "per request: (last token time - first token time) / (tokens - 1)",
            buckets=TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "request arrival to its last byte",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (Linux)
        r.register(EngineCollector(engine, gate))

    def render(self) -> bytes:
        return generate_latest(self.registry)
