"""The block book of one paged KV pool: which block ids are free, who references them, which hold a prefix.

Books only: no tensors. A pool has ``num_blocks`` blocks of ``block_size`` positions; a request's block table
lists the ids holding its positions in order. Every stage of a pipeline keeps the same block ids for the same
positions, so one book (kept by the pipeline's first stage) speaks for all of them.

Prefix caching. A *full* block is named by a hash chain over the token ids it holds: ``H_i = sha256(H_{i-1} ||
ids of block i)``, seeded by the pool's namespace (model, dtype, block size: whatever makes equal ids give other KV)
and a request's extra key (a cache salt, an adapter). A block is entered into the cache only once its KV is written
(:meth:`BlockBook.commit`), never when it is scheduled, so a hit never reads unwritten KV. Blocks are shared by
reference count. A block whose count drops to zero goes to the free list but keeps its hash, so a later request with
the same prefix hits it again; the free list is least recently used first, and a free block is evicted (its hash
forgotten) only when it is handed out again. A request returns its blocks tail first, so its last blocks, the least
likely to be shared, are evicted first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_IDS = struct.Struct("<I")

FREED = -1
"""A block table's entry for a block its request gave back while running (every position it held is out of the
sliding window of every query still to come): no block id, never read. A table keeps its length, so position ``p``
stays at entry ``p // block_size``; freed entries are always its leading ones."""


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (callers check :meth:`BlockBook.can_allocate` first)."""


def chain_hashes(token_ids: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """The hash of every *full* block of ``token_ids`` (a partial last block has none), chained from ``seed``."""
    hashes: list[bytes] = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        for token in token_ids[start : start + block_size]:
            h.update(_IDS.pack(token & 0xFFFFFFFF))
        parent = h.digest()
        hashes.append(parent)
    return hashes


@dataclass
class _Block:
    ref: int = 0
    hash: bytes | None = None


@dataclass(frozen=True)
class BookStats:
    """A snapshot for metrics: blocks in use, free, and of the free ones those still holding a cached prefix."""

    total: int
    used: int
    free: int
    cached_free: int  # free blocks that still hold a prefix (evictable hits)
    shared: int  # blocks referenced by more than one request
    queries: int  # prefix-cache lookups, in tokens
    hits: int  # of which found cached, in tokens


class BlockBook:
    """The books of one pool; every method is O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, namespace: bytes = b"", caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks of >= 1 position, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.caching = caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently used first
        self._cached: dict[bytes, int] = {}  # hash -> the block holding it
        self._queries = 0
        self._hits = 0

    # -- queries ----------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks that can be handed out now (free ones holding a cached prefix included)."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def seed(self, extra_key: bytes = b"") -> bytes:
        """The chain's seed for a request with ``extra_key`` (tagged, so no extra key collides with another)."""
        return hashlib.sha256(b"dejavu-blocks\0" + self.namespace + b"\0extra\0" + extra_key).digest()

    def hashes(self, token_ids: Sequence[int], extra_key: bytes = b"") -> list[bytes]:
        return chain_hashes(token_ids, self.block_size, self.seed(extra_key))

    def cached_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The ids of the leading blocks of ``hashes`` the pool holds, at most ``max_blocks``; references
        nothing (see :meth:`attach`)."""
        found: list[int] = []
        if not self.caching:
            return found
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def idle(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` nobody references (attaching them takes them off the free list)."""
        return sum(1 for b in blocks if self._blocks[b].ref == 0)

    def count_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admission's lookup (the metrics' queries and hits, in tokens)."""
        self._queries += queried_tokens
        self._hits += hit_tokens

    def stats(self) -> BookStats:
        """Safe from another thread (a metrics scrape): it counts over copies of the free list and the blocks, each
        taken in one step."""
        free, blocks = list(self._free), list(self._blocks)
        cached_free = sum(1 for b in free if blocks[b].hash is not None)
        shared = sum(1 for b in blocks if b.ref > 1)
        return BookStats(self.num_blocks, self.num_blocks - len(free), len(free), cached_free, shared, self._queries,
                         self._hits)  # fmt: skip

    def ref(self, block: int) -> int:
        return self._blocks[block].ref

    def hash_of(self, block: int) -> bytes | None:
        return self._blocks[block].hash

    # -- changes ----------------------------------------------------------------------------------
    def attach(self, blocks: Iterable[int]) -> None:
        """Reference cached blocks (a prefix hit): each leaves the free list if it was there."""
        for b in blocks:
            block = self._blocks[b]
            if block.hash is None:
                raise ValueError(f"block {b} holds no cached prefix")
            if block.ref == 0:
                del self._free[b]
            block.ref += 1

    def adopt(self, blocks: Iterable[int]) -> None:
        """Reference blocks whose KV outlived the book that handed them out (a new stage 0 taking a pipeline's
        requests over after a repair): each leaves the free list; a block named twice (a prefix two requests share)
        is referenced twice. Raises ValueError for an id outside the pool (nothing referenced then)."""
        blocks = list(blocks)
        if any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"blocks {blocks} are not all of a pool of {self.num_blocks}")
        for b in blocks:
            block = self._blocks[b]
            if block.ref == 0:
                del self._free[b]
            block.ref += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (referenced once), least recently used first; a cached one forgets its prefix."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked for, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            block = self._blocks[b]
            if block.hash is not None:
                if self._cached.get(block.hash) == b:
                    del self._cached[block.hash]
                block.hash = None
            block.ref = 1
            out.append(b)
        return out

    def release(self, table: Sequence[int]) -> None:
        """Drop one reference to each block of ``table`` (a request's table), tail first; a block nobody
        references goes to the free list, its cached prefix kept until it is handed out again."""
        for b in reversed(table):
            block = self._blocks[b]
            if block.ref <= 0:
                raise ValueError(f"block {b} is released more often than it was referenced")
            block.ref -= 1
            if block.ref == 0:
                self._free[b] = None

    def share(self, table: Sequence[int]) -> None:
        """One more reference to each block of ``table`` (a fork shares its parent's full blocks)."""
        for b in table:
            block = self._blocks[b]
            if block.ref <= 0:
                raise ValueError(f"block {b} is free: only referenced blocks can be shared")
            block.ref += 1

    def forget_cached(self) -> None:
        """Forget every cached prefix (a stage's KV was lost, as when a new worker took a stage over): no later
        lookup hits a block written before; referenced blocks stay referenced."""
        for b in self._blocks:
            b.hash = None
        self._cached.clear()

    def commit(self, block: int, block_hash: bytes) -> None:
        """Block ``block`` now holds the full prefix named ``block_hash`` (its KV is written): later requests
        with that prefix may hit it. An equal block already cached stays the one hits find."""
        if not self.caching:
            return
        b = self._blocks[block]
        if b.ref <= 0:
            raise ValueError(f"block {block} is free: only a referenced, written block can be cached")
        if b.hash == block_hash:
            return
        if b.hash is not None and self._cached.get(b.hash) == block:
            del self._cached[b.hash]
        b.hash = block_hash
        self._cached.setdefault(block_hash, block)
