"""The paged KV pool of a token stage: fixed-size blocks, taken as tokens are written, returned at once.

A stage's pool holds K and V in *blocks* of ``block_size`` positions of every layer of the stage
(:class:`BlockGeometry`). Blocks live in *slabs* (``[layers, slab_blocks, kv_heads, block_size,
head_dim]`` per tensor) added as the pool fills, up to ``max_blocks``: memory follows use, and nothing is
reserved by a request's ``max_tokens``. Block id ``b`` is index ``b % slab_blocks`` of slab
``b // slab_blocks``.

A microbatch's cache in the pool (:class:`PagedKVCache`) keeps the coordinates of a contiguous
:class:`~dejavulib.kvcache.KVCache` (rows, left-padded positions, the same ``KVLayout``), so every KV
message, region and geometry means what it meant: only where the bytes sit changed. Its *block table*
maps row ``r``'s logical block ``i`` (positions ``[i * block_size, (i + 1) * block_size)``) to a block of the
pool; blocks wholly inside a row's left padding are never taken, and a finished row's blocks go back to
the pool at once (:meth:`PagedKVCache.free_rows`), the rest when the microbatch ends (:meth:`PagedKVCache.free`,
or when the cache object is collected: a block cannot outlive the cache that took it).

``pack`` / ``unpack`` gather and scatter a region through the table with one indexed copy per slab,
so DejaVuLib's streaming (prompt KV, replication, restores) addresses blocks directly.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from dejavulib.kvcache import KVCache, torch_dtype, typed_prefix
from dejavulib.layout import KVLayout, Region, Which


class PoolExhausted(RuntimeError):
    """The pool has no free block left within its ``max_blocks`` (admission should have waited)."""


@dataclass(frozen=True)
class BlockGeometry:
    """One block of a stage's pool: ``block_size`` positions of K and of V for ``layers`` layers (global
    ``[first_layer, first_layer + layers)``), ``kv_heads`` heads of ``head_dim``."""

    layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str = "float32"
    first_layer: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "block_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BlockGeometry.{name} must be positive, got {getattr(self, name)}")
        torch_dtype(self.dtype)  # raises KeyError for an unknown dtype

    @classmethod
    def of(cls, layout: KVLayout, block_size: int) -> BlockGeometry:
        """The blocks of caches of ``layout``'s layers and heads."""
        return cls(layout.layers, layout.kv_heads, block_size, layout.head_dim, layout.dtype, layout.first_layer)

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across the stage's layers."""
        return 2 * self.layers * self.kv_heads * self.block_size * self.head_dim * self.itemsize

    def blocks(self, positions: int) -> int:
        """Logical blocks covering positions ``[0, positions)``."""
        return math.ceil(positions / self.block_size)

    def first_block(self, pad: int) -> int:
        """The first logical block holding a token of a row left-padded by ``pad`` positions."""
        return pad // self.block_size

    def slots(self, positions: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Where positions ``[p0, p1)`` of a row sit: each position's logical block and its offset in it."""
        p0, p1 = positions
        if not 0 <= p0 < p1:
            raise ValueError(f"positions {positions} must be a non-empty range from 0")
        logical = torch.arange(p0, p1)
        return logical // self.block_size, logical % self.block_size

    def slab_shape(self, slab_blocks: int) -> tuple[int, int, int, int, int]:
        return (self.layers, slab_blocks, self.kv_heads, self.block_size, self.head_dim)


class BlockPool:
    """Up to ``max_blocks`` blocks of ``geometry`` on ``device`` (rounded down to whole slabs), in slabs of
    ``slab_blocks`` added as needed.
    Thread-safe: prompt KV is placed on a receiver thread while the compute thread takes blocks."""

    def __init__(
        self, geometry: BlockGeometry, max_blocks: int, slab_blocks: int = 64, device: str | torch.device = "cpu"
    ) -> None:
        if max_blocks <= 0 or slab_blocks <= 0:
            raise ValueError(f"a pool needs blocks: max_blocks={max_blocks}, slab_blocks={slab_blocks}")
        self.geometry = geometry
        self.slab_blocks = min(slab_blocks, max_blocks)
        # Whole slabs only: a remainder could never be made, and counting it as free would admit work the
        # pool cannot hold.
        self.max_blocks = max_blocks - max_blocks % self.slab_blocks
        self.device = torch.device(device)
        self.k_slabs: list[torch.Tensor] = []
        self.v_slabs: list[torch.Tensor] = []
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # notified when blocks come back
        self._layer_views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def allocated_blocks(self) -> int:
        """Blocks whose memory exists (the slabs made so far)."""
        return len(self.k_slabs) * self.slab_blocks

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return self.allocated_blocks - len(self._free)

    @property
    def free_blocks(self) -> int:
        """Blocks that can still be taken (free in a slab, or in slabs not made yet)."""
        with self._lock:
            return self.max_blocks - (self.allocated_blocks - len(self._free))

    # -- blocks ---------------------------------------------------------------------------------------
    def allocate(self, n: int, wait_s: float = 0.0) -> list[int]:
        """``n`` free block ids, waiting up to ``wait_s`` for other caches to return blocks; raises
        :class:`PoolExhausted` (taking none) when fewer are left then."""
        if n <= 0:
            return []
        end = time.monotonic() + wait_s
        with self._returned:
            while True:
                while len(self._free) < n and self.allocated_blocks + self.slab_blocks <= self.max_blocks:
                    self._add_slab()
                if len(self._free) >= n:
                    taken, self._free = self._free[-n:], self._free[:-n]
                    return taken
                left = end - time.monotonic()
                if left <= 0:
                    raise PoolExhausted(f"{n} KV blocks wanted, {len(self._free)} free of {self.max_blocks}")
                self._returned.wait(left)

    def ensure(self, ids: Iterable[int]) -> None:
        """Make the slabs that hold block ``ids``: for a pool whose blocks a book allocates
        (``dejavu_common.sched.BlockBook``: ids ``[0, max_blocks)``, the pool only their memory), in which case
        :meth:`allocate` and :meth:`free` are not used. Raises ValueError for an id past ``max_blocks``."""
        top = max(ids, default=-1)
        if top >= self.max_blocks:
            raise ValueError(f"block {top} is past the pool's {self.max_blocks} blocks")
        with self._lock:
            while self.allocated_blocks <= top:
                self._add_slab()

    def free(self, ids: list[int]) -> None:
        """Return blocks to the pool."""
        if ids:
            with self._returned:
                self._free.extend(ids)
                self._returned.notify_all()

    def _add_slab(self) -> None:
        shape, dtype = self.geometry.slab_shape(self.slab_blocks), torch_dtype(self.geometry.dtype)
        first = self.allocated_blocks
        # Zeroed: a padding slot is read (masked) by the torch attention path, and 0 x NaN would be NaN.
        self.k_slabs.append(torch.zeros(shape, dtype=dtype, device=self.device))
        self.v_slabs.append(torch.zeros(shape, dtype=dtype, device=self.device))
        self._free.extend(range(first + self.slab_blocks - 1, first - 1, -1))  # lowest ids first
        self._layer_views.clear()

    def layer(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Local layer ``index``'s K and V slabs (``[slab_blocks, kv_heads, block_size, head_dim]`` each,
        contiguous): what the paged attention kernel reads."""
        with self._lock:  # slabs are added under the lock: never a K list longer than the V list
            views = self._layer_views.get(index)
            if views is None:
                views = ([s[index] for s in self.k_slabs], [s[index] for s in self.v_slabs])
                self._layer_views[index] = views
            return views

    def cache(self, layout: KVLayout, pad_lens: tuple[int, ...] | None = None) -> PagedKVCache:
        """An empty cache in this pool for a microbatch of ``layout`` (rows, span) whose rows are left
        padded by ``pad_lens`` (no blocks are taken for padding)."""
        return PagedKVCache(self, layout, pad_lens)

    def _slots(self, which: Which) -> list[torch.Tensor]:
        return self.k_slabs if which == Which.K else self.v_slabs


def _release(pool: BlockPool, table: torch.Tensor) -> None:
    held = table[table >= 0]
    if held.numel():
        pool.free(held.tolist())
    table.fill_(-1)


class PagedKVCache:
    """A microbatch's KV cache held in a :class:`BlockPool`: the coordinates of a contiguous ``KVCache`` of
    ``layout`` (``layout.max_len`` is the microbatch's whole span), the bytes in pool blocks taken by
    :meth:`holding` as positions are written."""

    def __init__(self, pool: BlockPool, layout: KVLayout, pad_lens: tuple[int, ...] | None = None) -> None:
        g = pool.geometry
        if (layout.layers, layout.kv_heads, layout.head_dim, layout.dtype, layout.first_layer) != (
            g.layers, g.kv_heads, g.head_dim, g.dtype, g.first_layer,
        ):  # fmt: skip
            raise ValueError(f"layout {layout} does not fit the pool's blocks {g}")
        self.pool = pool
        self.layout = layout
        self.pad_lens = tuple(pad_lens) if pad_lens is not None else (0,) * layout.batch
        if len(self.pad_lens) != layout.batch:
            raise ValueError(f"{len(self.pad_lens)} pad lengths for {layout.batch} rows")
        self.table = torch.full((layout.batch, g.blocks(layout.max_len)), -1, dtype=torch.long)
        self.live = [True] * layout.batch  # rows whose blocks are kept (a finished row's are returned)
        self.filled = 0  # positions [0, filled) have blocks in every live row
        self.closed = False
        self.evictions = 0  # times the cache was moved to host memory to make room (see evict)
        self.discards = 0  # times its positions were forgotten to make room, to be recomputed (see discard)
        self._host: KVCache | None = None  # positions [0, filled) while evicted
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _release, pool, self.table)

    @classmethod
    def view(cls, pool: BlockPool, layout: KVLayout, table: Sequence[int], filled: int) -> PagedKVCache:
        """A one-row cache over blocks someone else owns (a pool whose ids a book hands out: table entry ``i``
        holds positions ``[i * block_size, (i + 1) * block_size)``, a negative entry none), holding positions
        ``[0, filled)``: what moves a request's KV through the library (replication, restores). It never takes
        or returns a block."""
        if layout.batch != 1 or len(table) * pool.geometry.block_size < layout.max_len:
            raise ValueError(f"a view is one row whose table covers its {layout.max_len} positions")
        cache = cls(pool, layout)
        cache._finalizer.detach()
        n = cache.table.shape[1]
        cache.table[0] = torch.tensor([max(b, -1) for b in table[:n]], dtype=torch.long)
        cache.filled = filled
        cache.closed = True  # holding() never takes blocks for it
        return cache

    # -- what a KVCache offers ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def block_size(self) -> int:
        return self.pool.geometry.block_size

    @property
    def blocks_held(self) -> int:
        return int((self.table >= 0).sum())

    @property
    def nbytes(self) -> int:
        """Bytes of K and V this cache holds: its blocks, or its host copy while evicted."""
        host = self._host
        return self.blocks_held * self.pool.geometry.bytes_per_block + (host.nbytes if host is not None else 0)

    def local(self, global_layer: int) -> int:
        """Index along the first dimension of a global layer index."""
        return self.layout.local(global_layer)

    def whole(self, microbatch: int = 0) -> Region:
        """Every layer and row, positions ``[0, filled)``: what the cache holds (a restore sends it)."""
        return self.layout.region(positions=(0, max(1, self.filled)), microbatch=microbatch)

    def packed_shape(self, region: Region) -> tuple[int, ...]:
        return self.layout.packed_shape(region)

    # -- blocks -------------------------------------------------------------------------------------------
    def blocks_needed(self, positions: int) -> int:
        """Blocks :meth:`holding` would take to hold ``positions`` positions in every live row."""
        g = self.pool.geometry
        need = min(g.blocks(positions), self.table.shape[1])
        return sum(
            int((self.table[r, g.first_block(pad) : need] < 0).sum())
            for r, pad in enumerate(self.pad_lens)
            if self.live[r]
        )

    @property
    def evicted(self) -> bool:
        """Whether the cache's positions are in host memory and its blocks back in the pool (see evict)."""
        return self._host is not None

    def evict(self) -> int:
        """Make room in the pool: move positions ``[0, filled)`` to host memory and return every block.
        The next :meth:`holding` takes blocks again and moves them back; ``pack`` and ``unpack`` meanwhile
        read and write the host copy. Returns the blocks returned (0 for a cache holding none)."""
        with self._lock:
            if self.closed or self._host is not None or self.filled == 0 or self.blocks_held == 0:
                return 0
            dense = self.dense(self.filled)
            self._host = KVCache(dense.layout, dense.k.cpu(), dense.v.cpu())
            held = self.table[self.table >= 0]
            self.table.fill_(-1)
            self.evictions += 1
        self.pool.free(held.tolist())
        return int(held.numel())

    def discard(self) -> int:
        """Make room by forgetting: return every block and drop any host copy, keeping the cache's rows and
        coordinates (its owner recomputes positions ``[0, p)`` into it, taking blocks again through
        :meth:`holding`). Returns the blocks returned."""
        with self._lock:
            if self.closed:
                return 0
            held = self.table[self.table >= 0]
            self.table.fill_(-1)
            self._host, self.filled = None, 0
            self.discards += 1
        self.pool.free(held.tolist())
        return int(held.numel())

    def _restore(self, wait_s: float) -> None:
        """Take blocks for positions ``[0, filled)`` and move the host copy back (with the lock held)."""
        host, self._host = self._host, None
        assert host is not None
        filled, self.filled = self.filled, 0
        try:
            self.holding(filled, wait_s=wait_s)
        except BaseException:
            self._host, self.filled = host, filled
            raise
        self.write_back(KVCache(host.layout, host.k.to(self.device), host.v.to(self.device)), (0, filled))

    def holding(self, positions: int, span: int | None = None, wait_s: float = 0.0) -> PagedKVCache:
        """This cache, with blocks taken so every live row holds positions ``[pad, positions)`` (an evicted
        cache's host copy moved back first). Raises ValueError past the span, ``PoolExhausted`` (taking
        nothing) when the pool is still short after ``wait_s``."""
        if positions > self.layout.max_len or (span is not None and positions > span):
            raise ValueError(f"{positions} positions exceed the span of {self.layout.max_len}")
        with self._lock:
            if self._host is not None:
                self._restore(wait_s)
            if positions <= self.filled:
                return self
            if self.closed:
                raise ValueError("the cache was freed: its microbatch ended")
            g = self.pool.geometry
            if self.filled == 0 or g.blocks(positions) > g.blocks(self.filled):  # else: within blocks taken
                upto = g.blocks(positions)
                wanted = [
                    (r, b)
                    for r, pad in enumerate(self.pad_lens)
                    if self.live[r]
                    for b in range(g.first_block(pad), upto)
                    if self.table[r, b] < 0
                ]
                if wanted:
                    ids = self.pool.allocate(len(wanted), wait_s)
                    rows, blocks = zip(*wanted, strict=True)
                    self.table[list(rows), list(blocks)] = torch.tensor(ids, dtype=torch.long)
            self.filled = positions
        return self

    def free_rows(self, rows: list[int] | tuple[int, ...]) -> None:
        """Return the blocks of ``rows`` (finished: never computed again) to the pool."""
        with self._lock:
            for r in rows:
                self.live[r] = False
            held = self.table[list(rows)]
            ids = held[held >= 0].tolist()
            self.table[list(rows)] = -1
        self.pool.free(ids)

    def free(self) -> None:
        """Return every block to the pool; the cache holds nothing from now on. Idempotent."""
        with self._lock:
            self.closed = True
            self._host = None
            self.live = [False] * self.layout.batch
            self._finalizer()

    # -- region copies ------------------------------------------------------------------------------------
    def _slots(self, region: Region, position_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids and offsets of the region's (row, position) cells, row-major, ``[rows * positions]``."""
        p0, p1 = region.positions[0] + position_offset, region.positions[1] + position_offset
        if p0 < 0 or p1 > self.layout.max_len:
            raise ValueError(f"positions {(p0, p1)} outside max_len {self.layout.max_len}")
        logical, offsets = self.pool.geometry.slots((p0, p1))
        blocks = self.table[region.rows[0] : region.rows[1]][:, logical]
        return blocks.reshape(-1), offsets.repeat(region.n_rows)

    def pack(self, region: Region, out: torch.Tensor) -> torch.Tensor:
        """Gather ``region`` into the front of contiguous ``out`` in ``KVCache.pack``'s order
        (``[which][layer][row][head][position][head_dim]``); positions without a block read as zeros."""
        region.check_within(self.layout)
        with self._lock:
            if self._host is not None:
                return self._host.pack(region, out)
            return self._pack(region, out)

    def _pack(self, region: Region, out: torch.Tensor) -> torch.Tensor:
        packed = typed_prefix(out, self.packed_shape(region), torch_dtype(self.layout.dtype))
        for i, which in enumerate(region.tensors):
            self._read(region, which, packed[i])
        return packed

    def _read(self, region: Region, which: Which, out: torch.Tensor) -> None:
        """Gather ``region`` of the ``which`` tensor into ``out`` (``[layers, rows, heads, positions, dim]``)."""
        blocks, offsets = self._slots(region)
        l0, l1 = self.local(region.layers[0]), self.local(region.layers[1] - 1) + 1
        cells = self._gather(self.pool._slots(which), l0, l1, blocks, offsets)  # [cells, L, H, D]
        shape = (region.n_rows, region.n_positions, region.n_layers, self.layout.kv_heads, self.layout.head_dim)
        out.copy_(cells.view(shape).permute(2, 0, 3, 1, 4))

    def _write(self, region: Region, which: Which, src: torch.Tensor, position_offset: int = 0) -> None:
        """Scatter ``src`` (``[layers, rows, heads, positions, dim]``) into ``region`` of the ``which`` tensor,
        shifted by ``position_offset``; cells without a block are skipped."""
        blocks, offsets = self._slots(region, position_offset)
        l0, l1 = self.local(region.layers[0]), self.local(region.layers[1] - 1) + 1
        cells = src.permute(1, 3, 0, 2, 4).reshape(-1, region.n_layers, self.layout.kv_heads, self.layout.head_dim)
        self._scatter(self.pool._slots(which), l0, l1, blocks, offsets, cells)

    def unpack(self, region: Region, data: torch.Tensor, position_offset: int = 0) -> None:
        """Scatter packed ``data`` (as ``pack`` produces it) into ``region`` shifted by ``position_offset``;
        positions without a block (a row's padding, a finished row) are skipped."""
        region.check_within(self.layout)
        with self._lock:
            if self._host is not None:  # evicted: the host copy takes it (grown to hold it), blocks come later
                end = region.positions[1] + position_offset
                self._host = self._host.holding(end, self.layout.max_len)
                self._host.unpack(region, data, position_offset)
                self.filled = max(self.filled, end)
                return
            self._unpack(region, data, position_offset)

    def _unpack(self, region: Region, data: torch.Tensor, position_offset: int) -> None:
        packed = typed_prefix(data, self.packed_shape(region), torch_dtype(self.layout.dtype))
        for i, which in enumerate(region.tensors):
            self._write(region, which, packed[i], position_offset)

    def _gather(
        self, slabs: list[torch.Tensor], l0: int, l1: int, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        per = self.pool.slab_blocks
        if slabs and bool((blocks >= 0).all()) and int(blocks.max()) < per:  # the common case: one slab
            return slabs[0][l0:l1, blocks, :, offsets, :]
        g = self.pool.geometry
        out = torch.zeros(
            (blocks.numel(), l1 - l0, g.kv_heads, g.head_dim), dtype=torch_dtype(g.dtype), device=self.device
        )
        for s, slab in enumerate(slabs):
            sel = ((blocks >= s * per) & (blocks < (s + 1) * per)).nonzero().squeeze(1)
            if sel.numel():
                out[sel] = slab[l0:l1, blocks[sel] - s * per, :, offsets[sel], :]
        return out

    def _scatter(
        self,
        slabs: list[torch.Tensor],
        l0: int,
        l1: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        cells: torch.Tensor,
    ) -> None:
        per = self.pool.slab_blocks
        for s, slab in enumerate(slabs):
            sel = ((blocks >= s * per) & (blocks < (s + 1) * per)).nonzero().squeeze(1)
            if sel.numel():
                slab[l0:l1, blocks[sel] - s * per, :, offsets[sel], :] = cells[sel].to(slab.device)

    # -- the engine's contiguous view ---------------------------------------------------------------------
    def dense(self, positions: int) -> KVCache:
        """A contiguous copy of positions ``[0, positions)`` of every layer and row (padding reads as
        zeros): what the engine's torch attention computes on where the paged kernel does not apply."""
        dense = KVCache.allocate(replace(self.layout, max_len=positions), self.device)
        region = dense.whole()
        with self._lock:
            if self._host is not None:  # evicted: from the host copy
                buf = torch.empty(region.nbytes(dense.layout), dtype=torch.uint8)
                dense.unpack(region, self._host.pack(region, buf).to(self.device))
            else:
                for which in region.tensors:
                    self._read(region, which, dense.tensor(which))
        return dense

    def write_back(self, dense: KVCache, positions: tuple[int, int]) -> None:
        """Copy positions ``[p0, p1)`` of ``dense`` (from :meth:`dense`, then computed on) into the blocks."""
        region = dense.layout.region(positions=positions)
        for which in region.tensors:
            self._write(region, which, dense.view(region, which))
