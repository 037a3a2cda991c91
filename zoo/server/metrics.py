"""Prometheus metrics of one server (a registry per app, so several apps can live in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/responses")
DRAFT_SOURCES = ("mtp", "lookup")


def route_label(path: str) -> str:
    """The route a request path counts under: a known route, "/v1/responses/{id}" for a stored
    response, else "other"."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


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
        self.draft_tried = Counter("zoo_spec_position_drafts", "Draft tokens the verify reached, by source "
                                   "(mtp, lookup) and position (1-based)", ["source", "position"], registry=r)
        self.draft_accepted = Counter("zoo_spec_position_accepted", "Draft tokens accepted, by source and "
                                      "position (acceptance at a position: this over zoo_spec_position_drafts)",
                                      ["source", "position"], registry=r)
        self.draft_length = Histogram("zoo_spec_draft_length", "Draft tokens a row proposed per decode step "
                                      "(the speculation policy's choice; 0: it drafted none)",
                                      buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16), registry=r)
        self.inter_token = Histogram("zoo_inter_token_latency_seconds", "Seconds between consecutive token "
                                     "deliveries of a request (a speculative step delivers several at once)",
                                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                     registry=r)

    def watch_prefix_cache(self, prefix) -> None:
        """Export a ``PrefixCache``'s counters and tier sizes (read at each scrape)."""
        self.registry.register(_PrefixCollector(prefix))

    def watch_engine(self, generator) -> None:
        """Export a ``Generator``'s step counters (read at each scrape)."""
        self.registry.register(_EngineCollector(generator))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_http(self, path: str, status: int) -> None:
        self.http_requests.labels(route_label(path), str(status)).inc()

    def count_speculation(self, stats: dict) -> None:
        """A finished request's ``stats["spec"]`` (``SpecPolicy.observe``): drafts reached and accepted
        by source and position, and its steps' draft lengths."""
        spec = stats.get("spec") or {}
        for source in DRAFT_SOURCES:
            by = spec.get(source)
            for i, (tried, accepted) in enumerate(zip(by["tried"], by["accepted"]) if by else ()):
                if tried:
                    self.draft_tried.labels(source, str(i + 1)).inc(tried)
                if accepted:
                    self.draft_accepted.labels(source, str(i + 1)).inc(accepted)
        for length, steps in (spec.get("lengths") or {}).items():
            for _ in range(steps):
                self.draft_length.observe(int(length))


class _EngineCollector:
    """The engine's step counters as metrics (``Generator.steps``, ``narrow_steps``, ``moved_rows``,
    ``prefills``, ``prefill_tokens``)."""

    def __init__(self, generator):
        self.generator = generator

    def describe(self):
        return []

    def collect(self):
        g = self.generator
        steps = CounterMetricFamily("zoo_engine_decode_steps", "Decode steps run, by the rows their program "
                                    "computes (narrow: the first --narrow-rows rows only)", labels=["rows"])
        steps.add_metric(["all"], g.steps - g.narrow_steps)
        steps.add_metric(["narrow"], g.narrow_steps)
        yield steps
        for name, doc, value in (
                ("zoo_engine_rows_moved", "Requests moved into a free row below --narrow-rows (row compaction)",
                 g.moved_rows),
                ("zoo_engine_prefills", "Prompts prefilled (a request's choices share one)", g.prefills),
                ("zoo_engine_prefill_tokens", "Prefill piece widths run, padding included", g.prefill_tokens)):
            yield CounterMetricFamily(name, doc, value=value)


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
