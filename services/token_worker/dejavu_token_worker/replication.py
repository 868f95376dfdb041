"""Token-level KV replication: stage x streams its cache updates to stage (x + 1) mod D_t.

The sender side ships the prompt part once, then after every decode step the one position that
step wrote (all of the stage's layers, rows and heads: one region, packed by DejaVuLib's streaming
thread into one buffered transfer, its header naming the microbatch, positions and step). The receiver keeps
the predecessor's caches in a host block pool (DejaVuLib's paged caches: blocks taken as chunks
arrive, a finished request's returned at its microbatch's next step, the rest when the microbatch
ends) and, once a chunk for microbatch j up to step t is written, records the watermark (x, j, t)
in Redis, so the controller knows how far every replica reaches. With ``replication = disk`` the
receiver keeps the replica on disk instead, through DejaVuLib's disk transport, and gathers it back
when a restore needs it; ``both`` keeps both (see :class:`ReplicaStore`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.private import ensure_private_dir
from dejavu_common.settings import Replication
from dejavu_common.signing import EntrySigner, sign_watermark
from dejavu_token_worker.executor import request_layout
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.microbatch import MicrobatchState, fetch_spec
from dejavulib.endpoint import Message
from dejavulib.errors import DejaVuLibError, IntegrityError
from dejavulib.header import Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout, Region
from dejavulib.paged import BlockGeometry, BlockPool, PagedKVCache, PoolExhausted
from dejavulib.streaming import region_of, stream_in
from dejavulib.transport.base import KEY_LIMIT
from dejavulib.transport.disk import DiskTransport, FolderLease, sweep_orphans

log = logging.getLogger("dejavu.token_worker.replication")

_FINISHED_REMEMBERED = 4096  # finished microbatches remembered (ids grow: older ones cannot come back)


class ReplicaSender:
    """Ships this stage's KV updates to its successor (no-op when replication is off or D_t == 1)."""

    def __init__(self, endpoint: DataEndpoint, peer: str | None) -> None:
        self.endpoint = endpoint
        self.peer = peer

    def send(self, state: MicrobatchState, step: int, positions: tuple[int, int]) -> None:
        """Replicate positions [positions) of ``state``'s cache, as of ``step``."""
        self.send_pass([(state, step, positions)])

    def send_pass(self, written: list[tuple[MicrobatchState, int, tuple[int, int]]]) -> None:
        """Replicate what one pass wrote: each member's written positions (every layer, row and head of
        this stage), one region per member, packed off the compute thread."""
        if self.peer is None:
            return
        for state, step, positions in written:
            cache = state.cache
            region = cache.layout.region(positions=positions, microbatch=state.mb_id)
            header = Header(Channel.KV_REPLICA, microbatch=state.mb_id, step=step)
            self.endpoint.send_region(self.peer, header, cache, region)

    def send_slices(self, pool: BlockPool, written: Iterable[tuple[int, Sequence[int], int, int]]) -> None:
        """Replicate what one pass of a request-scheduled pipeline wrote on this stage: per request ``(request,
        table, first, end)``, positions ``[first, end)`` of the blocks of ``table`` in ``pool`` (from 0 on a
        request's first pass since it was admitted: a replica starts at its first position). The watermark a
        replica of a request keeps is the last position it holds (:attr:`Replica.by_position`)."""
        if self.peer is None:
            return
        for mb, table, first, end in written:
            layout = request_layout(pool, len(table))
            view = PagedKVCache.view(pool, layout, table, end)
            region = layout.region(positions=(first, end), microbatch=mb)
            self.endpoint.send_region(self.peer, Header(Channel.KV_REPLICA, microbatch=mb, step=end - 1), view, region)


