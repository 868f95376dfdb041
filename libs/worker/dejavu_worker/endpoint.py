"""A worker's data-plane endpoint: a DejaVuLib :class:`Endpoint` over UCX, addressed by worker id.

Peers' endpoint addresses come from the registry in Redis (``WorkerInfo.data_address``). Payloads
are the serving layer's framed messages (:mod:`dejavu_worker.dataplane`); DejaVuLib adds the sealed
header (size, payload MAC, epoch fencing, replay refusal, sender authentication) and bounds payloads:
by ``transport.max_message_bytes``, and once the worker holds a stage by the deployment's largest
legitimate message (:func:`largest_message`, :meth:`DataEndpoint.bound_messages`).

Messages are sealed per (sender, receiver) pair (:mod:`dejavulib.peerkeys`): each worker process makes
an X25519 key pair at its start and publishes the public half in its registry record
(``WorkerInfo.data_key``, which only its own Redis user may write); the deployment secret is the salt of
every pair key, so it still gates membership. A worker learns the key of each peer it sends to when it
connects to it (:meth:`DataEndpoint.connect_all`), and the key of a sender it does not know yet, or whose
process changed, from the sender's record when its first message arrives (on the transport's thread,
at most once a second per sender). A worker holding the secret but not B's private key therefore
cannot get a message accepted as B's: it is dropped, logged and counted (``rejected_sender``).

Every message leaves through one DejaVuLib :class:`Streamer` (one thread, FIFO across channels): a
send returns once the message is queued; KV regions (:meth:`send_region`) are packed there, off the
compute thread, into reused staging buffers; bytes in flight are bounded by
``transport.max_inflight_bytes``. A failed or timed-out send is logged; the controller's lease-based
failure detection, not the data plane, decides that a peer is dead.
"""

from __future__ import annotations

import base64
import collections
import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import redis
import torch

from dejavu_common import keys
from dejavu_common.exposure import check_data_plane
from dejavu_common.fatal import die
from dejavu_common.messages import Topology, WorkerInfo
from dejavu_common.settings import Settings, TransportSettings
from dejavu_worker.metrics import DataPlaneMetrics
from dejavulib.endpoint import Endpoint, Message
from dejavulib.errors import IntegrityError, PeerError, TransferError, TransferTimeout, TransportUnavailable
from dejavulib.header import Channel, Header, sender_field
from dejavulib.kvcache import KVCache
from dejavulib.layout import Region
from dejavulib.peerkeys import PeerKeys, decode_public_key
from dejavulib.streamer import Streamer
from dejavulib.transport.base import MessageTransport

__all__ = ["Channel", "DataEndpoint"]

log = logging.getLogger("dejavu.worker.endpoint")

# The purposes of the controller's ``dejavu_kv_bytes_streamed`` counter, by channel.
_KV_PURPOSE = {
    Channel.KV_PROMPT: "prompt_to_token",
    Channel.KV_REPLICA: "replication",
    Channel.KV_RESTORE: "recovery",
    Channel.KV_SWAP: "swap",
}


def _transport(settings: TransportSettings, worker_id: str):
    if settings.kind != "ucx":
        raise ValueError(f"workers in separate processes need the 'ucx' transport, not {settings.kind!r}")
    from dejavulib.transport.ucx import UcxTransport

    transport = UcxTransport(
        worker_id,
        progress=settings.ucx_progress,
        require=settings.ucx_require,
        host=settings.host,
        tls=settings.ucx_tls,
        chunks=False,  # workers exchange messages only: chunks a peer sends are discarded, never queued
    )
    # A worker without its I/O thread can neither send nor receive: end it, so its lease expires.
    transport.on_failure = lambda exc: die(f"UCX I/O thread of {worker_id}", exc)
    return transport


# What ``largest_message`` adds on top of the largest tensor: a share for the meta JSON of the largest pass
# (per row: its microbatch, step and row index in ``members``) and the framing, and a relative margin.
_META_BYTES, _META_BYTES_PER_ROW, MESSAGE_MARGIN = 1 << 20, 64, 1.25
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class ModelShape(Protocol):
    """The checkpoint's shape facts a message's size depends on (``dejavu_engine.family.ModelSpec``)."""

    hidden_size: int
    num_kv_heads: int
    head_dim: int


