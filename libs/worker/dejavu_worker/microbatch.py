"""A worker's view of one token microbatch: its spec, its stage cache, and how far its prompt KV arrived."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded, FatalError
from dejavu_common.messages import MicrobatchSpec
from dejavu_engine.geometry import BatchGeometry
from dejavu_worker.rows import RowTracker
from dejavulib.endpoint import Message
from dejavulib.kvcache import KVCache
from dejavulib.layout import Region
from dejavulib.paged import PagedKVCache
from dejavulib.streaming import stream_in


def fetch_spec(
    client: redis.Redis, mb_id: int, deadline_s: float, abandon: Callable[[], bool] | None = None
) -> MicrobatchSpec:
    """The controller's spec of ``mb_id``; raises :class:`DeadlineExceeded` if it does not appear in time,
    or as soon as ``abandon()`` is true while waiting (a newer epoch: the spec may never come back, as after
    a Redis restart, and the worker must move on to the new epoch instead of sitting out the deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        raw = client.get(keys.microbatch(mb_id))
        if raw is not None:
            return MicrobatchSpec.decode(raw)
        if time.monotonic() > end:
            raise DeadlineExceeded(f"no spec for microbatch {mb_id} after {deadline_s} s")
        if abandon is not None and abandon():
            raise DeadlineExceeded(f"stopped waiting for the spec of microbatch {mb_id}: the epoch changed")
        time.sleep(0.005)


class KVStatus(enum.Enum):
    """Where a microbatch's KV is on a stage. Legal moves: RECEIVING -> READY (its prompt KV, a colocated
    prefill or a restore is complete), READY <-> PREEMPTED (paged: moved to host memory to make room, back
    when next computed), READY or PREEMPTED -> DISCARDED (paged: forgotten to make room when host memory
    is short too; a recompute pass takes blocks again and rewrites every position: DISCARDED -> READY), and
    any -> RELEASED (finished, failed or dropped: its memory is back, and nothing brings it back)."""

    RECEIVING = "receiving"
    READY = "ready"
    PREEMPTED = "preempted"
    DISCARDED = "discarded"
    RELEASED = "released"


_LEGAL: dict[KVStatus, frozenset[KVStatus]] = {
    KVStatus.RECEIVING: frozenset({KVStatus.READY, KVStatus.RELEASED}),
    KVStatus.READY: frozenset({KVStatus.PREEMPTED, KVStatus.DISCARDED, KVStatus.RELEASED}),
    KVStatus.PREEMPTED: frozenset({KVStatus.READY, KVStatus.DISCARDED, KVStatus.RELEASED}),
    KVStatus.DISCARDED: frozenset({KVStatus.READY, KVStatus.RELEASED}),
    KVStatus.RELEASED: frozenset(),
}


class IllegalKVTransition(FatalError):
    """A move of a microbatch's KV status that its state machine does not allow (a bug in the caller)."""


@dataclass
class MicrobatchState:
    """Stage-local state of a token microbatch, its one object on this stage: its spec, its cache (this
    stage's layers only), how far its KV arrived, its status, and (last stage) its rows' progress."""

    spec: MicrobatchSpec
    cache: KVCache | PagedKVCache
    expected_cells: int  # (layers x rows) of prompt KV this stage must receive before decoding
    cells: set[tuple[int, int]] = field(default_factory=set)  # (global layer, row) received: re-sends count once
    complete: threading.Event = field(default_factory=threading.Event)  # set on READY: what waiters wait for
    lock: threading.Lock = field(default_factory=threading.Lock)
    status: KVStatus = KVStatus.RECEIVING
    done_step: int = -1  # the last step whose KV this stage holds (0: prompt)
    pool_wait_s: float = 0.0  # how long placing prompt KV waits for a paged pool's blocks
    last_pass: int = 0  # the stage's pass count when this microbatch was last computed
    prompt_replicated: bool = False
    tracker: RowTracker | None = None  # last stage: per-row progress (what each step emits, when rows stop)

    def _move(self, to: KVStatus) -> None:
        """Change the status (with the lock held); READY sets ``complete``."""
        if to is self.status:
            return
        if to not in _LEGAL[self.status]:
            raise IllegalKVTransition(f"microbatch {self.mb_id}: {self.status.value} -> {to.value}")
        self.status = to
        if to is KVStatus.READY:
            self.complete.set()

    def release(self) -> None:
        """The microbatch leaves this stage: its cache's memory goes back now (a paged pool's blocks)."""
        with self.lock:
            self._move(KVStatus.RELEASED)
            if isinstance(self.cache, PagedKVCache):
                self.cache.free()

    def preempt(self) -> int:
        """Move a READY microbatch's paged cache to host memory, returning its blocks to the pool (the next
        :meth:`ensure_capacity` brings it back). Returns the blocks returned (0: nothing to move)."""
        with self.lock:
            if self.status is not KVStatus.READY or not isinstance(self.cache, PagedKVCache):
                return 0
            freed = self.cache.evict()
            if freed:
                self._move(KVStatus.PREEMPTED)
            return freed

    def discard(self) -> int:
        """Forget a READY or PREEMPTED microbatch's paged KV (its blocks back to the pool, no host copy): a
        recompute pass rewrites every position before it decodes again. Returns the blocks returned."""
        with self.lock:
            if self.status not in (KVStatus.READY, KVStatus.PREEMPTED) or not isinstance(self.cache, PagedKVCache):
                return 0
            freed = self.cache.discard()
            self._move(KVStatus.DISCARDED)
            return freed

    @property
    def holds_kv(self) -> bool:
        """Whether this stage holds the microbatch's KV up to ``done_step`` (complete, not discarded)."""
        return self.complete.is_set() and self.status in (KVStatus.READY, KVStatus.PREEMPTED)

    @property
    def mb_id(self) -> int:
        return self.spec.mb_id

    def geometry(self, step: int) -> BatchGeometry:
        """Geometry of the forward pass producing step ``step`` (0: the prefill; s >= 1: decode step s)."""
        return BatchGeometry(self.spec.pad_lens, self.spec.prompt_len + step)

    def ensure_capacity(self, positions: int) -> None:
        """Grow the cache to hold ``positions`` positions (at most the spec's ``max_len``): caches start
        at the prompt plus a little and double as tokens are written, so nothing is reserved for a
        budget the request never uses. Call with no pass of this microbatch running."""
        with self.lock:
            if self.status is KVStatus.RELEASED:
                raise ValueError(f"microbatch {self.mb_id} was released on this stage")
            self.cache = self.cache.holding(positions, self.spec.max_len)  # a preempted paged cache moves back
            if self.status in (KVStatus.PREEMPTED, KVStatus.DISCARDED):
                self._move(KVStatus.READY)

    def place(self, region: Region, message: Message) -> None:
        """Scatter a KV message (prompt KV, a restore) into ``region`` of the cache, grown to hold it
        (any thread). Raises ``IntegrityError`` / ``ValueError`` for a message that does not fit."""
        with self.lock:
            if isinstance(self.cache, PagedKVCache):  # blocks other microbatches return may be waited for
                self.cache.holding(region.positions[1], self.spec.max_len, wait_s=self.pool_wait_s)
            else:
                self.cache = self.cache.holding(region.positions[1], self.spec.max_len)  # refuses past the span
            stream_in(self.cache, message, region)

    def add_prompt_cells(self, layers: tuple[int, int], rows: tuple[int, int]) -> None:
        """Record a received prompt-KV chunk; sets ``complete`` (and ``done_step = 0``) once every
        (layer, row) of this stage arrived. Idempotent: a re-sent chunk counts once."""
        with self.lock:
            self.cells.update((layer, row) for layer in range(*layers) for row in range(*rows))
            if len(self.cells) >= self.expected_cells and self.status is KVStatus.RECEIVING:
                self.done_step = max(self.done_step, 0)
                self._move(KVStatus.READY)

    def mark_complete(self, step: int = 0) -> None:
        """The cache holds the prompt (a colocated prefill, or a restore up to ``step``)."""
        with self.lock:
            self.done_step = max(self.done_step, step)
            if self.status is KVStatus.RECEIVING:
                self._move(KVStatus.READY)

    def wait_complete(self, deadline_s: float) -> None:
        if not self.complete.wait(deadline_s):
            raise DeadlineExceeded(
                f"prompt KV of microbatch {self.mb_id} incomplete after {deadline_s} s "
                f"({len(self.cells)}/{self.expected_cells} cells)"
            )
