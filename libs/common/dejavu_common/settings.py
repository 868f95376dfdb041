"""The one settings root of DejaVu.

Every process builds one :class:`Settings` (from ``DEJAVU_*`` environment variables, an optional
``.env``-style file named by ``DEJAVU_SETTINGS_FILE``, or keyword arguments) and hands each
component only the sub-model it needs. Building settings does no I/O beyond reading the
environment and that file: nothing connects, nothing loads a model.

Nested fields use ``__`` in environment variables, e.g. ``DEJAVU_REDIS__URL`` or
``DEJAVU_CONTROLLER__PORT``.
"""

from __future__ import annotations

import enum
import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Public, for single-host development only: dejavu_common.exposure refuses it on any other address.
DEV_DATA_PLANE_SECRET = "dejavu-dev-secret"


def default_cache_dir() -> Path:
    """Where prepared model checkpoints and other derived artefacts are cached."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dejavu"


class RedisSettings(BaseModel):
    """How services reach the Redis control plane."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis://[user:pass@]host:port/db).")
    username: str | None = Field(None, description="ACL user name; overrides the one in the URL.")
    password: SecretStr | None = Field(None, description="ACL password; overrides the one in the URL.")
    password_file: Path | None = Field(
        None, description="File holding the ACL password (read when a client is made); overrides `password`."
    )
    socket_timeout_s: float = Field(5.0, gt=0, le=120, description="Deadline of one Redis command.")
    connect_timeout_s: float = Field(3.0, gt=0, le=120, description="Deadline of one connection attempt.")
    retries: int = Field(3, ge=0, le=20, description="Retries (exponential backoff) for retryable Redis errors.")


class ModelSettings(BaseModel):
    """Which checkpoint to serve and how to hold it."""

    path: Path | None = Field(
        None, description="Local Hugging Face checkpoint folder; default: the prepared SmolLM2 checkpoint."
    )
    name: str = Field("SmolLM2-135M-Instruct", description="Model id reported by the API.")
    dtype: str = Field("float32", pattern="^(float32|float16|bfloat16)$", description="Weights and KV dtype.")
    device: str = Field("cpu", description="torch device of stage weights and KV caches ('cpu', 'cuda', 'cuda:1').")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Cache of prepared checkpoints.")
    weights: str = Field(
        "float",
        pattern="^(float|int8|gguf)$",
        description="How the prepared default model holds its weights: 'float' (dequantized to float32 "
        "safetensors, computed in `dtype`), 'int8' (int8 per output channel), 'gguf' (the published GGUF file, "
        "kept quantized). Quantized weights compute in float32 on CPU. A `path` folder is served in its own format.",
    )
    source_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="Weight source (`dejavu model serve`) a worker fetches its stage's share of the checkpoint "
        "from at load (only its layers' tensors, as stored), into `cache_dir`/remote, reused on restart. None: "
        "the worker reads `path` (or the prepared default model) from its own disk.",
    )
    source_token: SecretStr | None = Field(
        None, description="Bearer token of the weight source: what workers send and `dejavu model serve` requires."
    )
    source_deadline_s: float = Field(
        30.0, gt=0, le=3600, description="Deadline of one request to the weight source, its whole answer included."
    )
    source_retries: int = Field(
        3, ge=0, le=20, description="Retries (with backoff) of a weight-source request that failed or answered wrongly."
    )

    @property
    def folder(self) -> Path:
        """The checkpoint folder to serve: ``path``, or the prepared default model in the cache (one folder per
        ``weights`` format)."""
        if self.path is not None:
            return self.path
        return self.cache_dir / (self.name if self.weights == "float" else f"{self.name}-{self.weights}")


