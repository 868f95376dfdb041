"""Microbatch swapping on a token stage (the paper's "Microbatch swapping", Figure 12).

A token stage of a pipeline of depth ``D`` has ``D`` microbatches in flight but computes one at a
time. :class:`SwapManager` keeps every in-flight microbatch's KV cache in host memory (pinned when
the device is CUDA) and owns only two microbatch-sized device buffers (one when ``D <= 2``). Per
step of microbatch ``x`` the token worker does::

    cache = swap.acquire(x)            # waits for x's swap-in (never hands out a stale buffer)
    swap.prefetch(next_x, filled)      # background swap-in of the next microbatch, overlapping compute
    stage.decode(io, cache, geometry)  # writes position geometry.cur_len - 1
    swap.commit(x, (p, p + 1))         # copy back only the new positions, free the buffer

Swap-in copies the filled prefix ``[0, filled)`` of the host cache into a free device buffer on a
background thread (on CUDA, on a side stream). Swap-out is a buffered copy: the written positions of
all layers, rows and heads are gathered on the device into one reusable staging buffer, moved to the
host in one transfer and scattered into the host cache there.

On a CPU-only host the device and host pools are separate tensors in the same memory: the same code
runs (and is tested), but nothing is saved and the "transfers" are memory copies.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

from dejavu_common.errors import DeadlineExceeded, FatalError
from dejavu_common.kv_budget import resident_microbatches
from dejavulib.kvcache import KVCache, StagingBuffer, torch_dtype
from dejavulib.layout import KVLayout

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]
"""``copy(dst, src)``: one transfer between the host and the device pools (swap-in and swap-out)."""


def default_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, asynchronous where CUDA allows it (callers synchronize)."""
    dst.copy_(src, non_blocking=True)


class SwapState(enum.Enum):
    """Where a microbatch's cache is. Legal moves: HOST -> QUEUED -> LOADING -> READY -> IN_USE -> HOST,
    QUEUED/LOADING -> FAILED; :meth:`SwapManager.drop` removes a microbatch from any state."""

    HOST = "host"  # only the host copy exists
    QUEUED = "queued"  # a swap-in was requested, waiting for a free device buffer
    LOADING = "loading"  # being copied into a device buffer
    READY = "ready"  # on the device, not yet acquired
    IN_USE = "in_use"  # acquired by the compute thread
    FAILED = "failed"  # the swap-in raised; acquire re-raises it


_LEGAL: dict[SwapState, frozenset[SwapState]] = {
    SwapState.HOST: frozenset({SwapState.QUEUED}),
    SwapState.QUEUED: frozenset({SwapState.LOADING, SwapState.FAILED}),
    SwapState.LOADING: frozenset({SwapState.READY, SwapState.FAILED}),
    SwapState.READY: frozenset({SwapState.IN_USE, SwapState.HOST}),  # READY -> HOST: evicted unused
    SwapState.IN_USE: frozenset({SwapState.HOST}),
    SwapState.FAILED: frozenset(),
}


class SwapStateError(FatalError):
    """A call that does not fit the microbatch's swap state (a bug in the caller)."""


class SwapInError(FatalError):
    """A swap-in raised on the prefetch thread; the original exception is the cause."""


@dataclass(frozen=True)
class SwapStats:
    """Cumulative transfer counters. ``acquire_wait_s`` is compute time lost waiting for swap-ins."""

    swap_ins: int = 0
    swap_in_bytes: int = 0
    swap_in_s: float = 0.0
    swap_outs: int = 0
    swap_out_bytes: int = 0
    swap_out_s: float = 0.0
    acquire_wait_s: float = 0.0

    def plus(self, **deltas: float) -> SwapStats:
        """These counters with ``deltas`` added to the named fields."""
        return SwapStats(**{f.name: getattr(self, f.name) + deltas.get(f.name, 0) for f in fields(self)})


@dataclass
class _Entry:
    """Mutable bookkeeping of one microbatch; guarded by the manager's condition."""

    host: KVCache
    state: SwapState = SwapState.HOST
    filled: int = 0  # positions the pending swap-in copies
    slot: int | None = None
    error: BaseException | None = None

    def move(self, mb_id: int, to: SwapState) -> None:
        if to not in _LEGAL[self.state]:
            raise SwapStateError(f"microbatch {mb_id}: illegal swap transition {self.state.value} -> {to.value}")
        self.state = to