@dataclass(eq=False)
class Replica:
    """What this stage keeps of one microbatch of its predecessor: where the KV is (a cache in the host
    block pool, chunks in the disk transport's slots, or both), how far it reaches, and the steps held past
    a hole."""

    mb_id: int
    layout: KVLayout  # the predecessor's layers and this microbatch's rows; ``max_len``: positions held so far
    span: int  # the microbatch's whole span (its spec's ``max_len``)
    cache: PagedKVCache | None  # in the host block pool (``memory``, ``both``)
    chunks: list[tuple[int, Region]] = field(default_factory=list)  # on disk (``disk``, ``both``): key, region
    step: int = -1  # the watermark: the last step up to which every step is held
    ahead: set[int] = field(default_factory=set)  # steps held past a hole (not yet contiguous)
    by_position: bool = False  # a request's replica: the watermark is the last position held (see record)

    def record(self, positions: tuple[int, int], chunk_step: int) -> int:
        """Record a replica of ``positions`` as of ``chunk_step``; returns the watermark. A region from
        position 0 (the prompt, or a whole cache restored as of a step) holds every step up to its own; a
        decode step's region holds its step only. A step that arrives past a hole (a message lost on the
        way) waits above the watermark until the hole is filled, so a restore never serves the hole as
        data: recovery resumes from before it instead.

        A request's replica (``by_position``, request-scheduled pipelines) counts positions instead: a region
        that starts at or before the position after the watermark moves the watermark to its last position; one
        past a hole leaves it where it is."""
        if self.by_position:
            if positions[0] <= self.step + 1:
                self.step = max(self.step, positions[1] - 1)
            else:
                log.warning("replica of request %d: positions %s arrived past a hole after position %d",
                            self.mb_id, positions, self.step)  # fmt: skip
            return self.step
        if positions[0] == 0 or chunk_step <= self.step + 1:
            self.step = max(self.step, chunk_step)
        else:
            log.warning(
                "replica of microbatch %d: step %d arrived past a hole after step %d", self.mb_id, chunk_step, self.step
            )
            self.ahead.add(chunk_step)
        while self.step + 1 in self.ahead:
            self.step += 1
        self.ahead.difference_update(range(self.step + 1))
        return self.step