class EngineSettings(BaseModel):
    """Per-process execution knobs of the stage engine."""

    torch_threads: int = Field(0, ge=0, le=1024, description="torch intra-op threads; 0 = cores / local workers.")
    cpu_affinity: list[int] | None = Field(
        None,
        description="CPU cores this process runs on (os.sched_setaffinity); None: all. The launcher can pin workers.",
    )
    preload_allocator: bool = Field(
        True,
        description="The launcher preloads tcmalloc (Debian: libtcmalloc-minimal4) into the workers it starts, "
        "where installed.",
    )
    preload_openmp: bool = Field(
        True,
        description="The launcher preloads Intel OpenMP (PyPI: intel-openmp) into the workers it starts, where "
        "installed, in place of GNU OpenMP.",
    )
    openmp_bind: bool = Field(
        False,
        description="Bind each OpenMP thread to one core of the worker's CPU set; for workers with cores of their "
        "own (`dejavu up --pin-cpus` turns it on).",
    )
    openmp_blocktime_ms: int = Field(
        1,
        ge=0,
        le=1000,
        description="How long an idle Intel OpenMP thread spins before it sleeps (KMP_BLOCKTIME): short, since "
        "workers often share a host's cores.",
    )
    packed_gemm: str = Field(
        "auto",
        pattern="^(auto|on|off)$",
        description="Multiply by oneDNN-packed copies of the weights (reordered once at load) where the host "
        "can (CPU, float32): 'auto' on token stages (decode steps 1.3-1.9x faster on the reference host) but "
        "not prompt stages (whole-prompt GEMMs ~5-9% slower packed), 'on' everywhere, 'off' nowhere "
        "(torch's default GEMM on the dense weights).",
    )

    native_attention: bool = Field(
        True,
        description="Decode attention of every row of a pass in one call of the native CPU kernel "
        "(dejavu_engine.native, compiled for the host by `make setup` or on first use) where the host can "
        "(CPU, float32, a C++ compiler): one call per layer whatever the number of microbatches, instead of "
        "one torch attention call per microbatch. Off, or where the kernel cannot be built: torch's attention.",
    )

    ragged_prefill: bool = Field(
        True,
        description="Prefill of a batch of prompts of different lengths runs their tokens only, back to back "
        "(each attending over its own), instead of every row padded to the longest. Off: the padded batch.",
    )

    mixed_passes: bool = Field(
        True,
        description="Microbatch cohorts on a colocated one-stage pipeline (request scheduling off) prefill arriving "
        "prompts in the same pass as the decode step of the requests already streaming (one forward over both; "
        "needs the paged pool and the native kernels), so streaming requests get a token from every pass instead "
        "of waiting out each prefill. Off: prefill and decode passes alternate.",
    )

    kv_block_size: int = Field(
        16,
        ge=0,
        le=4096,
        description="Token stages keep KV in a paged pool of blocks of this many positions (dejavulib.paged): "
        "blocks are taken as tokens are written and returned the moment a request's row ends, nothing is "
        "reserved by max_tokens, and a stage short of blocks preempts microbatches to host memory. 0: one "
        "contiguous cache per microbatch, grown by doubling (also what swapping and CUDA stages use).",
    )
    kv_pool_bytes: int | None = Field(
        None,
        ge=1,
        description="Bound on a token stage's paged KV pool; None: 60% of the host memory available when the "
        "stage loads. Memory is taken as the pool fills, not up front.",
    )

    kv_host_bytes: int | None = Field(
        None,
        ge=1,
        description="Bound on the host memory of the caches token stage 0 preempts out of its paged pool. "
        "Past it, stage 0 recomputes instead: it forgets a preempted microbatch's KV, and the microbatch's "
        "next pass is one prefill of its prompt and every token it has generated, through every stage. "
        "None: 10% of the host memory available when the stage loads.",
    )
    max_recomputes: int = Field(
        8,
        ge=0,
        le=10_000,
        description="How often one microbatch may be recomputed (its KV discarded to make room, then prefilled "
        "again with its tokens) before it fails with an error instead: under memory pressure that never eases, "
        "recomputing the same work again and again would make no progress (thrashing).",
    )
    request_scheduling: bool = Field(
        True,
        description="Token pipelines over the paged pool (colocated or fed by a prompt pipeline, any number of "
        "stages, no swapping) schedule requests, not microbatches (dejavu_common.sched): each request has its own "
        "positions and blocks (no padding), joins the next pass once the pool has room and leaves the pass it "
        "finishes in, and is replicated and resumed by itself; every pass runs the running requests' decodes and "
        "then prompt chunks under engine.token_budget (chunked prefill), and prompts reuse the blocks of a cached "
        "prefix (engine.prefix_caching). Off: microbatch cohorts (what swapping runs).",
    )
    token_budget: int = Field(
        256,
        ge=16,
        le=1 << 20,
        description="Positions one pass of a request-scheduled pipeline computes at most: the running requests' "
        "decodes first, then prompts, a prompt longer than what is left split into chunks over several passes "
        "(so a long prompt delays the streaming requests by one chunk's pass at a time, not its whole prefill). "
        "Smaller: smoother streams (a lower inter-token latency tail) for later first tokens of long prompts; "
        "larger: the reverse (docs/benchmarks.md measures 128, 256 and 512).",
    )
    prefix_caching: bool = Field(
        True,
        description="A request-scheduled pipeline keeps the blocks of computed prompts and answers cached (a "
        "hash chain over their token ids, least recently used evicted first), so a request that repeats a "
        "prefix (a shared system prompt, a chat's history) computes only the rest.",
    )

    def packs_gemms(self, decodes: bool) -> bool:
        """Whether a stage that decodes (token or colocated: ``decodes``) or only prefills packs its GEMMs."""
        return self.packed_gemm == "on" or (self.packed_gemm == "auto" and decodes)

    max_context: int = Field(2048, ge=16, le=1 << 20, description="Upper bound on prompt + generated tokens.")


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class KeyLimits(BaseModel):
    """What one API key may use of the gateway (all keyless clients together, when no keys are set).
    A limit set to None is off."""

    requests_per_second: float | None = Field(
        100.0, gt=0, le=1e6, description="Requests a second, sustained; bursts of as many at once (a token bucket)."
    )
    requests_per_minute: float | None = Field(
        3000.0, gt=0, le=1e8, description="Requests a minute, sustained; bursts of as many at once (a token bucket)."
    )
    tokens_per_minute: int | None = Field(
        1_000_000,
        ge=1,
        le=1 << 40,
        description="Tokens a minute (a token bucket): a request takes its prompt plus its generation budget "
        "(max_tokens, or what the context leaves) when admitted, and gives back what it did not generate when "
        "it ends. A request needing more than this at once is refused outright.",
    )
    max_concurrent: int | None = Field(
        128, ge=1, le=1_000_000, description="Requests in flight at once (waiting or generating, streams included)."
    )


