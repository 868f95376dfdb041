"""Prometheus metrics of one gateway, in a registry of its own (two apps in one process never clash).

:class:`GatewayMetrics` is recorded by the gateway itself (latencies, outcomes, tokens) and read
from the backend at scrape time (queue depth, worker states, readiness). The backend receives the
narrow :class:`RuntimeMetrics` view from its factory and feeds what only it sees: KV bytes streamed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dejavu_controller.backend import Backend, FinishReason

# Buckets in seconds, spanning a fast GPU decode step (ms) up to a CPU prefill of a long prompt (s).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)


class Outcome(enum.StrEnum):
    """How a request ended, as the ``outcome`` label of ``dejavu_requests_total``."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context reached
    CANCELLED = "cancelled"  # the client went away
    FAILED = "failed"  # the runtime failed the request (5xx, or an error mid-stream)
    REJECTED = "rejected"  # a bad request (4xx other than 401)
    UNAUTHORIZED = "unauthorized"  # missing or wrong API key
    OVERLOADED = "overloaded"  # 503: queue full or not ready
    RATE_LIMITED = "rate_limited"  # 429: a limit of the request's API key


class KVStream(enum.StrEnum):
    """Why KV bytes moved, as the ``purpose`` label of ``dejavu_kv_bytes_streamed_total``."""

    PROMPT_TO_TOKEN = "prompt_to_token"  # disaggregation: prompt pipeline -> token pipeline
    REPLICATION = "replication"  # fault tolerance: token stage -> its replica
    SWAP = "swap"  # microbatch swapping between device and host memory
    RECOVERY = "recovery"  # restoring a replaced stage from a replica


class RuntimeMetrics:
    """What the backend may record. Thread-safe (prometheus-client counters are)."""

    def __init__(self, kv_bytes: Counter, recovery: Histogram) -> None:
        self._kv_bytes = kv_bytes
        self._recovery = recovery

    def observe_recovery(self, phase: str, seconds: float) -> None:
        """Record how long after a failure's detection a recovery phase ended."""
        self._recovery.labels(phase=phase).observe(seconds)

    def add_kv_bytes(self, nbytes: int, purpose: KVStream = KVStream.PROMPT_TO_TOKEN) -> None:
        """Count ``nbytes`` of KV cache streamed for ``purpose``; ``nbytes`` must be >= 0."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._kv_bytes.labels(purpose=purpose.value).inc(nbytes)


class KeyMetrics:
    """Per API key figures, labelled by key id (``auth.key_id``: never the key itself)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.admitted = Counter(
            "dejavu_key_admitted", "Requests admitted by their key's limits.", labelnames=["key"], registry=registry
        )
        self.limited = Counter(
            "dejavu_key_rate_limited",
            "Requests refused (429) by a limit of their key, by limit.",
            labelnames=["key", "limit"],
            registry=registry,
        )
        self.tokens = Counter(
            "dejavu_key_tokens",
            "Tokens of a key's finished requests (prompt + generated; what its token budget was charged).",
            labelnames=["key"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "dejavu_key_in_flight", "Requests of a key in flight now.", labelnames=["key"], registry=registry
        )


class _BackendCollector(Collector):
    """Reads the backend's readiness, queue depth and worker states at each scrape."""

    def __init__(self) -> None:
        self.backend: Backend | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backend = self.backend
        ready = GaugeMetricFamily("dejavu_backend_ready", "1 when a complete pipeline serves requests.")
        depth = GaugeMetricFamily("dejavu_queue_depth", "Requests admitted but not yet scheduled.")
        workers = GaugeMetricFamily(
            "dejavu_worker_state", "1 for each worker's current state.", labels=["worker", "state"]
        )
        kv_bytes = GaugeMetricFamily(
            "dejavu_worker_kv_bytes_held", "KV bytes a worker holds (caches and replicas).", labels=["worker"]
        )
        kv_mbs = GaugeMetricFamily(
            "dejavu_worker_kv_microbatches_held", "Microbatch caches and replicas a worker holds.", labels=["worker"]
        )
        stalled = GaugeMetricFamily(
            "dejavu_progress_stalled_seconds",
            "How long dispatched requests have had no token and no error while the pipeline is up, once past "
            "the stall limit (0 when work moves).",
        )
        if backend is not None:
            stats = backend.stats()
            ready.add_metric([], 1.0 if backend.is_ready() else 0.0)
            depth.add_metric([], float(stats.queue_depth))
            for worker, state in sorted(stats.workers.items()):
                workers.add_metric([worker, state], 1.0)
            for worker, (held_bytes, held_mbs) in sorted(stats.kv_held.items()):
                kv_bytes.add_metric([worker], float(held_bytes))
                kv_mbs.add_metric([worker], float(held_mbs))
            stalled.add_metric([], stats.stalled_s or 0.0)
        yield from (ready, depth, workers, kv_bytes, kv_mbs, stalled)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # families depend on the backend; describing none keeps registration lazy


class GatewayMetrics:
    """All metrics of one app. Build one per :func:`create_app`; not shared between apps."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "dejavu_time_to_first_token_seconds",
            "From admission to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "dejavu_inter_token_latency_seconds",
            "Between consecutive token events of one request.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "dejavu_e2e_request_latency_seconds",
            "From admission to the last token of a finished request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "dejavu_requests", "Requests by outcome.", labelnames=["outcome"], registry=self.registry
        )
        self.prompt_tokens = Counter("dejavu_prompt_tokens", "Prompt tokens admitted.", registry=self.registry)
        self.generated_tokens = Counter("dejavu_generated_tokens", "Tokens generated.", registry=self.registry)
        kv_bytes = Counter(
            "dejavu_kv_bytes_streamed",
            "KV-cache bytes streamed, by purpose (fed by the backend).",
            labelnames=["purpose"],
            registry=self.registry,
        )
        recovery = Histogram(
            "dejavu_recovery_phase_seconds",
            "Seconds from a failure's detection to the end of each recovery phase (fed by the backend).",
            labelnames=["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.runtime = RuntimeMetrics(kv_bytes, recovery)
        self.keys = KeyMetrics(self.registry)
        self._backend_collector = _BackendCollector()
        self.registry.register(self._backend_collector)

    def watch(self, backend: Backend | None) -> None:
        """Scrape ``backend``'s stats from now on (``None``: stop, e.g. at shutdown)."""
        self._backend_collector.backend = backend

    def count_finish(self, reason: FinishReason) -> None:
        self.requests.labels(outcome=_FINISH_OUTCOMES[reason].value).inc()

    def count_outcome(self, outcome: Outcome) -> None:
        self.requests.labels(outcome=outcome.value).inc()

    def count_rejection(self, status: int) -> None:
        """Count a request answered with an error ``status``."""
        self.count_outcome(_status_outcome(status))

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


_FINISH_OUTCOMES = {
    FinishReason.STOP: Outcome.STOP,
    FinishReason.LENGTH: Outcome.LENGTH,
    FinishReason.CANCELLED: Outcome.CANCELLED,
    FinishReason.ERROR: Outcome.FAILED,
    FinishReason.REFUSED: Outcome.REJECTED,
}


def _status_outcome(status: int) -> Outcome:
    if status == 401:
        return Outcome.UNAUTHORIZED
    if status == 503:
        return Outcome.OVERLOADED
    if status == 499:
        return Outcome.CANCELLED
    if status == 429:
        return Outcome.RATE_LIMITED
    return Outcome.REJECTED if status < 500 else Outcome.FAILED