class _CudaSeam:
    """The CUDA-only parts: pinned host memory, a side stream for swap-ins, stream syncs. Inert elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.enabled else None

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run the body's copies on the side stream and wait for them, so the data is complete after it."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def sync_compute(self) -> None:
        """Wait for the compute stream (its kernels may still use a buffer about to be freed or read)."""
        if self.enabled:
            torch.cuda.current_stream(self.device).synchronize()


class SwapManager:
    """Host-resident KV caches of a token stage's in-flight microbatches, swapped through a few device buffers.

    ``layout`` is the largest microbatch cache the stage serves (its layers, heads, head_dim, dtype);
    each microbatch's own layout must match it except for ``batch`` and ``max_len``, and fit its size.
    ``depth`` is the token pipeline depth ``D``: the manager holds ``min(D, 2)`` device buffers, one when
    ``D <= 2``. ``copy`` performs every host/device transfer (inject a slow one to test waiting).

    Threads: :meth:`prefetch`, :meth:`add`, :meth:`drop` and the accessors may be called from any
    thread; :meth:`acquire` and :meth:`commit` belong to the one compute thread. One background thread
    performs swap-ins in the order they were requested: prefetch in the order the stage will compute.
    Every wait has a deadline (``deadline_s``) and raises :class:`DeadlineExceeded`. Call :meth:`close`
    (or use the manager as a context manager) to stop the thread.
    """

    def __init__(
        self,
        layout: KVLayout,
        depth: int,
        device: torch.device | str,
        host_device: torch.device | str = "cpu",
        copy: CopyFn = default_copy,
        deadline_s: float = 30.0,
        staging_positions: int = 1,
    ) -> None:
        if staging_positions < 1:
            raise ValueError(f"staging_positions must be >= 1, got {staging_positions}")
        self.layout = layout
        self.depth = depth
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self.deadline_s = deadline_s
        self._copy = copy
        self._seam = _CudaSeam(self.device)
        self._dtype = torch_dtype(layout.dtype)
        numel = layout.bytes_per_tensor // layout.itemsize
        self._slots = [
            (self._device_empty(numel), self._device_empty(numel))
            for _ in range(resident_microbatches(depth, swapping=True))
        ]
        self._free = deque(range(len(self._slots)))
        self._staging_positions = staging_positions
        self._staging_bytes = layout.batch * layout.bytes_per_token * staging_positions
        self._stage_device = StagingBuffer(self.device)
        self._stage_host = StagingBuffer(self.host_device, pin=self._seam.enabled)
        self._stage_device.get(self._staging_bytes)  # allocated once, up front: commits never exceed it
        self._stage_host.get(self._staging_bytes)
        self._entries: dict[int, _Entry] = {}
        self._queue: deque[int] = deque()
        self._cond = threading.Condition()
        self._stats = SwapStats()
        self._closed = False
        self._thread = threading.Thread(target=self._prefetch_loop, name="kv-swap-in", daemon=True)
        self._thread.start()

    # -- memory -------------------------------------------------------------------------------------

    def _device_empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self._dtype, device=self.device)

    def _host_empty(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self._dtype, device=self.host_device, pin_memory=self._seam.enabled)

    @property
    def slots(self) -> int:
        """Device cache buffers (2, or 1 when the pipeline depth is at most 2)."""
        return len(self._slots)

    @property
    def device_bytes(self) -> int:
        """Everything this manager allocated on the device: the cache buffers and the swap-out staging buffer."""
        return self.slots * self.layout.bytes_total + self._staging_bytes

    @property
    def host_bytes(self) -> int:
        """The host caches of all registered microbatches plus the host staging buffer."""
        with self._cond:
            caches = sum(e.host.layout.bytes_total for e in self._entries.values())
        return caches + self._staging_bytes

    # -- registration -------------------------------------------------------------------------------

    def add(self, mb_id: int, layout: KVLayout) -> KVCache:
        """Register microbatch ``mb_id`` with a zeroed host cache of ``layout``; return that host cache
        (the prompt KV is written into it, e.g. by the streaming library)."""
        self._check_fits(layout)
        numel = layout.bytes_per_tensor // layout.itemsize
        cache = KVCache(layout, self._host_empty(numel).view(layout.shape), self._host_empty(numel).view(layout.shape))
        self.adopt(mb_id, cache)
        return cache

    def adopt(self, mb_id: int, cache: KVCache) -> None:
        """Register an existing host cache (contiguous, on the host device) for ``mb_id``."""
        self._check_fits(cache.layout)
        if cache.device != self.host_device or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            raise ValueError(f"microbatch {mb_id}: a swapped cache must be contiguous on {self.host_device}")
        with self._cond:
            if mb_id in self._entries:
                raise SwapStateError(f"microbatch {mb_id} is already registered")
            self._entries[mb_id] = _Entry(cache)

    def drop(self, mb_id: int) -> None:
        """Forget ``mb_id`` in whatever state (finished, cancelled, failed); frees its device buffer.

        A swap-in in progress finishes into its buffer, which the prefetch thread then frees. Dropping an
        acquired microbatch belongs to the compute thread (its buffer is freed at once).
        """
        with self._cond:
            entry = self._entries.pop(mb_id, None)
            if entry is None:
                return
            if entry.state is SwapState.QUEUED:
                self._queue.remove(mb_id)
            elif entry.state in (SwapState.READY, SwapState.IN_USE):
                if entry.state is SwapState.IN_USE:
                    self._seam.sync_compute()
                self._release(entry)

    def host(self, mb_id: int) -> KVCache:
        """The host cache of ``mb_id`` (always the up-to-date copy outside acquire..commit)."""
        return self._entry(mb_id).host

    def state(self, mb_id: int) -> SwapState:
        return self._entry(mb_id).state

    def free_slots(self) -> int:
        """Device buffers neither loading, loaded nor in use."""
        with self._cond:
            return len(self._free)

    def make_room(self, keep: int) -> None:
        """Evict loaded-but-unused caches other than ``keep`` until a device buffer is free or being
        freed. A swap-in that guessed the next microbatch wrong must not hold a buffer forever; the
        host copy is still current (nothing computed on the evicted buffer), so nothing is copied back."""
        with self._cond:
            if self._free:
                return
            for mb_id, entry in self._entries.items():
                if mb_id != keep and entry.state is SwapState.READY:
                    entry.move(mb_id, SwapState.HOST)
                    self._release(entry)
                    return

    def stats(self) -> SwapStats:
        with self._cond:
            return self._stats

    # -- the step protocol --------------------------------------------------------------------------

    def prefetch(self, mb_id: int, filled: int) -> None:
        """Start copying positions ``[0, filled)`` of ``mb_id``'s host cache to a device buffer; returns at once.

        A repeated call for a pending swap-in of the same ``filled`` is a no-op.
        """
        with self._cond:
            entry = self._entry(mb_id)
            if not 0 <= filled <= entry.host.layout.max_len:
                raise ValueError(f"filled {filled} outside [0, {entry.host.layout.max_len}]")
            pending = (SwapState.QUEUED, SwapState.LOADING, SwapState.READY)
            if entry.state in pending and entry.filled == filled:
                return
            entry.move(mb_id, SwapState.QUEUED)
            entry.filled = filled
            self._queue.append(mb_id)
            self._cond.notify_all()

    def acquire(self, mb_id: int, deadline_s: float | None = None) -> KVCache:
        """The device-resident cache of ``mb_id``, once its swap-in has completed.

        Waits for an in-flight swap-in (raises :class:`DeadlineExceeded` after ``deadline_s``) and
        re-raises a failed one as :class:`SwapInError` (the microbatch then stays FAILED until dropped).
        Requires an earlier :meth:`prefetch`.
        """
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        start = time.perf_counter()
        with self._cond:
            entry = self._entry(mb_id)
            if entry.state is SwapState.HOST:
                raise SwapStateError(f"microbatch {mb_id}: acquire without a prefetch")
            while entry.state in (SwapState.QUEUED, SwapState.LOADING):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(
                        f"swap-in of microbatch {mb_id} still {entry.state.value} after the deadline"
                    )
                self._cond.wait(left)
                entry = self._entry(mb_id)
            if entry.state is SwapState.FAILED:
                raise SwapInError(f"swap-in of microbatch {mb_id} failed: {entry.error}") from entry.error
            entry.move(mb_id, SwapState.IN_USE)
            self._stats = self._stats.plus(acquire_wait_s=time.perf_counter() - start)
            return self._device_view(entry)

    def commit(self, mb_id: int, positions: tuple[int, int]) -> None:
        """Copy positions ``[p0, p1)`` of the acquired device cache back to the host cache (buffered copy,
        never the whole cache), then free its device buffer. ``p0 == p1`` copies nothing."""
        with self._cond:
            entry = self._entry(mb_id)
            if entry.state is not SwapState.IN_USE:
                raise SwapStateError(f"microbatch {mb_id}: commit while {entry.state.value}")
        p0, p1 = positions
        if not 0 <= p0 <= p1 <= entry.host.layout.max_len:
            raise ValueError(f"positions {positions} outside [0, {entry.host.layout.max_len}]")
        start = time.perf_counter()
        self._swap_out(self._device_view(entry), entry.host, p0, p1)
        with self._cond:
            self._stats = self._stats.plus(
                swap_outs=1,
                swap_out_bytes=(p1 - p0) * entry.host.layout.batch * entry.host.layout.bytes_per_token,
                swap_out_s=time.perf_counter() - start,
            )
            if self._entries.get(mb_id) is entry:
                entry.move(mb_id, SwapState.HOST)
                self._release(entry)

    def close(self, deadline_s: float = 10.0) -> None:
        """Stop the prefetch thread (after its current copy); raises :class:`DeadlineExceeded` if it hangs."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            raise DeadlineExceeded(f"swap-in thread still running {deadline_s} s after close")

    def __enter__(self) -> SwapManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------

    def _entry(self, mb_id: int) -> _Entry:
        entry = self._entries.get(mb_id)
        if entry is None:
            raise SwapStateError(f"microbatch {mb_id} is not registered")
        return entry

    def _check_fits(self, layout: KVLayout) -> None:
        m = self.layout
        same = (layout.layer_range, layout.kv_heads, layout.head_dim, layout.dtype)
        if same != (m.layer_range, m.kv_heads, m.head_dim, m.dtype):
            raise ValueError(f"layout {layout} does not match the stage's {m} (layers, heads, head_dim, dtype)")
        if layout.batch > m.batch or layout.bytes_total > m.bytes_total:
            raise ValueError(
                f"a microbatch of {layout.batch} rows x {layout.max_len} positions does not fit the "
                f"device buffers ({m.batch} rows x {m.max_len} positions)"
            )

    def _device_view(self, entry: _Entry) -> KVCache:
        """The microbatch's cache as a contiguous view at the start of its device buffer."""
        assert entry.slot is not None
        layout = entry.host.layout
        numel = layout.bytes_per_tensor // layout.itemsize
        k, v = self._slots[entry.slot]
        return KVCache(layout, k[:numel].view(layout.shape), v[:numel].view(layout.shape))

    def _release(self, entry: _Entry) -> None:
        """Return the entry's buffer to the free list (caller holds the condition)."""
        if entry.slot is not None:
            self._free.append(entry.slot)
            entry.slot = None
            self._cond.notify_all()

    def _prefetch_loop(self) -> None:
        """Background thread: swap in queued microbatches, in order, as device buffers free up."""
        while True:
            with self._cond:
                while not self._closed and not (self._queue and self._free):
                    self._cond.wait(1.0)  # bounded, so a missed notify cannot hang the thread
                if self._closed:
                    return
                mb_id = self._queue.popleft()
                entry = self._entries[mb_id]
                entry.slot = self._free.popleft()
                entry.move(mb_id, SwapState.LOADING)
            self._load(mb_id, entry)

    def _load(self, mb_id: int, entry: _Entry) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            self._swap_in(entry.host, self._device_view(entry), entry.filled)
        except Exception as exc:  # handed to the compute thread through acquire
            error = exc
        elapsed = time.perf_counter() - start
        with self._cond:
            if self._entries.get(mb_id) is not entry:  # dropped while loading
                self._release(entry)
                return
            if error is not None:
                entry.error = error
                entry.move(mb_id, SwapState.FAILED)
                self._release(entry)
                return
            entry.move(mb_id, SwapState.READY)
            nbytes = entry.filled * entry.host.layout.batch * entry.host.layout.bytes_per_token
            self._stats = self._stats.plus(swap_ins=1, swap_in_bytes=nbytes, swap_in_s=elapsed)
            self._cond.notify_all()

    def _swap_in(self, host: KVCache, device: KVCache, filled: int) -> None:
        """Copy the filled prefix of K and V (long contiguous runs of ``filled * head_dim`` elements)."""
        if filled == 0:
            return
        with self._seam.side_stream():
            self._copy(device.k[:, :, :, :filled], host.k[:, :, :, :filled])
            self._copy(device.v[:, :, :, :filled], host.v[:, :, :, :filled])

    def _swap_out(self, device: KVCache, host: KVCache, p0: int, p1: int) -> None:
        """Buffered copy of positions ``[p0, p1)`` (dejavulib's pack / unpack): gather every layer, row and
        head of those positions on the device into the staging buffer, one transfer, scatter on the host."""
        self._seam.sync_compute()  # the step's kernels must have written the positions
        for a in range(p0, p1, self._staging_positions):
            region = host.layout.region(positions=(a, min(a + self._staging_positions, p1)))
            nbytes = region.nbytes(host.layout)
            staged = device.pack(region, self._stage_device.get(nbytes))
            landed = self._stage_host.get(nbytes).view(staged.dtype).view(staged.shape)
            self._copy(landed, staged)
            self._seam.sync_compute()  # the transfer ran on the compute stream
            host.unpack(region, landed)