class ControllerSettings(BaseModel):
    """The REST gateway and the scheduler."""

    host: str = Field("127.0.0.1", description="Bind address of the REST API.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the REST API (0: any free port).")
    api_keys: list[SecretStr] = Field(default_factory=list, description="Accepted bearer API keys.")
    max_body_bytes: int = Field(
        2 << 20, ge=1 << 10, le=1 << 30, description="Largest request body; a longer one is refused (413) unread."
    )
    max_connections: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Connections with a request in progress (its header in, its answer not yet sent); a request "
        "beyond this is answered 503. The probes (/health, /ready) are not counted and never refused. "
        "Connections waiting for a request are bounded by `max_idle_connections` instead.",
    )
    max_idle_connections: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Connections waiting for a request (just opened, kept alive between requests, or with a "
        "header still arriving). One more closes the one that has waited longest, so stalled connections "
        "cannot take the place of clients that send requests.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="How long a request header may take to arrive, from the connection's opening or from the "
        "first byte of a request on a kept-alive connection; then the connection is closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long a request body may take to arrive after its header (all of it, not per chunk: a "
        "body trickled a byte at a time is still bounded); then the connection is closed and the request dropped.",
    )
    probe_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of a second listener on `host` that serves only /health and /ready, with its own "
        "connection bounds, so that the orchestrator's probes are answered however loaded the API port is "
        "(0: any free port). None: no probe listener; the probes are answered on `port` only.",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        le=3600,
        description="How long an idle client connection is kept open. Longer than the idle timeout of the "
        "clients' pools and load balancers in front (60 s is common): a server that closes first races the "
        "client reusing the connection, which then sees 'server disconnected without a response'.",
    )
    leader_lease_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="TTL of the controller's leader lease: a second controller on the same Redis stands by "
        "(not ready) until the lease is free; a dead leader blocks it this long at most.",
    )
    identity: str | None = Field(
        None,
        pattern=r"^[^/]{1,200}$",
        description="Names this controller in the leader lease, stable across its restarts (a restarted "
        "controller takes its own lease back at once); default '<hostname>:<port>'.",
    )
    max_prompt_chars: int = Field(
        200_000,
        ge=16,
        le=1 << 26,
        description="Longest prompt text (all chat messages together), checked before tokenizing (400 beyond).",
    )
    key_limits: KeyLimits = Field(
        default_factory=KeyLimits,
        description="Limits of each API key (beyond them: 429 with Retry-After); without API keys, of all "
        "clients together.",
    )
    key_limits_by_id: dict[str, KeyLimits] = Field(
        default_factory=dict,
        description="Limits of particular keys, by key id (the first 12 hex digits of the key's SHA-256, as "
        "in the metrics' `key` label and the startup log); fields left out take `key_limits`'s.",
    )
    mode: Mode = Field(Mode.DISAGGREGATED, description="Disaggregated prompt/token pipelines or colocated baseline.")
    prompt_depth: int = Field(1, ge=1, le=256, description="D_p: stages of the prompt pipeline.")
    token_depth: int = Field(1, ge=1, le=256, description="D_t: stages of the token pipeline.")
    prompt_microbatch: int = Field(4, ge=1, le=1024, description="Requests per prompt microbatch.")
    prompt_task_tokens: int = Field(
        2048,
        ge=1,
        le=1 << 20,
        description="Prompt tokens a prompt microbatch packs at most (disaggregated): requests join a task while "
        "its prompts stay within this and prompt_microbatch, so short prompts are not held up behind long ones; a "
        "longer prompt is a task of its own, which the prompt stages of a request-scheduled deployment compute in "
        "chunks of this many positions, each streamed to the token stages as it is done.",
    )
    token_microbatch: int = Field(4, ge=1, le=1024, description="Requests per token microbatch.")
    batch_wait_ms: float = Field(20.0, ge=0, le=10_000, description="How long a partial microbatch waits for more.")
    queue_bound: int = Field(256, ge=1, le=1_000_000, description="Waiting requests before the API answers 503.")
    max_running: int = Field(
        64,
        ge=1,
        le=65_536,
        description="Requests the token pipeline decodes at once, all its D_t cohorts together (each cohort "
        "takes up to max_running / D_t); the controller dispatches that many plus what the prompt pipeline "
        "may run ahead (D_p prompt microbatches).",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline of one request end to end.")
    progress_stall_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="How long dispatched requests may receive no token and no error, while the pipeline is "
        "up and no repair runs, before the controller reports a stall (an error log, the "
        "`dejavu_progress_stalled_seconds` gauge, and `/ready` answering 503 with code `stalled`). None: 12 "
        "transport deadlines (twice stage 0's pass deadline). Raise it where one prompt's prefill alone can "
        "take longer.",
    )
    max_stalled_repairs: int = Field(
        3,
        ge=1,
        le=100,
        description="A microbatch in flight for more repairs than this in a row, delivering no token in "
        "between, is failed to its clients (with an error) and dropped: deterministic failures cannot loop.",
    )
    planner: str = Field("manual", pattern="^(manual|auto)$", description="'auto' splits workers by the planner.")
    admin_key_ids: list[str] = Field(
        default_factory=list,
        description="Key ids (as in the startup log) of the API keys with the admin role: only they may open the "
        "status page (/dashboard) and send its admin actions. Without API keys the page is open, as the rest "
        "of the loopback-only API.",
    )
    admin_signing_key_file: Path | None = Field(
        None,
        description="File, readable by this user only, holding the admin signing key (base64, or the line "
        "`DEJAVU_ADMIN__SIGNING_KEY=...` as in `dejavu up`'s admin.env): the status page signs its admin "
        "actions (kill, pause heartbeats, drain) with it. None: the page shows them disabled.",
    )


