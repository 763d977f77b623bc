"""Prometheus metrics over HTTP (``--metrics-port``), named as vLLM names them with the
``kvserve:`` prefix so that dashboards built for vLLM map over.

Two sources, one registry per server:

- the engine's state (running, waiting, KV cache use, prefix cache, the state cache of
  linear-attention hybrids, preemptions, token and request counters) is read at scrape time
  from the same snapshot the ``Stats`` RPC returns (``AsyncEngine.stats()``: the engine-core
  process's counters plus the front-end's admission fields), so /metrics and Stats agree and
  the metrics cover the core process too;
- per-request timings, outcomes by finish reason and gRPC status counts are observed by the
  front-end as each call's outputs go out (service/telemetry/calls.py).

Every series has a ``model_name`` label. The ``kvserve:tenant_*`` series have a ``tenant`` label too:
a short form of the hashed identity the server knows a tenant by, never its credential, and at most
``MAX_TENANT_LABELS`` of them plus ``other`` (engine/tenancy/accounts.py; docs/serving/tenants.md).

The gauges endpoint pickers read (the Gateway API Inference Extension's model-server protocol)
are also exported under vLLM's own names (``VLLM_PREFIX``), so a picker configured for vLLM
needs no engine config: ``vllm:num_requests_waiting`` (the scheduler's queue plus the admission
queue: every request admitted and not yet running), ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (0-1, as vLLM's) and ``vllm:cache_config_info`` (value 1, labels
``block_size`` and ``num_gpu_blocks``: the KV blocks, on any device).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.engine.frontend.engine_state import ServerStats
from kvserve.service.methods import split_method
from kvserve.service.telemetry.metrics_http import MetricsHttpServer

log = logging.getLogger("kvserve.service.telemetry.metrics")

PREFIX = "kvserve:"
VLLM_PREFIX = "vllm:"
SNAPSHOT_TIMEOUT_S = 5.0  # a scrape waits this long for the engine's snapshot at most
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

# (metric name without prefix, ServerStats field, help) of the engine snapshot's gauges and counters
SNAPSHOT_GAUGES = (
    ("num_requests_running", "num_running", "Requests being generated (in the running batch)."),
    ("num_requests_waiting", "num_waiting", "Requests in the scheduler's waiting queue."),
    ("num_requests_queued", "num_queued", "Requests admitted, not yet handed to the scheduler."),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Share of prompt tokens found in the prefix cache."),
    ("spec_decode_acceptance_rate", "spec_decode_acceptance_rate",
     "Speculative decoding: share of verified draft tokens that were accepted."),
    ("spec_decode_mean_accepted_length", "spec_decode_mean_accepted_length",
     "Speculative decoding: tokens per verification step of a sequence, the sampled one included."),
    # linear-attention hybrids' state cache (engine/runner/state_cache.py); zero for other models
    ("state_slots", "state_slots_total", "Slots of the linear-attention layers' per-sequence state."),
    ("state_slots_free", "state_slots_free", "State slots not held by any sequence."),
    ("state_snapshots", "state_snapshots_total", "Rows for prefix caching's state snapshots."),
    ("state_snapshots_cached", "state_snapshots_cached", "State snapshot rows holding a cached state."),
    ("state_cache_bytes", "state_cache_bytes", "Bytes of the state cache (slots and snapshots)."),
)
SNAPSHOT_COUNTERS = (
    ("num_preemptions", "num_preemptions", "Running requests preempted to free KV cache blocks."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens of all requests (prefill)."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("request_aborted", "requests_aborted", "Requests aborted (cancel, deadline, drain)."),
    ("request_rejected", "requests_rejected", "Requests refused because the admission queue was full."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts",
     "Speculative decoding: verification steps with drafts."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
     "Speculative decoding: draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens accepted."),
    ("state_snapshot_hits", "state_snapshot_hits", "Admissions that resumed from a state snapshot."),
)


# (metric name without prefix, TenantStats field, help) of the per-tenant series
TENANT_GAUGES = (
    ("tenant_num_sequences_running", "running", "A tenant's sequences (choices) running now."),
    ("tenant_num_sequences_waiting", "waiting", "A tenant's sequences in the scheduler's waiting queue."),
)
TENANT_COUNTERS = (
    ("tenant_prompt_tokens", "prompt_tokens", "Prompt tokens of a tenant's requests."),
    ("tenant_generation_tokens", "generation_tokens", "Tokens generated for a tenant."),
)


def metric_name(name: str) -> str:
    return PREFIX + name


class Metrics:
    """The server's registry: the engine snapshot's series plus what the front-end observes.

    ``snapshot()`` returns the ``ServerStats``, or None while there is none (loading, dead);
    ``core_pid()`` the engine-core process's pid (None: no series for it)."""

    def __init__(self, model_name: str, snapshot: Callable[[], ServerStats | None],
                 core_pid: Callable[[], int | None] = lambda: None):
        disable_created_metrics()  # no *_created series: vLLM's dashboards do not use them
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(metric_name(name), doc, labels, buckets=buckets, registry=reg)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from the call's arrival to the first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two tokens of a request, as sent.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from the call's arrival to its last token.", REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from the call's arrival to its first step.", REQUEST_BUCKETS)
        self.request_success = Counter(
            metric_name("request_success"), "Requests that finished, by finish reason.",
            [*labels, "finished_reason"], registry=reg)
        self.grpc_handled = Counter(
            metric_name("grpc_server_handled"), "gRPC calls completed, by method and status code.",
            [*labels, "grpc_service", "grpc_method", "grpc_code"], registry=reg)
        reg.register(SnapshotCollector(model_name, snapshot))
        ProcessCollector(registry=reg)  # process_*: the front-end
        ProcessCollector(namespace="kvserve_engine_core", pid=core_pid, registry=reg)  # its CPU, memory

    # each histogram's series of the model is made at its first observation (no empty series
    # before a request)
    def observe_request(self, queue_s: float, ttft_s: float | None, e2e_s: float, finish_reason: str) -> None:
        self.request_queue_time.labels(self.model_name).observe(queue_s)
        if ttft_s is not None:
            self.time_to_first_token.labels(self.model_name).observe(ttft_s)
        self.e2e_request_latency.labels(self.model_name).observe(e2e_s)
        self.request_success.labels(self.model_name, finish_reason.lower()).inc()

    def observe_token_gap(self, seconds: float, tokens: int) -> None:
        """One output carried ``tokens`` tokens, ``seconds`` after the previous one: each token
        counts as one gap of ``seconds / tokens`` (every token but a request's first is one gap)."""
        child = self.inter_token_latency.labels(self.model_name)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def count_call(self, method: str, code: str) -> None:
        service, name = split_method(method)
        self.grpc_handled.labels(self.model_name, service, name, code).inc()


