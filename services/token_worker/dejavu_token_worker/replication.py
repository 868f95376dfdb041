"""Token-level KV replication: stage x streams its cache updates to stage (x + 1) mod D_t.

The sender side ships the prompt part once, then after every decode step the one position that
step wrote (all of the stage's layers, rows and heads: one region, packed by DejaVuLib's streaming
thread into one buffered transfer, its header naming the microbatch, positions and step). The receiver keeps
the predecessor's caches in host memory and, once a chunk for microbatch j up to step t is
written, records the watermark (x, j, t) in Redis, so the controller knows how far every replica
reaches. With ``replication = disk`` or ``both`` the receiver also appends each chunk to a file per
(stage, microbatch) under ``replica_dir`` (persistent replicas).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import redis

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.private import ensure_private_dir
from dejavu_common.settings import Replication
from dejavu_worker.dataplane import frame
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.microbatch import MicrobatchState, fetch_spec
from dejavulib.endpoint import Message
from dejavulib.errors import DejaVuLibError
from dejavulib.header import Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout, Region
from dejavulib.streaming import region_of, stream_in

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
        # Microbatches released as finished: a replica of theirs still on its way must not revive them.
        self._finished: collections.deque[int] = collections.deque(maxlen=_FINISHED_REMEMBERED)
        self.lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        """Receive replica messages until ``stop`` is set."""
        while not stop.is_set():
            message = self.endpoint.recv_message(Channel.KV_REPLICA, timeout_s=0.1)
            if message is None:
                continue
            try:
                self.store(region_of(message.header), message.header.step, message)
            except (ValueError, KeyError, IndexError, RuntimeError, DeadlineExceeded, DejaVuLibError) as exc:
                log.error("dropped a replica message: %s", exc)

    def store(self, region: Region, step: int, message: Message) -> None:
        """Keep ``message`` (the predecessor's KV of ``region`` as of ``step``) and advance the watermark."""
        if tuple(region.layers) != self.source_layers:
            raise ValueError(f"replica layers {region.layers} are not stage {self.source_stage}'s")
        mb = region.microbatch
        cache = self._cache(mb, region.positions)
        if cache is None:
            return
        stream_in(cache, message, region)
        with self.lock:  # drop() takes the lock too: a released microbatch's file and watermark never come back
            if mb not in self.caches:
                return
            if self.mode in (Replication.DISK, Replication.BOTH):
                self._append_to_disk(region, step, message)
            before = self.steps.get(mb, -1)
            held = self._contiguous(mb, region.positions, step)
            if held != before:
                self.redis.hset(keys.watermark(self.source_stage), mb, held)

    def _contiguous(self, mb: int, positions: tuple[int, int], chunk_step: int) -> int:
        """Record a replica of ``positions`` as of ``chunk_step`` and return the microbatch's watermark:
        the last step up to which *every* step is held. A region from position 0 (the prompt, or a whole
        cache restored as of a step) holds every step up to its own; a decode step's region holds its
        step only. A step that arrives past a hole (a message lost on the way) waits above the watermark
        until the hole is filled, so a restore never serves the hole as data: recovery resumes from
        before it instead. Call with the lock held."""
        step = self.steps.get(mb, -1)
        ahead = self.ahead.setdefault(mb, set())
        if positions[0] == 0 or chunk_step <= step + 1:
            step = max(step, chunk_step)
        else:
            log.warning("replica of microbatch %d: step %d arrived past a hole after step %d", mb, chunk_step, step)
            ahead.add(chunk_step)
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
            if cache is None and (chunk_positions[0] > 0 or mb_id in self._finished):
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

    def _append_to_disk(self, region: Region, step: int, message: Message) -> None:
        ensure_private_dir(self.replica_dir)  # replicas are KV caches: not in a folder others can read or plant in
        path = self.replica_dir / f"stage{self.source_stage}-mb{region.microbatch}.kv"
        meta = {"layers": list(region.layers), "rows": list(region.rows), "positions": list(region.positions),
                "step": step, "dtype": self.dtype, "nbytes": message.payload.nbytes}  # fmt: skip
        with path.open("ab") as f:  # a record: the framed place, then the packed K/V bytes
            f.write(frame({"region": meta}, None))
            f.write(memoryview(message.payload))

    def drop(self, mb_id: int, finished: bool = False) -> None:
        """Forget the replica of ``mb_id`` (its watermark and file too). ``finished``: it never comes back,
        so a replica of it still on its way is ignored (unlike a prompt re-run after recovery)."""
        with self.lock:
            if finished:
                self._finished.append(mb_id)
            self.caches.pop(mb_id, None)
            self.steps.pop(mb_id, None)
            self.ahead.pop(mb_id, None)
            self.spans.pop(mb_id, None)
        self.redis.hdel(keys.watermark(self.source_stage), mb_id)
        (self.replica_dir / f"stage{self.source_stage}-mb{mb_id}.kv").unlink(missing_ok=True)