class TransportSettings(BaseModel):
    """The KV/activation data plane (DejaVuLib)."""

    kind: str = Field(
        "ucx",
        pattern="^ucx$",
        description="Transport between worker processes: UCX (shared memory on one host, TCP across hosts). "
        "DejaVuLib's disk transport serves replicas kept on disk (`recovery.replication`), not this.",
    )
    ucx_require: str | None = Field(None, description="A UCX transport that must be selected (e.g. 'sm', 'tcp').")
    ucx_tls: str | None = Field(
        "^cma",
        description="UCX transports the data plane may use (UCX_TLS syntax; the UCX_TLS environment variable "
        "wins). The default leaves out cross-memory attach: with it, a sender that dies mid-message makes UCX "
        "abort the receiving worker (one failure becomes two). None: UCX's own choice, cma included (about "
        "1 ms less sender CPU per replicated decode step on the reference host).",
    )
    ucx_progress: str = Field(
        "thread",
        pattern="^(polling|thread)$",
        description=(
            "UCX progress: 'thread' sleeps in epoll between events (no idle CPU; the default, because several "
            "workers often share a host's cores), 'polling' spins for microsecond latency (one worker per host "
            "with cores to spare)."
        ),
    )
    deadline_s: float = Field(10.0, gt=0, le=3600, description="Deadline of one transfer.")
    max_inflight_bytes: int = Field(256 << 20, ge=1 << 16, description="Back-pressure bound of the streamer.")
    max_message_bytes: int = Field(
        4 << 30,
        ge=1 << 16,
        le=1 << 40,
        description="Largest payload a worker accepts from an authenticated peer (larger: dropped unread).",
    )
    max_queued_bytes: int | None = Field(
        None,
        ge=1 << 16,
        le=1 << 42,
        description="Bound on the payload bytes a worker has admitted on one channel and not yet consumed "
        "(in flight and queued); a message past it is dropped unread and counted, and the consumer's deadline "
        "covers it. An empty channel always takes one message. None: twice max_message_bytes.",
    )
    max_queued_messages: int = Field(
        4096,
        ge=16,
        le=1 << 20,
        description="Bound on the messages a worker has admitted on one channel and not yet consumed; past "
        "it, as for max_queued_bytes.",
    )
    secret: SecretStr = Field(
        SecretStr(DEV_DATA_PLANE_SECRET),
        description="Per-deployment data-plane secret; the public default is refused beyond loopback.",
    )
    host: str = Field("127.0.0.1", description="Address this worker's data plane is reachable at.")


