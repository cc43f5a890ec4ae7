"""Prometheus metrics: JetStream's names (so GKE autoscaling recipes work) plus slipstream_* extras.
Gauges/counters are read from `scheduler.stats()` at scrape time; histograms are fed by the
scheduler's per-request listener. Each app has its own registry: no global state."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.scheduler import RequestMetrics, Scheduler
from kernels import kernel_paths

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_LENGTH_BUCKETS = tuple(float(2**k) for k in range(0, 17))  # 1 .. 65536 tokens


class _StatsCollector(Collector):
    """Builds gauges/counters from one stats() snapshot per scrape, so they are mutually consistent."""

    def __init__(self, scheduler: Scheduler, compile_count: Callable[[], int],
                 startup: Callable[[], float | None]) -> None:
        self._scheduler = scheduler
        self._compile_count = compile_count
        self._startup = startup

    def describe(self) -> list[Metric]:
        return []  # names are only known per scrape; nothing to check for duplicates

    def collect(self) -> Iterator[Metric]:
        s = self._scheduler.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("jetstream_prefill_backlog_size", "Requests waiting to be admitted.", s.waiting)
        yield gauge("jetstream_slots_used_percentage", "Fraction of decode slots in use (0..1).",
                    s.slots_used / s.max_slots if s.max_slots else 0.0)
        finished = s.finished
        yield counter("jetstream_request_success_count", "Requests finished with stop or length.",
                      finished.get("stop", 0) + finished.get("length", 0))
        startup = self._startup()
        if startup is not None:
            yield gauge("jetstream_server_startup_latency", "Seconds from process start to serving.", startup)

        yield gauge("slipstream_requests_running", "Requests admitted (prefilling or decoding).", s.running)
        yield gauge("slipstream_requests_waiting", "Requests waiting for a slot.", s.waiting)
        yield gauge("slipstream_kv_pages_used", "KV cache pages held by running requests (0 when idle).",
                    s.pages_used)
        yield gauge("slipstream_kv_pages_cached", "Prefix-cache pages no running request holds (reusable, "
                    "evictable).", s.pages_cached)
        yield gauge("slipstream_kv_pages_total", "KV cache pages available to requests.", s.pages_total)
        yield counter("slipstream_prefix_cache_queries", "Prefix cache lookups.", s.prefix_queries)
        yield counter("slipstream_prefix_cache_hits", "Prefix cache lookups that reused pages.", s.prefix_hits)
        yield counter("slipstream_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      s.prefix_hit_tokens)
        yield counter("slipstream_preemptions", "Requests preempted for lack of KV pages.", s.preemptions)
        rejections = CounterMetricFamily("slipstream_rejections", "Requests refused at submission.",
                                         labels=["reason"])
        for reason in sorted({"overloaded", "too_long", *s.rejections}):
            rejections.add_metric([reason], s.rejections.get(reason, 0))
        yield rejections
        yield counter("slipstream_cancellations", "Requests cancelled (client went away).", s.cancellations)
        yield counter("slipstream_request_errors", "Requests that finished with an error.", finished.get("error", 0))
        yield counter("slipstream_compiles", "XLA compilations (flat in steady state).", self._compile_count())
        paths = GaugeMetricFamily("slipstream_kernel_path", "1 for the path each hot op runs: native (CPU "
                                  "kernel) or reference (pure JAX).", labels=["kernel", "path"])
        for kernel, path in sorted(kernel_paths().items()):
            paths.add_metric([kernel, path], 1)
        yield paths
        yield counter("slipstream_generated_tokens", "Tokens generated.", s.generated_tokens)
        yield counter("slipstream_prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("slipstream_prefilled_tokens", "Prompt tokens actually prefilled (after prefix reuse).",
                      s.prefilled_tokens)


class Metrics:
    """One registry per app: scrape-time stats plus listener-fed histograms."""

    def __init__(self, scheduler: Scheduler, compile_count: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self._startup_latency_s: float | None = None
        self.registry.register(_StatsCollector(scheduler, compile_count, lambda: self._startup_latency_s))
        r = self.registry
        self.ttft = Histogram("jetstream_time_to_first_token", "Seconds from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jetstream_time_per_output_token", "Seconds per output token after the first.",
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("jetstream_queue_duration", "Seconds from arrival to admission.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.input_length = Histogram("jetstream_request_input_length", "Prompt tokens per request.",
                                      buckets=_LENGTH_BUCKETS, registry=r)
        self.output_length = Histogram("jetstream_request_output_length", "Generated tokens per request.",
                                       buckets=_LENGTH_BUCKETS, registry=r)
        scheduler.add_listener(self.observe)

    def observe(self, m: RequestMetrics) -> None:
        """Scheduler listener (output thread); prometheus_client metrics are thread-safe."""
        self.input_length.observe(m.input_length)
        self.output_length.observe(m.output_length)
        self.queue.observe(m.queue_time_s)
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        for t in m.tpot_s:
            self.tpot.observe(t)

    def set_startup_latency(self, seconds: float) -> None:
        self._startup_latency_s = seconds

    def render(self) -> bytes:
        return generate_latest(self.registry)
