"""Token-level KV replication: stage x streams its cache updates to stage (x + 1) mod D_t.

The sender side ships the prompt part once, then after every decode step the one position that
step wrote (all of the stage's layers, rows and heads: one buffered transfer). The receiver keeps
the predecessor's caches in host memory and, once a chunk for microbatch j up to step t is
written, records the watermark (x, j, t) in Redis, so the controller knows how far every replica
reaches. With ``replication = disk`` or ``both`` the receiver also appends each chunk to a file per
(stage, microbatch) under ``replica_dir`` (persistent replicas).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import redis

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.private import ensure_private_dir
from dejavu_common.settings import Replication
from dejavu_engine.kv_cache import KVCache
from dejavu_worker.dataplane import KVChunk, decode_chunks, encode_chunks
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.microbatch import MicrobatchState, fetch_spec
from dejavulib.layout import KVLayout

log = logging.getLogger("dejavu.token_worker.replication")


class ReplicaSender:
    """Ships this stage's KV updates to its successor (no-op when replication is off or D_t == 1)."""

    def __init__(self, endpoint: DataEndpoint, peer: str | None) -> None:
        self.endpoint = endpoint
        self.peer = peer

    def send(self, state: MicrobatchState, step: int, positions: tuple[int, int]) -> None:
        """Replicate positions [positions) of ``state``'s cache, as of ``step``."""
        self.send_pass([(state, step, positions)])

    def send_pass(self, written: list[tuple[MicrobatchState, int, tuple[int, int]]]) -> None:
        """Replicate what one pass wrote, every member at once: one buffered copy, one message."""
        if self.peer is None or not written:
            return
        chunks = []
        for state, step, (p0, p1) in written:
            cache = state.cache
            chunks.append(
                KVChunk(
                    mb_id=state.mb_id,
                    layers=cache.layout.layer_range,
                    rows=(0, cache.layout.batch),
                    positions=(p0, p1),
                    k=cache.k[:, :, :, p0:p1],
                    v=cache.v[:, :, :, p0:p1],
                    step=step,
                )
            )
        self.endpoint.send(self.peer, Channel.KV_REPLICA, encode_chunks(chunks))


class ReplicaStore:
    """The predecessor's caches, kept in host memory; a background thread receives into it."""

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
    ) -> None:
        self.redis = client
        self.abandon = abandon  # stops a wait for a spec once a newer epoch exists
        self.endpoint = endpoint
        self.source_stage = source_stage
        self.source_layers = source_layers
        self.mode = mode
        self.replica_dir = replica_dir
        self.deadline_s = deadline_s
        self.kv_heads, self.head_dim, self.dtype = head_geometry
        self.caches: dict[int, KVCache] = {}
        self.steps: dict[int, int] = {}  # per microbatch, its watermark: the last step held contiguously
        self.ahead: dict[int, set[int]] = {}  # steps held past a hole in the steps (not yet contiguous)
        self.spans: dict[int, int] = {}  # each microbatch's whole span (its spec's max_len)
        self.lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        """Receive replica chunks until ``stop`` is set."""
        while not stop.is_set():
            payload = self.endpoint.recv(Channel.KV_REPLICA, timeout_s=0.1)
            if payload is None:
                continue
            try:
                for chunk in decode_chunks(payload):
                    self.store(chunk)
            except (ValueError, KeyError, IndexError, RuntimeError, DeadlineExceeded) as exc:
                log.error("dropped a replica chunk: %s", exc)

    def store(self, chunk: KVChunk) -> None:
        if tuple(chunk.layers) != self.source_layers:
            raise ValueError(f"replica chunk layers {chunk.layers} are not stage {self.source_stage}'s")
        cache = self._cache(chunk.mb_id, chunk.positions)
        if cache is None:
            return
        sl = (slice(None), slice(*chunk.rows), slice(None), slice(*chunk.positions))
        cache.k[sl].copy_(chunk.k)
        cache.v[sl].copy_(chunk.v)
        with self.lock:  # drop() takes the lock too: a released microbatch's file and watermark never come back
            if chunk.mb_id not in self.caches:
                return
            if self.mode in (Replication.DISK, Replication.BOTH):
                self._append_to_disk(chunk)
            before = self.steps.get(chunk.mb_id, -1)
            step = self._contiguous(chunk)
            if step != before:
                self.redis.hset(keys.watermark(self.source_stage), chunk.mb_id, step)

    def _contiguous(self, chunk: KVChunk) -> int:
        """Record ``chunk`` and return the microbatch's watermark: the last step up to which *every* step
        is held. A chunk from position 0 (the prompt, or a whole cache restored as of a step) holds every
        step up to its own; a decode step's chunk holds its step only. A step that arrives past a hole
        (a chunk lost on the way) waits above the watermark until the hole is filled, so a restore never
        serves the hole as data: recovery resumes from before it instead. Call with the lock held."""
        mb = chunk.mb_id
        step = self.steps.get(mb, -1)
        ahead = self.ahead.setdefault(mb, set())
        if chunk.positions[0] == 0 or chunk.step <= step + 1:
            step = max(step, chunk.step)
        else:
            log.warning("replica of microbatch %d: step %d arrived past a hole after step %d", mb, chunk.step, step)
            ahead.add(chunk.step)
        while step + 1 in ahead:
            step += 1
        ahead.difference_update(range(step + 1))
        self.steps[mb] = step
        return step

    def _cache(self, mb_id: int, chunk_positions: tuple[int, int]) -> KVCache | None:
        """The replica of ``mb_id``, holding at least the chunk's positions: like the primary, it starts
        small and doubles up to the microbatch's span. None for a later step of a microbatch not held
        here: a replica starts with its prompt (FIFO per sender), so that is one released meanwhile (it
        finished), and it must not come back."""
        positions = chunk_positions[1]
        with self.lock:
            cache = self.caches.get(mb_id)
            if cache is None and chunk_positions[0] > 0:
                log.debug("ignored a replica step of released microbatch %d", mb_id)
                return None
            if cache is None:
                spec = fetch_spec(self.redis, mb_id, self.deadline_s, self.abandon)
                a, b = self.source_layers
                size = min(spec.max_len, max(positions, spec.prompt_len + 64))
                layout = KVLayout(b - a, len(spec.rows), self.kv_heads, size, self.head_dim, self.dtype, a)
                cache = self.caches[mb_id] = KVCache.allocate(layout, "cpu")
                self.spans[mb_id] = spec.max_len
            else:
                cache = self.caches[mb_id] = cache.holding(positions, self.spans[mb_id])
            return cache

    def _append_to_disk(self, chunk: KVChunk) -> None:
        ensure_private_dir(self.replica_dir)  # replicas are KV caches: not in a folder others can read or plant in
        path = self.replica_dir / f"stage{self.source_stage}-mb{chunk.mb_id}.kv"
        with path.open("ab") as f:
            f.write(chunk.encode())

    def drop(self, mb_id: int) -> None:
        with self.lock:
            self.caches.pop(mb_id, None)
            self.steps.pop(mb_id, None)
            self.ahead.pop(mb_id, None)
            self.spans.pop(mb_id, None)
        self.redis.hdel(keys.watermark(self.source_stage), mb_id)
        (self.replica_dir / f"stage{self.source_stage}-mb{mb_id}.kv").unlink(missing_ok=True)