class Replication(str, enum.Enum):
    OFF = "off"
    MEMORY = "memory"
    DISK = "disk"
    BOTH = "both"


class RecoverySettings(BaseModel):
    """Failure detection and recovery."""

    heartbeat_interval_s: float = Field(0.25, gt=0, le=60, description="Lease renewal period.")
    lease_ttl_s: float = Field(1.5, gt=0, le=600, description="A worker whose lease is older is failed.")
    replication: Replication = Field(
        Replication.MEMORY,
        description="Where a token stage keeps the replica of its predecessor's KV: `memory` (host memory), "
        "`disk` (files under `replica_dir`, gathered back when a restore needs them: no host memory), `both` "
        "(restores read memory), or `off` (a failure re-runs prompts).",
    )
    replica_dir: Path = Field(
        default_factory=lambda: default_cache_dir() / "replicas",
        description="Folder of on-disk replicas (created 0700; refused if other users could write it).",
    )
    replica_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Bound on the host memory of a token stage's replicas (`memory`, `both`): a block pool of "
        "`engine.kv_block_size` positions (16 when the pool is off), taken as chunks arrive and returned "
        "as each request ends. None: 30% of the host memory available when the stage starts replicating. A "
        "replica that finds the pool full is dropped: a failure of its stage re-runs that microbatch's prompt.",
    )
    drain_timeout_s: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="How long a draining worker (SIGTERM, `dejavu admin drain`) keeps serving while the "
        "controller hands its stage to a replacement; it leaves after this even without one.",
    )
    prompt_reclaim_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="A prompt task its last stage has not finished this long after it was claimed (a stage "
        "stalled, or its activations were lost, without a change of topology) is claimed again by prompt "
        "stage 0 and re-run; token stage 0 fails a microbatch announced only in part for twice this. Keep "
        "it above the time a prompt microbatch takes through the whole prompt pipeline under full load.",
    )


class TracingSettings(BaseModel):
    """Request traces (OpenTelemetry spans, ``dejavu_common.tracing``): on when an exporter is set, off and free
    (no SDK, the no-op tracer) otherwise."""

    otlp_endpoint: str | None = Field(
        None,
        pattern=r"^https?://",
        description="OTLP/HTTP traces endpoint spans are exported to (e.g. http://collector:4318/v1/traces), as "
        "vLLM's --otlp-traces-endpoint. None: no OTLP export.",
    )
    file: Path | None = Field(
        None,
        description="Also write every finished span as one JSON line (the SDK's span JSON) to this file, appended "
        "by every process given it: for tests and debugging without a collector.",
    )
    service_name: str | None = Field(
        None,
        max_length=128,
        description="The service name of this process's spans; None: dejavu-controller, dejavu-prompt-worker or "
        "dejavu-token-worker.",
    )
    sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Share of requests traced (decided at the controller; workers follow it)."
    )

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None or self.file is not None


class WorkerSettings(BaseModel):
    """What every worker process serves besides its stage (``dejavu_worker.metrics``)."""

    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of this worker's Prometheus metrics (GET /metrics); 0: any free port; None: not served. "
        "The URL is published in the worker's registry record (`dejavu admin status --json`).",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Bind address of the metrics port ('0.0.0.0' in containers, for the scraper). Bound to a "
        "wildcard, the published URL names transport.host.",
    )


class SwapSettings(BaseModel):
    """Microbatch swapping on token workers."""

    enabled: bool = Field(False, description="Keep in-flight microbatches' KV in host memory and prefetch.")
    device_kv_budget_bytes: int | None = Field(None, ge=1, description="Device memory available for KV.")


