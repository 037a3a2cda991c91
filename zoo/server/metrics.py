"""Prometheus metrics of one server (a registry per app, so several apps can live in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages",
          "/v1/messages/count_tokens")


class Metrics:
    """Counters, gauges and histograms of the server; ``render()`` is the text exposition."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("zoo_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.requests = Counter("zoo_requests", "Finished generation requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("zoo_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("zoo_generation_tokens", "Generated tokens", registry=r)
        self.queue_depth = Gauge("zoo_queue_depth", "Requests waiting for a batch row", registry=r)
        self.running = Gauge("zoo_requests_running", "Requests holding a batch row", registry=r)
        self.ttft = Histogram("zoo_time_to_first_token_seconds", "Arrival to first token (queue + prefill)",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.decode_rate = Histogram("zoo_decode_tokens_per_second", "Per-request decode speed after the "
                                     "first token", buckets=(1, 5, 10, 25, 50, 75, 100, 150, 250, 500, 1000),
                                     registry=r)
        self.drafted = Counter("zoo_spec_draft_tokens", "Speculative tokens drafted (draft_n)", registry=r)
        self.accepted = Counter("zoo_spec_accepted_tokens", "Speculative tokens accepted (draft_n_accepted)",
                                registry=r)

    def watch_prefix_cache(self, prefix) -> None:
        """Export a ``PrefixCache``'s counters and tier sizes (read at each scrape)."""
        self.registry.register(_PrefixCollector(prefix))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path if path in ROUTES else "other", str(status)).inc()


class _PrefixCollector:
    """The prefix cache's numbers as metrics (``zoo.engine.prefix_cache.PrefixStats``)."""

    def __init__(self, prefix):
        self.prefix = prefix

    def describe(self):
        return []

    def collect(self):
        st = self.prefix.stats
        for name, doc, value in (
                ("zoo_prefix_cache_hit_tokens", "Prompt tokens restored from the prefix cache", st.hit_tokens),
                ("zoo_prefix_cache_miss_tokens", "Prompt tokens prefilled by requests that looked up the cache",
                 st.miss_tokens),
                ("zoo_prefix_cache_hits", "Prefills that started from a cached prefix", st.hits),
                ("zoo_prefix_cache_demotions", "Cache entries moved from the device to host RAM", st.demoted),
                ("zoo_prefix_cache_evictions", "Cache entries dropped", st.evicted)):
            yield CounterMetricFamily(name, doc, value=value)
        tiers = GaugeMetricFamily("zoo_prefix_cache_bytes", "Bytes held by the prefix cache per tier "
                                  "(device: per chip)", labels=["tier"])
        tiers.add_metric(["device"], self.prefix.device_used)
        tiers.add_metric(["host"], self.prefix.host_used)
        yield tiers
        entries = GaugeMetricFamily("zoo_prefix_cache_entries", "Prefix cache entries by kind", labels=["kind"])
        for kind, n in self.prefix.entries.items():
            entries.add_metric([kind], n)
        yield entries


class CountRequests:
    """ASGI middleware: count each HTTP response by route and status (streaming-safe)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_http(scope["path"], status)