class SnapshotCollector(Collector):
    """The engine snapshot's series, read fresh at every scrape."""

    def __init__(self, model_name: str, snapshot: Callable[[], ServerStats | None]):
        self._model = model_name
        self._snapshot = snapshot

    def collect(self):
        stats = self._snapshot()
        if stats is None:
            return
        for name, key, doc in SNAPSHOT_GAUGES:
            yield self._family(GaugeMetricFamily, name, doc, getattr(stats, key))
        total = stats.kv_blocks_total
        usage = 1.0 - stats.kv_blocks_free / total if total else 0.0
        yield self._family(GaugeMetricFamily, "kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).",
                           usage)
        for name, key, doc in SNAPSHOT_COUNTERS:
            yield self._family(CounterMetricFamily, name, doc, getattr(stats, key))
        yield from self._tenants(stats)
        yield from self._vllm_aliases(stats, usage)

    def _tenants(self, stats: ServerStats):
        """The per-tenant series (none on a server that has served no request yet)."""
        if not stats.tenants:
            return
        labels = ["model_name", "tenant"]
        for kind, series in ((GaugeMetricFamily, TENANT_GAUGES), (CounterMetricFamily, TENANT_COUNTERS)):
            for name, key, doc in series:
                family = kind(PREFIX + name, doc, labels=labels)
                for t in stats.tenants:
                    family.add_metric([self._model, t.tenant], getattr(t, key))
                yield family
        refused = CounterMetricFamily(PREFIX + "tenant_requests_refused", "A tenant's requests refused at "
                                      "once, by reason (max_queued_per_tenant, deadline).",
                                      labels=[*labels, "reason"])
        for t in stats.tenants:
            for reason, count in sorted(t.refused.items()):
                refused.add_metric([self._model, t.tenant, reason], count)
        yield refused

    def _vllm_aliases(self, stats: ServerStats, usage: float):
        alias = VLLM_PREFIX
        gauge = GaugeMetricFamily
        yield self._family(gauge, "num_requests_waiting", "Requests admitted, not yet running (vLLM's name).",
                           stats.num_waiting + stats.num_queued, alias)
        yield self._family(gauge, "num_requests_running", "Requests being generated (vLLM's name).",
                           stats.num_running, alias)
        yield self._family(gauge, "kv_cache_usage_perc", "KV-cache usage, 1 = full (vLLM's name).", usage,
                           alias)
        info = GaugeMetricFamily(alias + "cache_config_info", "KV cache configuration (vLLM's name).",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self._model, str(stats.kv_block_size), str(stats.kv_blocks_total)], 1.0)
        yield info

    def _family(self, kind, name: str, doc: str, value: float, prefix: str = PREFIX):
        family = kind(prefix + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


def snapshot_from_thread(
    stats: Callable[[], object], loop: asyncio.AbstractEventLoop
) -> Callable[[], ServerStats | None]:
    """A snapshot function for the scrape thread: runs the coroutine ``stats()`` on the server's
    event loop and waits for it; None when the engine has none to give (loading, dead)."""

    def snapshot() -> dict | None:
        try:
            return asyncio.run_coroutine_threadsafe(stats(), loop).result(SNAPSHOT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a scrape without engine series, not a failed scrape
            log.debug("no engine snapshot for /metrics: %s", e)
            return None

    return snapshot


class MetricsServer:
    """/metrics over HTTP on a thread of its own (service/telemetry/metrics_http.py: bounded
    connections, read timeouts, one rendering shared by concurrent scrapes)."""

    def __init__(self, metrics: Metrics, host: str, port: int):
        try:
            self._server = MetricsHttpServer(metrics.registry, host, port)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port}: {e}") from e
        self.port: int = self._server.port

    def stop(self) -> None:
        self._server.stop()