class PlannerSettings(BaseModel):
    """What the planner sizes a deployment for (``dejavu up`` with ``controller.planner`` auto).

    ``itl_target_ms`` defaults to 1200 ms because that is what a token budget of 256 positions costs a token on
    this host's profile (``smollm2-135m-cpu-1thread``), rounded up: `dejavu up` runs one colocated stage whose full
    pass holds ``controller.max_running`` = 64 decodes (0.252 s of layers and 0.219 s of head for 65 sampling rows,
    extrapolated from the 8 rows the profile times) and a 192-position prompt chunk (0.724 s), 1.195 s in all,
    while 272 positions would take 1.256 s; so the planner keeps 256 there. On a faster host's profile the same
    target gives a larger budget, up to the prefill knee's cap (docs/planner.md).
    """

    itl_target_ms: float = Field(
        1200.0,
        gt=0,
        le=3_600_000,
        description="Inter-token latency the planner sizes engine.token_budget for: the largest budget whose full "
        "pass (the pipeline's decodes, then a prompt chunk) keeps a request's time between tokens within this, "
        "on the profile's slowest stage. An explicit engine.token_budget overrides the planner.",
    )


# An Ed25519 key as base64 of its raw 32 bytes.
_ED25519_KEY = r"^[A-Za-z0-9+/]{43}=$"


class AdminSettings(BaseModel):
    """The Redis-based admin tool: Ed25519 keys (base64 of raw 32 bytes) and the rules of a command."""

    signing_key: SecretStr | None = Field(
        None, description="Private key that signs admin commands; only the admin tool holds it."
    )
    verify_key: str | None = Field(
        None,
        pattern=_ED25519_KEY,
        description="Public key workers check commands with; None: workers refuse every command.",
    )
    command_ttl_s: float = Field(30.0, gt=0, le=3600, description="How long a signed command stays valid.")
    clock_skew_s: float = Field(5.0, ge=0, le=300, description="Tolerated clock difference, admin host to worker.")
    max_pause_s: float = Field(300.0, gt=0, le=86_400, description="Longest pause-heartbeats a worker obeys.")

    @field_validator("signing_key")
    @classmethod
    def _signing_key_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(_ED25519_KEY, value.get_secret_value()):
            raise ValueError("admin.signing_key must be base64 of 32 bytes (see `dejavu admin keygen`)")
        return value


class Settings(BaseSettings):
    """Root of all configuration; see the module docstring for the sources."""

    model_config = SettingsConfigDict(
        env_prefix="DEJAVU_",
        env_nested_delimiter="__",
        env_file=os.environ.get("DEJAVU_SETTINGS_FILE"),
        extra="forbid",
    )

    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    transport: TransportSettings = Field(default_factory=TransportSettings)
    recovery: RecoverySettings = Field(default_factory=RecoverySettings)
    swap: SwapSettings = Field(default_factory=SwapSettings)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="Log level of every service.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines of every service: plain text, or one JSON object per line with the service, worker "
        "and request ids as fields (dejavu_common.logs).",
    )

    @property
    def schedules_requests(self) -> bool:
        """Whether the pipelines schedule requests, not microbatches: token stages over paged pools
        (``engine.kv_block_size``), ``engine.request_scheduling`` on, no swapping. Then every request is a
        microbatch of its own, token stage 0's policy decides when it joins a pass, and a prompt pipeline
        computes its prompts over a paged pool with a prefix cache. Settings alone decide, so the controller and
        every worker agree."""
        engine = self.engine
        return engine.request_scheduling and engine.kv_block_size > 0 and not self.swap.enabled

    def to_env(self) -> dict[str, str]:
        """These settings as ``DEJAVU_*`` variables, so a launcher can hand them to child processes."""
        env: dict[str, str] = {}

        def walk(prefix: str, model: BaseModel) -> None:
            for name in type(model).model_fields:
                value = getattr(model, name)
                key = f"{prefix}{name.upper()}"
                if isinstance(value, BaseModel):
                    walk(key + "__", value)
                elif value is None:
                    continue
                elif isinstance(value, SecretStr):
                    env[key] = value.get_secret_value()
                elif isinstance(value, list):
                    env[key] = json.dumps([v.get_secret_value() if isinstance(v, SecretStr) else v for v in value])
                elif isinstance(value, enum.Enum):
                    env[key] = str(value.value)
                else:
                    env[key] = str(value)

        walk("DEJAVU_", self)
        return env