def largest_message(topology: Topology, settings: Settings, model: ModelShape) -> int:
    """The bound on a data-plane payload in this deployment: its largest legitimate message, with a margin.

    Every worker of a deployment computes the same number (from the topology, the shared settings and the
    checkpoint), so what one sends another accepts. The largest messages are, with ``rows`` the larger
    microbatch and ``positions`` ``engine.max_context``:

    - a KV region (prompt KV, replica, restore, swap): K and V of at most one microbatch, ``rows`` x
      ``positions``, over at most the layers of the largest stage of either pipeline (a stage replicates
      to its successor, whose own span may be smaller);
    - a PREFILL pass: hidden states of one microbatch, ``rows`` x ``positions`` x ``hidden_size``;
    - a DECODE pass: one position of every row of a cohort, at most ``controller.max_running`` rows (stage 0
      forms cohorts within it);

    activations counted as float32 whatever the model's dtype, plus a share for the meta of the largest
    pass, the whole times ``MESSAGE_MARGIN``. ``transport.max_message_bytes`` stays the upper limit."""
    stages = (*topology.prompt_stages, *topology.token_stages)
    layers = max((a.layers[1] - a.layers[0] for a in stages), default=topology.n_layers)
    rows = max(topology.prompt_microbatch, topology.token_microbatch)
    positions = settings.engine.max_context
    cohort = max(rows, settings.controller.max_running)
    kv = 2 * layers * rows * model.num_kv_heads * positions * model.head_dim * _ITEMSIZE[settings.model.dtype]
    activations = max(rows * positions, cohort) * model.hidden_size * _ITEMSIZE["float32"]
    meta = _META_BYTES + _META_BYTES_PER_ROW * cohort
    return int(max(kv, activations) * MESSAGE_MARGIN) + meta