class ReplicaStore:
    """The predecessor's caches; a background thread receives into them.

    ``memory`` keeps each replica as a paged cache in a host :class:`BlockPool` of up to ``memory_bytes``:
    blocks are taken as chunks arrive (nothing is reserved by the span), a row's go back when its request
    ends (:meth:`retire_rows`), the rest when the microbatch ends. A replica that finds the pool full is
    dropped (logged), so a failure of the predecessor re-runs that microbatch's prompt instead of
    restoring it: replicas never take more than their bound. ``disk`` keeps none in memory: every chunk goes
    through DejaVuLib's disk transport (``flush`` to this process's own folder under ``replica_dir``, one
    file per chunk, written atomically) and a restore gathers the chunks back (``fetch``) into a cache
    built for it. ``both`` does both and restores from memory. A microbatch's chunks are discarded with
    it; the folder is removed when the store closes, and a folder whose process died (its
    :class:`FolderLease` dropped by the kernel) is removed by the next store that opens on the host."""

    def __init__(
        self,
        client: redis.Redis,
        endpoint: DataEndpoint,
        source_stage: int,
        source_layers: tuple[int, int],
        head_geometry: tuple[int, int, str],
        mode: Replication,
        replica_dir: Path,
        deadline_s: float,
        abandon: Callable[[], bool] | None = None,
        worker_id: str = "replicas",
        block_size: int = 16,
        memory_bytes: int = 1 << 30,
        by_position: bool = False,
    ) -> None:
        self.redis = client
        self.by_position = by_position  # replicas of requests (one row each), watermarks in positions
        # Signs the watermarks it publishes (the worker's key, dejavu_common.signing; None: unsigned).
        self.signer: EntrySigner | None = None
        self.abandon = abandon  # stops a wait for a spec once a newer epoch exists
        self.endpoint = endpoint
        self.source_stage = source_stage
        self.source_layers = source_layers
        self.mode = mode
        self.deadline_s = deadline_s
        self.kv_heads, self.head_dim, self.dtype = head_geometry
        self.pool: BlockPool | None = None
        if self.in_memory:
            a, b = source_layers
            geometry = BlockGeometry(b - a, self.kv_heads, block_size, self.head_dim, self.dtype, a)
            self.pool = BlockPool(geometry, max(1, memory_bytes // geometry.bytes_per_block), slab_blocks=32)
        self.replicas: dict[int, Replica] = {}
        # Microbatches released as finished: a replica of theirs still on its way must not revive them.
        self._finished: collections.deque[int] = collections.deque(maxlen=_FINISHED_REMEMBERED)
        self.lock = threading.Lock()
        self._closed = False
        self.disk: DiskTransport | None = None
        self._next_key = 0
        self._lease: FolderLease | None = None
        if mode in (Replication.DISK, Replication.BOTH):
            # Replicas are KV caches: in a folder others can neither read nor plant files in.
            # One folder per process (a restarted worker never reads an earlier one's chunks), leased while it
            # lives: whoever opens a store next on this host removes the folders of processes that died.
            base, owner = ensure_private_dir(replica_dir), f"{worker_id}.{os.getpid()}"
            self._lease = FolderLease(base, owner)
            self.disk = DiskTransport(owner, base)
            self.disk.connect(owner, self.disk.address)  # chunks are flushed to this process's own folder
            _empty(self.disk.root)  # left by a dead process with the same id and pid (a container's restart)
            gone = sweep_orphans(base)
            if gone:
                log.info("removed the replica folders of processes that died: %s", gone)

    @property
    def in_memory(self) -> bool:
        return self.mode in (Replication.MEMORY, Replication.BOTH)

    def run(self, stop: threading.Event) -> None:
        """Receive replica messages until ``stop`` is set."""
        while not stop.is_set():
            message = self.endpoint.recv_message(Channel.KV_REPLICA, timeout_s=0.1)
            if message is None:
                continue
            try:
                self.store(region_of(message.header), message.header.step, message)
            except (ValueError, KeyError, IndexError, RuntimeError, DeadlineExceeded, DejaVuLibError, OSError) as exc:
                log.error("dropped a replica message: %s", exc)

    def store(self, region: Region, step: int, message: Message) -> None:
        """Keep ``message`` (the predecessor's KV of ``region`` as of ``step``) and advance the watermark.

        Waits (for a spec, a grown cache's copy, a disk write) happen outside the lock, which guards
        only the bookkeeping: recovery reads replicas meanwhile, and memory accounting never waits."""
        if tuple(region.layers) != self.source_layers:
            raise ValueError(f"replica layers {region.layers} are not stage {self.source_stage}'s")
        mb = region.microbatch
        replica = self._replica(mb, region.positions)
        if replica is None:
            return
        region.check_within(replica.layout)
        if replica.cache is not None:
            stream_in(replica.cache, message, region)  # into the blocks _replica took for it
        elif region.nbytes(replica.layout) != message.payload.nbytes:
            raise IntegrityError(f"region {region} needs {region.nbytes(replica.layout)} bytes, "
                                 f"the message has {message.payload.nbytes}")  # fmt: skip
        key = None
        if self.disk is not None:
            with self.lock:
                key, self._next_key = self._next_key, (self._next_key + 1) % KEY_LIMIT
            self.disk.flush(self.disk.self_id, key, message.payload, self.deadline_s)  # a failed one leaves no file
        with self.lock:  # drop() takes the lock too: a released microbatch's chunks and watermark never come back
            if self._closed or self.replicas.get(mb) is not replica:
                if key is not None:
                    self.disk.discard(self.disk.self_id, key)  # type: ignore[union-attr]
                return
            if key is not None:
                replica.chunks.append((key, region))
            before = replica.step
            held = replica.record(region.positions, step)
            if held != before:
                self._publish_watermark(mb, held)

    def _publish_watermark(self, mb_id: int, step: int) -> None:
        """Record in Redis that the replica of ``mb_id`` holds ``step``, signed with this worker's key (the
        signature first: a reader that finds the watermark without its signature does not trust it)."""
        key = keys.watermark(self.source_stage)
        if self.signer is not None:
            signature = sign_watermark(self.signer, key, mb_id, step)
            self.redis.hset(keys.watermark_signatures(self.source_stage), mb_id, signature)
        self.redis.hset(key, mb_id, step)

    def _replica(self, mb_id: int, chunk_positions: tuple[int, int]) -> Replica | None:
        """The replica of ``mb_id``, holding at least the chunk's positions: in memory, its paged cache
        takes the blocks up to them; on disk only, its layout doubles up to the microbatch's span (a
        chunk past the span is refused). None for a later step of a microbatch not held here: a replica
        starts with its prompt (FIFO per sender), so that is one released meanwhile (it finished, or the
        pool was full), and it must not come back; and None when the pool has no block for the chunk
        (the replica is dropped)."""
        positions = chunk_positions[1]
        with self.lock:
            replica = self.replicas.get(mb_id)
            gone = self._closed or mb_id in self._finished
            if replica is None and (chunk_positions[0] > 0 or gone):
                log.debug("ignored a replica step of released microbatch %d", mb_id)
                return None
        if replica is None:
            spec = fetch_spec(self.redis, mb_id, self.deadline_s, self.abandon)  # may wait: not under the lock
            a, b = self.source_layers
            cache = None
            if self.pool is not None:  # the whole span's coordinates; blocks come as positions arrive
                layout = KVLayout(b - a, len(spec.rows), self.kv_heads, spec.max_len, self.head_dim, self.dtype, a)
                cache = self.pool.cache(layout, spec.pad_lens)
            else:
                size = min(spec.max_len, max(positions, spec.prompt_len + 64))
                layout = KVLayout(b - a, len(spec.rows), self.kv_heads, size, self.head_dim, self.dtype, a)
            with self.lock:
                if self._closed or mb_id in self._finished:
                    return None
                replica = self.replicas.setdefault(
                    mb_id, Replica(mb_id, layout, spec.max_len, cache, by_position=self.by_position)
                )
            if cache is not None and replica.cache is not cache:
                cache.free()  # another thread made it first
        if replica.cache is not None:  # raises past the span
            try:
                replica.cache.holding(positions, replica.span)
            except PoolExhausted:
                log.warning(
                    "replica pool full (%d blocks): not replicating microbatch %d; a failure of stage %d re-runs "
                    "its prompt", replica.cache.pool.max_blocks, mb_id, self.source_stage,
                )  # fmt: skip
                self.drop(mb_id)
                return None
        else:
            layout = replica.layout.holding(positions, replica.span)
            with self.lock:
                replica.layout = layout
        return replica

    # -- what recovery and memory accounting read ------------------------------------------
    def microbatches(self) -> set[int]:
        with self.lock:
            return set(self.replicas)

    def watermark(self, mb_id: int) -> int:
        with self.lock:
            replica = self.replicas.get(mb_id)
            return replica.step if replica is not None else -1

    def retire_rows(self, mb_id: int, running: tuple[int, ...]) -> None:
        """Return the blocks of ``mb_id``'s rows not in ``running``: their requests ended (this stage's pass
        of the microbatch left them out, so no stage computes them again)."""
        replica = self.replicas.get(mb_id)
        cache = replica.cache if replica is not None else None
        if cache is None:
            return
        done = [r for r, live in enumerate(cache.live) if live and r not in running]
        if done:
            cache.free_rows(done)

    def memory_caches(self) -> list[PagedKVCache]:
        """The replicas held in host memory (none with ``disk``). Never waits for the lock: the heartbeat
        asks on its way to renewing the lease (a snapshot of the dict is atomic)."""
        return [r.cache for r in list(self.replicas.values()) if r.cache is not None]

    def restorable(self, mb_ids: Iterable[int]) -> Iterator[tuple[int, KVCache | PagedKVCache, int]]:
        """(microbatch, cache, watermark) of each of ``mb_ids`` held here, for a replaced predecessor,
        one at a time: the host cache, or one gathered back from the disk transport's chunks in the
        order they came (so only one is in memory at once). A replica that cannot be read back is
        forgotten, its watermark with it, so recovery re-runs that microbatch's prompt."""
        for mb in sorted(set(mb_ids)):
            with self.lock:
                replica = self.replicas.get(mb)
                if replica is None or replica.step < 0:
                    continue
                cache, chunks, step, layout = replica.cache, list(replica.chunks), replica.step, replica.layout
            if cache is None:
                try:
                    cache = self._gather(layout, chunks)
                except (DejaVuLibError, OSError, ValueError, RuntimeError) as exc:
                    log.error("replica of microbatch %d not readable from disk (%s): its prompt re-runs", mb, exc)
                    self.drop(mb)
                    continue
            yield mb, cache, step

    def _gather(self, layout: KVLayout, chunks: list[tuple[int, Region]]) -> KVCache:
        assert self.disk is not None
        cache = KVCache.allocate(layout, "cpu")
        for key, region in chunks:
            buf = torch.empty(region.nbytes(layout), dtype=torch.uint8)
            self.disk.fetch(self.disk.self_id, key, buf, 0.0)  # written before it was recorded: never waits
            cache.unpack(region, buf)
        return cache

    def drop(self, mb_id: int, finished: bool = False) -> None:
        """Forget the replica of ``mb_id`` (its watermark and chunks too). ``finished``: it never comes
        back, so a replica of it still on its way is ignored (unlike a prompt re-run after recovery)."""
        with self.lock:
            if finished:
                self._finished.append(mb_id)
            replica = self.replicas.pop(mb_id, None)
            if replica is not None and replica.cache is not None:
                replica.cache.free()  # its blocks go back to the pool now
            if replica is not None and self.disk is not None:
                for key, _ in replica.chunks:
                    self.disk.discard(self.disk.self_id, key)
        self.redis.hdel(keys.watermark(self.source_stage), mb_id)
        self.redis.hdel(keys.watermark_signatures(self.source_stage), mb_id)

    def close(self) -> None:
        """Forget every replica and remove this worker's replica folder (its chunks are of no use to a
        later process); a message still arriving is ignored."""
        with self.lock:
            self._closed = True
            for replica in self.replicas.values():
                if replica.cache is not None:
                    replica.cache.free()
            self.replicas.clear()
            if self.disk is not None:
                _empty(self.disk.root)
                with contextlib.suppress(OSError):
                    self.disk.root.rmdir()
            if self._lease is not None:
                self._lease.release()
                self._lease = None


def _empty(folder: Path) -> None:
    """Remove the chunk files in ``folder`` (and a temporary one a killed process left mid-write)."""
    for path in folder.iterdir():
        if path.is_file():
            path.unlink(missing_ok=True)
