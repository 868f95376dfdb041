"""Prometheus metrics of one worker, in a registry of its own, served on a port of its own.

Two kinds of figures, kept apart so the compute thread pays for nothing but a record:

- *events*, recorded where they happen with one cheap prometheus-client operation each (an observe per
  pass, an increment per preemption or message): :meth:`WorkerMetrics.observe_pass`,
  :meth:`~WorkerMetrics.count_preemption`, the data plane's :class:`DataPlaneMetrics`, the repair
  histograms;
- *state*, read only when Prometheus scrapes (on the HTTP server's thread): what the worker holds now
  (pools, microbatches, running and waiting rows, replication lag), from the :class:`StageSnapshot` the
  worker's ``snapshot`` callable returns. A figure the worker does not have (no paged pool, not stage 0,
  replication off) is left out, never reported as 0.

Every name starts with ``dejavu_``; docs/metrics.md lists them with their vLLM counterparts. The
controller's ``/metrics`` (``dejavu_controller.api.metrics``) is separate and unchanged.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dejavulib.header import Channel, Header

log = logging.getLogger("dejavu.worker.metrics")

# One stage's share of a pass: from well under a millisecond (a small GPU decode step) to a long CPU prefill.
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Tokens one pass computes: a decode step's rows up to a prefill of many long prompts.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
# A message from its submission to the transport's completion: a small activation to a whole restored cache.
SEND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# A repair: a restore of a few caches to a long wait for the controller's resume point.
REPAIR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class PassKind(enum.StrEnum):
    """What one pass computed, as the ``kind`` label of the pass histograms."""

    PREFILL = "prefill"  # prompts (a prompt stage's every pass; a token stage's colocated prefill)
    DECODE = "decode"  # one step of every member's running rows
    MIXED = "mixed"  # a decode step and a prefill in one pass
    RECOMPUTE = "recompute"  # a microbatch whose KV was discarded, recomputed with its generated tokens


class Preemption(enum.StrEnum):
    """How a stage made room in its KV pool, as the ``mode`` label of ``dejavu_preemptions_total``."""

    SWAP = "swap"  # the cache moved to host memory; it comes back when next computed
    RECOMPUTE = "recompute"  # the cache was discarded; stage 0 recomputes it before its next step


class RepairRole(enum.StrEnum):
    """This stage's part in a repair, as the ``role`` label of ``dejavu_repair_seconds``."""

    REPLACEMENT = "replacement"  # it took over a failed stage and restored its caches
    SURVIVOR = "survivor"  # it kept its stage, sent restores and reported its progress


