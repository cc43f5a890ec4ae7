"""Prometheus metrics: JetStream's names (so GKE autoscaling recipes work) plus slipstream_* extras.
Gauges/counters are read from each replica's `stats()` at scrape time, labelled `replica`; histograms
are fed by the schedulers' per-request listener, over all replicas (unlabelled). Each app has its
own registry: no global state."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.engine.distributed.replicas import ReplicaSet
from slipstream.engine.scheduler import RequestMetrics, Scheduler, SchedulerStats
from slipstream.kernels.native import kernel_isas, kernel_paths

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_LENGTH_BUCKETS = tuple(float(2**k) for k in range(0, 17))  # 1 .. 65536 tokens


class _StatsCollector(Collector):
    """Builds gauges/counters from one stats() snapshot per replica per scrape, so they are mutually
    consistent. Each carries a `replica` label ("0".."M-1" under data parallel, "0" otherwise, so
    queries have one shape); process-wide values (compiles, kernel paths, startup) have none."""

    def __init__(self, scheduler: Scheduler | ReplicaSet, compile_count: Callable[[], int],
                 startup: Callable[[], float | None]) -> None:
        self._scheduler = scheduler
        self._compile_count = compile_count
        self._startup = startup

    def describe(self) -> list[Metric]:
        return []  # names are only known per scrape; nothing to check for duplicates

    def collect(self) -> Iterator[Metric]:
        sched = self._scheduler
        replicas = list(enumerate(sched.replica_stats() if isinstance(sched, ReplicaSet) else [sched.stats()]))

        def gauge(name: str, doc: str, value: Callable[[SchedulerStats], float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for i, s in replicas:
                family.add_metric([str(i)], value(s))
            return family

        def counter(name: str, doc: str, value: Callable[[SchedulerStats], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["replica"])
            for i, s in replicas:
                family.add_metric([str(i)], value(s))
            return family

        yield gauge("jetstream_prefill_backlog_size", "Requests waiting to be admitted.", lambda s: s.waiting)
        yield gauge("jetstream_slots_used_percentage", "Fraction of decode slots in use (0..1).",
                    lambda s: s.slots_used / s.max_slots if s.max_slots else 0.0)
        yield counter("jetstream_request_success_count", "Requests finished with stop or length.",
                      lambda s: s.finished.get("stop", 0) + s.finished.get("length", 0))
        startup = self._startup()
        if startup is not None:
            yield GaugeMetricFamily("jetstream_server_startup_latency", "Seconds from process start to serving.",
                                    value=startup)

        yield gauge("slipstream_requests_running", "Requests admitted (prefilling or decoding).", lambda s: s.running)
        yield gauge("slipstream_requests_waiting", "Requests waiting for a slot.", lambda s: s.waiting)
        yield gauge("slipstream_kv_pages_used", "KV cache pages held by running requests (0 when idle).",
                    lambda s: s.pages_used)
        yield gauge("slipstream_kv_pages_cached", "Prefix-cache pages no running request holds (reusable, "
                    "evictable).", lambda s: s.pages_cached)
        yield gauge("slipstream_kv_pages_total", "KV cache pages available to requests.", lambda s: s.pages_total)
        yield counter("slipstream_prefix_cache_queries", "Prefix cache lookups.", lambda s: s.prefix_queries)
        yield counter("slipstream_prefix_cache_hits", "Prefix cache lookups that reused pages.",
                      lambda s: s.prefix_hits)
        yield counter("slipstream_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      lambda s: s.prefix_hit_tokens)
        yield counter("slipstream_preemptions", "Requests preempted for lack of KV pages, or for a more urgent request.",
                      lambda s: s.preemptions)
        rejections = CounterMetricFamily("slipstream_rejections", "Requests refused at submission.",
                                         labels=["replica", "reason"])
        for i, s in replicas:
            for reason in sorted({"overloaded", "too_long", *s.rejections}):
                rejections.add_metric([str(i), reason], s.rejections.get(reason, 0))
        yield rejections
        yield counter("slipstream_cancellations", "Requests cancelled (client went away).", lambda s: s.cancellations)
        yield counter("slipstream_request_errors", "Requests that finished with an error.",
                      lambda s: s.finished.get("error", 0))
        yield CounterMetricFamily("slipstream_compiles", "XLA compilations (flat in steady state).",
                                  value=self._compile_count())
        paths = GaugeMetricFamily("slipstream_kernel_path", "1 for the path each hot op runs: native (CPU "
                                  "kernel) or reference (pure JAX).", labels=["kernel", "path"])
        for kernel, path in sorted(kernel_paths().items()):
            paths.add_metric([kernel, path], 1)
        yield paths
        isas = GaugeMetricFamily("slipstream_kernel_isa", "1 for the instruction set each native CPU kernel runs "
                                 "(amx, avx512_vnni, avx512, avx2, portable), chosen at start-up for this CPU.",
                                 labels=["kernel", "isa"])
        for kernel, isa in kernel_isas().items():
            isas.add_metric([kernel, isa], 1)
        yield isas
        yield counter("slipstream_generated_tokens", "Tokens generated.", lambda s: s.generated_tokens)
        yield counter("slipstream_prompt_tokens", "Prompt tokens of admitted requests.", lambda s: s.prompt_tokens)
        yield counter("slipstream_prefilled_tokens", "Prompt tokens actually prefilled (after prefix reuse).",
                      lambda s: s.prefilled_tokens)
        yield counter("slipstream_spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
                      lambda s: s.spec_draft_tokens)
        yield counter("slipstream_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                      lambda s: s.spec_accepted_tokens)
        per_pos = CounterMetricFamily("slipstream_spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative draft tokens accepted, by position in the draft.",
                                      labels=["replica", "position"])
        for i, s in replicas:
            for pos, n in sorted(s.spec_accepted_per_pos.items(), key=lambda kv: int(kv[0])):
                per_pos.add_metric([str(i), pos], n)
        yield per_pos


# Label values are bounded: the route template (never the raw path), and codes from fixed sets.
HTTP_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
               "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
               "/v1/models/{model}", "/health", "/ready", "/metrics", "/openapi.json",
               "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/detokenize",
               "/completion", "/completions", "/infill", "/apply-template", "/props")
ERROR_CODES = frozenset({
    "invalid_value", "invalid_json", "unsupported", "context_length_exceeded", "model_not_found", "invalid_api_key",
    "request_timeout", "request_too_large", "unsupported_media_type", "overloaded", "too_many_requests",
    "client_disconnected", "shutting_down", "engine_unavailable", "engine_error", "cancelled", "internal_error",
    "not_found", "method_not_allowed", "invalid_request"})


def route_template(path: str) -> str:
    if path in HTTP_ROUTES:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{response_id}"
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class ResponseCounts:
    """Every answer of both front ends: HTTP by route, status class and error code, gRPC by method
    and status code. Owned by the Service (both front ends see it); each app's Metrics exports it."""

    def __init__(self) -> None:
        self.http = Counter("slipstream_http_responses", "HTTP responses by route template, status class "
                            "(2xx, 4xx, 5xx) and error code (none for a success).",
                            ["route", "status_class", "code"], registry=None)
        self.grpc = Counter("slipstream_grpc_responses", "gRPC calls by method and status code.",
                            ["method", "code"], registry=None)
        # Zero series up front, so that rate() and the 5xx alert see the series before the first error.
        for route in ("/v1/completions", "/v1/chat/completions"):
            self.http.labels(route, "2xx", "none")
            self.http.labels(route, "5xx", "internal_error")
        for code in ("OK", "INTERNAL"):
            self.grpc.labels("Decode", code)

    def count_http(self, path: str, status: int, code: str | None) -> None:
        code = "none" if code is None else code if code in ERROR_CODES else "other"
        self.http.labels(route_template(path), f"{status // 100}xx", code).inc()

    def count_grpc(self, method: str, code: str) -> None:
        self.grpc.labels(method, code).inc()


class Metrics:
    """One registry per app: scrape-time stats plus listener-fed histograms."""

    def __init__(self, scheduler: Scheduler | ReplicaSet, compile_count: Callable[[], int],
                 responses: ResponseCounts | None = None) -> None:
        self.registry = CollectorRegistry()
        self._startup_latency_s: float | None = None
        self.registry.register(_StatsCollector(scheduler, compile_count, lambda: self._startup_latency_s))
        self.responses = responses or ResponseCounts()
        self.registry.register(self.responses.http)
        self.registry.register(self.responses.grpc)
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