class DataEndpoint:
    def __init__(
        self,
        settings: TransportSettings,
        worker_id: str,
        transport: MessageTransport | None = None,
        registry: redis.Redis | None = None,
    ) -> None:
        """``transport``: the one to use instead of UCX (tests pass DejaVuLib's in-process fake).
        ``registry``: the Redis client senders' keys are looked up with (thread-safe: it is used on the
        transport's thread); None: the one :meth:`connect_all` is given first."""
        check_data_plane(settings)  # no public default secret beyond loopback
        self.settings = settings
        self.worker_id = worker_id
        self._registry = registry
        secret = settings.secret.get_secret_value()
        self.keys = PeerKeys(worker_id, secret, resolve=self._published_key)
        self._ep = Endpoint(
            transport if transport is not None else _transport(settings, worker_id),
            secret,
            max_message_bytes=settings.max_message_bytes,
            max_queued_bytes=settings.max_queued_bytes,
            max_queued_messages=settings.max_queued_messages,
            keys=self.keys,
        )
        self._addresses: dict[str, bytes] = {}
        # Received payloads dropped because they failed their MAC or size check, by channel name.
        self.corrupt: collections.Counter[str] = collections.Counter()
        self.streamer = Streamer(self._ep, settings.max_inflight_bytes)
        self.streamer.observe = self._observe
        # A worker whose messages can no longer leave must end, so its lease expires and it is replaced.
        self.streamer.on_failure = lambda exc: die(f"streaming thread of {worker_id}", exc)
        # Called with (purpose, bytes) for every KV payload sent; the worker points it at its heartbeat.
        self.count_kv: Callable[[str, int], None] = lambda purpose, nbytes: None
        self.metrics: DataPlaneMetrics | None = None  # see :meth:`record_to`

    def record_to(self, metrics: DataPlaneMetrics) -> None:
        """Count what this endpoint sends (when each send settles), receives and drops in ``metrics``."""
        self.metrics = metrics
        self.streamer.settled = metrics.settled

    @property
    def address(self) -> bytes:
        return self._ep.address

    @property
    def data_key(self) -> str:
        """This process's data-plane public key, for its registry record (``WorkerInfo.data_key``)."""
        return self.keys.public_key

    @property
    def stats(self) -> collections.Counter[str]:
        return self._ep.stats

    @property
    def max_message_bytes(self) -> int:
        """The largest payload this endpoint sends or accepts now (larger ones a receiver drops unread)."""
        return self._ep.max_message_bytes

    def bound_messages(self, nbytes: int) -> None:
        """Accept and send payloads of at most ``nbytes`` from now on (:func:`largest_message`), never more
        than ``transport.max_message_bytes``; the per-channel backlog bound follows it where the settings
        leave that to the default (twice the largest message)."""
        bound = min(nbytes, self.settings.max_message_bytes)
        if bound != self._ep.max_message_bytes:
            log.info("data plane of %s: payloads up to %.1f MB", self.worker_id, bound / 1e6)
        self._ep.max_message_bytes = bound
        if self.settings.max_queued_bytes is None:
            self._ep.max_queued_bytes = 2 * bound

    def set_epoch(self, epoch: int) -> None:
        self._ep.set_epoch(epoch)

    def connect_all(self, client: redis.Redis, peer_ids: list[str]) -> None:
        """Connect to each peer by the address it registered (reconnecting when it changed).

        A peer that is not registered (yet, or again after Redis lost its state) or whose connection
        fails (``PeerError``, ``TransportUnavailable``: e.g. UCX failing to map shared memory with a
        peer that just started) is retried with exponential backoff for up to ``deadline_s``, each
        failure logged; the last error is raised after that.

        Peers connected before and not in ``peer_ids`` (they left the topology: failed, drained or moved
        elsewhere) are forgotten first: what is still in flight to them fails now, and a dead peer's
        outstanding transfers stop counting as this worker's traffic. Then this worker's own receive
        path is checked (:meth:`check_receive_path`). Each peer's data-plane key is taken from the same
        record; a peer that publishes none cannot be sent to (``PeerError``, retried like the others).
        """
        if self._registry is None:
            self._registry = client
        for peer in sorted(set(self._addresses) - set(peer_ids)):
            del self._addresses[peer]
            self._ep.forget(peer)
        self.check_receive_path()
        for peer in peer_ids:
            deadline = time.monotonic() + self.settings.deadline_s
            delay = 0.05
            while True:
                try:
                    self._connect(client, peer)
                    break
                except (PeerError, TransportUnavailable) as exc:
                    if time.monotonic() + delay > deadline:
                        raise
                    log.warning("connecting to %s failed (%s): retrying in %.2f s", peer, exc, delay)
                    time.sleep(delay)
                    delay = min(2 * delay, 1.0)

    def forget_peers(self) -> None:
        """Forget every peer (this worker left the topology: its peers forgot it, so a connection kept from
        before would lead nowhere); the next :meth:`connect_all` connects afresh."""
        for peer in list(self._addresses):
            del self._addresses[peer]
            self._ep.forget(peer)

    def check_receive_path(self) -> None:
        """End the process if messages sent to it no longer arrive (``Transport.receive_path_ok``: a peer
        killed while writing into this worker's shared-memory receive FIFO blocks it for good, and nothing
        short of a new process mends it). Its lease then expires and the controller replaces it; a
        supervisor restarts it. Checked at each epoch, since any peer's death changes the epoch."""
        if not self._ep.transport.receive_path_ok(self.settings.deadline_s / 2):
            die(f"the data plane of {self.worker_id}", RuntimeError("messages sent to this worker no longer arrive"))

    def _connect(self, client: redis.Redis, peer: str) -> None:
        raw = client.hget(keys.worker(peer), "info")
        if raw is None:
            raise PeerError(f"peer {peer!r} is not registered")
        info = WorkerInfo.decode(raw)
        if info.worker_id != peer:  # each worker's Redis user writes only its own record
            raise TransferError(f"the record of peer {peer!r} claims to be worker {info.worker_id!r}")
        try:
            self.keys.learn(peer, decode_public_key(info.data_key))
        except ValueError as exc:
            raise PeerError(f"peer {peer!r} publishes no usable data-plane key: {exc}") from exc
        address = base64.b64decode(info.data_address)
        if self._addresses.get(peer) != address:
            self._addresses.pop(peer, None)  # a failed attempt leaves no address behind
            self._ep.connect(peer, address)
            self._addresses[peer] = address

    def _published_key(self, field: str) -> tuple[str, bytes] | None:
        """The worker id and data-plane key that the sender a header names as ``field`` publishes in its
        registry record; None when it has no record or no key. Runs on the transport's thread (one Redis
        round trip, bounded by the client's socket timeout); raises what Redis raises."""
        client = self._registry
        if client is None:
            return None
        worker_id: str | None = field
        raw = client.hget(keys.worker(field), "info")
        if raw is None:  # a long id: the header carries its head and a digest, so find whose it is
            members = (m.decode(errors="replace") if isinstance(m, bytes) else m for m in client.smembers(keys.WORKERS))
            worker_id = next((m for m in members if m != field and sender_field(m) == field), None)
            raw = None if worker_id is None else client.hget(keys.worker(worker_id), "info")
        if worker_id is None or raw is None:
            return None
        info = WorkerInfo.decode(raw)
        if info.worker_id != worker_id or not info.data_key:  # each worker's Redis user writes only its own
            return None
        return worker_id, decode_public_key(info.data_key)

    def send(self, peer: str, channel: Channel, payload: bytes) -> None:
        """Queue ``payload`` to ``peer`` on ``channel`` (FIFO per peer, across channels)."""
        data = np.frombuffer(payload, dtype=np.uint8)
        self.streamer.submit(peer, Header(channel=channel), data, self.settings.deadline_s)

    def send_region(self, peer: str, header: Header, cache: KVCache, region: Region) -> None:
        """Queue ``region`` of ``cache`` to ``peer``: packed on the streaming thread, with ``header``
        (channel and destination place; see :meth:`Streamer.submit_region`). The region must not be
        written again (past positions are not)."""
        replica = self.metrics is not None and header.channel is Channel.KV_REPLICA
        if replica:  # settled by the streamer's hook, which counts it down
            self.metrics.submitted_replica(region.nbytes(cache.layout))  # type: ignore[union-attr]
        try:
            self.streamer.submit_region(peer, header, cache, region, self.settings.deadline_s)
        except Exception:
            if replica:
                self.metrics.submitted_replica(-region.nbytes(cache.layout))  # type: ignore[union-attr]
            raise

    def send_packed(self, peer: str, header: Header, packed: torch.Tensor) -> None:
        """Queue an already packed region (``header`` describes it, as ``streamer.region_header`` makes it)."""
        self.streamer.submit(peer, header, packed.reshape(-1), self.settings.deadline_s)

    def recv(self, channel: Channel, timeout_s: float) -> memoryview | None:
        """The next payload on ``channel``, or None after ``timeout_s``."""
        message = self.recv_message(channel, timeout_s)
        return None if message is None else memoryview(message.payload)

    def recv_message(self, channel: Channel, timeout_s: float) -> Message | None:
        """The next message on ``channel`` (its verified header and payload), or None after ``timeout_s``.

        A payload that fails its header's size or MAC check (a flipped byte on the way, or a forgery) is
        dropped: logged with its channel and sender, counted in :attr:`corrupt`, and the wait goes on for
        what is left of ``timeout_s``. One bad message never ends a receiving loop; what it carried is
        lost, and each consumer's own deadline covers that (prompt KV that never completes fails its
        microbatch, a replica step past a hole is not served, a restore missing a cache fails)."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                message = self._ep.recv(channel, max(0.0, end - time.monotonic()))
            except TransferTimeout:
                return None
            except IntegrityError as exc:
                self.corrupt[channel.name] += 1
                if self.metrics is not None:
                    self.metrics.corrupt(channel)
                log.error(
                    "dropped a corrupt %s message on %s (%d on this channel so far): %s",
                    channel.name,
                    self.worker_id,
                    self.corrupt[channel.name],
                    exc,
                )
                continue
            if self.metrics is not None:
                self.metrics.received(message.header)
            return message

    def _observe(self, header: Header, nbytes: int) -> None:
        purpose = _KV_PURPOSE.get(header.channel)
        if purpose is not None and header.which:  # KV regions, not the markers between them
            self.count_kv(purpose, nbytes)

    def close(self) -> None:
        self.streamer.close()
        self._ep.close()