@dataclass(frozen=True)
class PoolUsage:
    """Blocks of one paged KV pool: taken now, and the most it may hold."""

    used: int
    capacity: int

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def ratio(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


@dataclass(frozen=True)
class Occupancy:
    """Stage 0 of the token pipeline: rows (requests) and microbatches computed by the passes (running), and
    admitted to this stage but in no cohort yet (waiting)."""

    running_rows: int
    running_microbatches: int
    waiting_rows: int
    waiting_microbatches: int


@dataclass(frozen=True)
class PrefixCacheStats:
    """A paged pool's prefix cache: prompt tokens looked up and found (counters), blocks shared by several
    requests and free blocks still holding a cached prefix (gauges)."""

    query_tokens: int
    hit_tokens: int
    shared_blocks: int
    cached_free_blocks: int


@dataclass(frozen=True)
class StageSnapshot:
    """What a worker holds at one scrape. ``None`` (or an empty ``pools``): the worker has no such figure."""

    stage: int | None = None  # the stage this worker serves (None: none)
    epoch: int = 0  # the topology epoch it serves
    microbatches: int | None = None  # microbatch caches on this stage
    occupancy: Occupancy | None = None
    pools: dict[str, PoolUsage] = field(default_factory=dict)  # 'stage' (its own KV), 'replica' (its predecessor's)
    host_bytes: int | None = None  # preempted caches' host copies (a paged pool)
    replicas: int | None = None  # microbatches of the predecessor replicated here
    replication_lag_steps: int | None = None  # the largest gap to the successor's watermark, in steps
    swap: dict[str, float] | None = None  # SwapStats' fields (swapping on)
    prefix_cache: PrefixCacheStats | None = None  # a request-scheduled stage's prefix cache


def _no_snapshot() -> StageSnapshot:
    return StageSnapshot()


class DataPlaneMetrics:
    """Messages this worker's data plane sent, received and dropped, per peer and channel.

    :meth:`settled` runs on the thread that settles a send (the streamer's or the transport's);
    :meth:`received` and :meth:`corrupt` on the receiving thread. Thread-safe (prometheus-client's own locks).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["peer", "channel"]
        self.sent_bytes = Counter(
            "dejavu_dataplane_sent_bytes", "Payload bytes sent, by peer and channel.", labels, registry=registry
        )
        self.send_failures = Counter(
            "dejavu_dataplane_send_failures",
            "Messages whose send failed or passed its deadline, by peer and channel.",
            labels,
            registry=registry,
        )
        self.send_seconds = Histogram(
            "dejavu_dataplane_send_seconds",
            "Seconds from a message's submission to the transport's completion of its send (queueing, packing "
            "and transfer), by peer and channel.",
            labels,
            buckets=SEND_BUCKETS,
            registry=registry,
        )
        self.received_bytes = Counter(
            "dejavu_dataplane_received_bytes",
            "Payload bytes received and verified, by sending peer and channel.",
            labels,
            registry=registry,
        )
        self.corrupt_payloads = Counter(
            "dejavu_dataplane_corrupt_payloads",
            "Received payloads dropped because they failed their size or MAC check, by channel.",
            ["channel"],
            registry=registry,
        )
        self.replication_lag_bytes = Gauge(
            "dejavu_replication_lag_bytes",
            "KV replica bytes this stage submitted to its successor whose send has not completed yet.",
            registry=registry,
        )

    def submitted_replica(self, nbytes: int) -> None:
        """``nbytes`` of KV replica were queued for the successor (settled by :meth:`settled`)."""
        self.replication_lag_bytes.inc(nbytes)

    def settled(self, peer: str, header: Header, nbytes: int, seconds: float, error: BaseException | None) -> None:
        """One sent message settled ``seconds`` after its submission (``error``: it failed); the streamer's hook."""
        channel = header.channel.name
        if header.channel is Channel.KV_REPLICA:
            self.replication_lag_bytes.dec(nbytes)
        if error is None:
            self.sent_bytes.labels(peer, channel).inc(nbytes)
            self.send_seconds.labels(peer, channel).observe(seconds)
        else:
            self.send_failures.labels(peer, channel).inc()

    def received(self, header: Header) -> None:
        """A verified message arrived."""
        self.received_bytes.labels(header.sender, header.channel.name).inc(header.nbytes)

    def corrupt(self, channel: Channel) -> None:
        self.corrupt_payloads.labels(channel.name).inc()


class WorkerMetrics:
    """Every metric of one worker. Build one per worker (tests run several in one process); no I/O until
    :meth:`serve`."""

    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        self.role = role
        self.registry = CollectorRegistry()
        self.pass_seconds = Histogram(
            "dejavu_stage_pass_seconds",
            "Seconds this stage took for one pass: its layers, and handing the result on (sampling and publishing "
            "the tokens on the last token stage), by kind.",
            ["kind"],
            buckets=PASS_BUCKETS,
            registry=self.registry,
        )
        self.pass_tokens = Histogram(
            "dejavu_stage_pass_tokens",
            "Tokens one pass computed on this stage (a decode step: its rows; a prefill: its prompt tokens), by kind.",
            ["kind"],
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        # Children bound once: a pass records with two observes, no label lookup.
        self._pass = {k: (self.pass_seconds.labels(k.value), self.pass_tokens.labels(k.value)) for k in PassKind}
        preemptions = Counter(
            "dejavu_preemptions",
            "Caches this stage moved out of its KV pool to make room, by mode: 'swap' (to host memory) or "
            "'recompute' (discarded, recomputed by stage 0).",
            ["mode"],
            registry=self.registry,
        )
        self._preemptions = {m: preemptions.labels(m.value) for m in Preemption}
        self.restore_seconds = Histogram(
            "dejavu_restore_seconds",
            "Seconds a replacement took to receive and place the caches of the stage it took over.",
            buckets=REPAIR_BUCKETS,
            registry=self.registry,
        )
        self.repair_seconds = Histogram(
            "dejavu_repair_seconds",
            "Seconds this stage spent in a repair (restores, progress report, waiting for the resume point), "
            "by its role in it.",
            ["role"],
            buckets=REPAIR_BUCKETS,
            registry=self.registry,
        )
        self.repairs = Counter(
            "dejavu_repairs",
            "Repairs this stage took part in, by outcome ('ok' or 'failed').",
            ["outcome"],
            registry=self.registry,
        )
        self.dataplane = DataPlaneMetrics(self.registry)
        self._state = _StateCollector(self)
        self.registry.register(self._state)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- events (any thread) ------------------------------------------------------------------------
    def observe_pass(self, kind: PassKind, seconds: float, tokens: int) -> None:
        """One pass of ``kind`` took this stage ``seconds`` and computed ``tokens`` tokens."""
        duration, count = self._pass[kind]
        duration.observe(seconds)
        count.observe(tokens)

    def count_preemption(self, mode: Preemption) -> None:
        self._preemptions[mode].inc()

    def observe_repair(self, role: RepairRole, seconds: float, ok: bool) -> None:
        """A repair ended after ``seconds``: completed (``ok``), or failed (its microbatches dropped or re-run)."""
        if ok:
            self.repair_seconds.labels(role.value).observe(seconds)
        self.repairs.labels("ok" if ok else "failed").inc()

    # -- state (scrape time) ------------------------------------------------------------------------
    def watch(self, snapshot: Callable[[], StageSnapshot], dataplane_stats: Callable[[], dict[str, int]]) -> None:
        """Read the worker's state through ``snapshot`` and its data plane's drop counts through
        ``dataplane_stats`` at each scrape (both called on the scraping thread)."""
        self._state.snapshot = snapshot
        self._state.dataplane_stats = dataplane_stats

    # -- exposition ---------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Serve ``GET /metrics`` on ``host:port`` (0: any free port) from a daemon thread; returns the port.
        Raises ``OSError`` when the port cannot be bound (the worker does not start: a scraper would find
        nothing)."""
        self._server, self._thread = start_http_server(port, host, self.registry)
        bound = int(self._server.server_port)
        log.info("metrics of %s at http://%s:%d/metrics", self.worker_id, host, bound)
        return bound

    def close(self) -> None:
        """Stop serving (safe when :meth:`serve` never ran)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def metrics_url(bind_host: str, advertised_host: str, port: int) -> str:
    """The URL a scraper reaches ``GET /metrics`` at: the bind address, or ``advertised_host`` (the worker's
    data-plane address) when bound to a wildcard."""
    host = bind_host
    try:
        if ipaddress.ip_address(bind_host).is_unspecified:
            host = advertised_host
    except ValueError:
        pass  # a host name: scrapers resolve it
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}/metrics"


class _StateCollector(Collector):
    """The scrape-time families: the worker's identity, its :class:`StageSnapshot`, its data plane's drops."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.snapshot: Callable[[], StageSnapshot] = _no_snapshot
        self.dataplane_stats: Callable[[], dict[str, int]] = dict

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the worker's state; describing none keeps registration lazy

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        info = GaugeMetricFamily(
            "dejavu_worker_info", "1, labelled with this worker's id and role.", labels=["worker", "role"]
        )
        info.add_metric([m.worker_id, m.role], 1.0)
        yield info
        snap = self.snapshot()
        yield GaugeMetricFamily(
            "dejavu_stage_index",
            "The stage this worker serves (-1: none).",
            value=-1 if snap.stage is None else snap.stage,
        )
        yield GaugeMetricFamily("dejavu_stage_epoch", "The topology epoch this worker serves.", value=snap.epoch)
        yield from _stage_families(snap)
        rejected = CounterMetricFamily(
            "dejavu_dataplane_rejected_messages",
            "Messages the data plane refused before delivery (bad sender, stale epoch, too large, backlog full, "
            "replayed; payloads failing their MAC are dejavu_dataplane_corrupt_payloads), by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(self.dataplane_stats().items()):
            if reason.startswith("rejected_") or reason == "dropped_in_transfer":
                rejected.add_metric([reason.removeprefix("rejected_")], float(n))
        yield rejected


def _stage_families(snap: StageSnapshot) -> Iterator[Metric]:
    if snap.microbatches is not None:
        yield GaugeMetricFamily(
            "dejavu_stage_microbatches", "Microbatch caches this stage holds.", value=snap.microbatches
        )
    occ = snap.occupancy
    if occ is not None:
        yield GaugeMetricFamily(
            "dejavu_stage_running_rows", "Rows (requests) stage 0's passes compute now.", value=occ.running_rows
        )
        yield GaugeMetricFamily(
            "dejavu_stage_running_microbatches", "Microbatches in stage 0's cohorts.", value=occ.running_microbatches
        )
        yield GaugeMetricFamily(
            "dejavu_stage_waiting_rows",
            "Rows (requests) admitted to stage 0, in no cohort yet.",
            value=occ.waiting_rows,
        )
        yield GaugeMetricFamily(
            "dejavu_stage_waiting_microbatches",
            "Microbatches admitted to stage 0, in no cohort yet (KV still arriving, or no room).",
            value=occ.waiting_microbatches,
        )
    if snap.pools:
        families = {
            "used": GaugeMetricFamily("dejavu_kv_pool_used_blocks", "KV blocks taken, by pool.", labels=["pool"]),
            "free": GaugeMetricFamily(
                "dejavu_kv_pool_free_blocks", "KV blocks that can still be taken, by pool.", labels=["pool"]
            ),
            "capacity": GaugeMetricFamily(
                "dejavu_kv_pool_capacity_blocks", "KV blocks the pool may hold, by pool.", labels=["pool"]
            ),
            "ratio": GaugeMetricFamily(
                "dejavu_kv_pool_usage_ratio", "Used / capacity blocks (0..1), by pool.", labels=["pool"]
            ),
        }
        for pool, usage in sorted(snap.pools.items()):
            families["used"].add_metric([pool], usage.used)
            families["free"].add_metric([pool], usage.free)
            families["capacity"].add_metric([pool], usage.capacity)
            families["ratio"].add_metric([pool], usage.ratio)
        yield from families.values()
    if snap.host_bytes is not None:
        yield GaugeMetricFamily(
            "dejavu_kv_host_bytes",
            "Bytes of the host copies of caches preempted out of the KV pool.",
            value=snap.host_bytes,
        )
    if snap.replicas is not None:
        yield GaugeMetricFamily(
            "dejavu_replica_microbatches", "Microbatches of the predecessor replicated here.", value=snap.replicas
        )
    if snap.replication_lag_steps is not None:
        yield GaugeMetricFamily(
            "dejavu_replication_lag_steps",
            "Largest gap, over the microbatches this stage holds, between the step its cache holds and the step "
            "its successor's replica holds (the watermark); a microbatch without a replica counts from step -1.",
            value=snap.replication_lag_steps,
        )
    cache = snap.prefix_cache
    if cache is not None:
        yield CounterMetricFamily(
            "dejavu_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache (every admission of a request).",
            value=cache.query_tokens,
        )
        yield CounterMetricFamily(
            "dejavu_prefix_cache_hits_tokens",
            "Of the prompt tokens looked up, those found cached (not computed again).",
            value=cache.hit_tokens,
        )
        yield GaugeMetricFamily(
            "dejavu_prefix_cache_shared_blocks",
            "KV blocks referenced by more than one request.",
            value=cache.shared_blocks,
        )
        yield GaugeMetricFamily(
            "dejavu_prefix_cache_cached_free_blocks",
            "Free KV blocks that still hold a cached prefix (evicted least recently used first when taken).",
            value=cache.cached_free_blocks,
        )
    if snap.swap is not None:
        swapped = CounterMetricFamily(
            "dejavu_swap_bytes", "Bytes swapped between device and host memory, by direction.", labels=["direction"]
        )
        swapped.add_metric(["in"], snap.swap["swap_in_bytes"])
        swapped.add_metric(["out"], snap.swap["swap_out_bytes"])
        yield swapped
        swaps = CounterMetricFamily("dejavu_swaps", "Caches swapped, by direction.", labels=["direction"])
        swaps.add_metric(["in"], snap.swap["swap_ins"])
        swaps.add_metric(["out"], snap.swap["swap_outs"])
        yield swaps
        yield CounterMetricFamily(
            "dejavu_swap_wait_seconds", "Compute time lost waiting for swap-ins.", value=snap.swap["acquire_wait_s"]
        )
