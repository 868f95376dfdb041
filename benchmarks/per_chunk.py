"""The per-chunk baseline of DejaVuLib's buffered copy (paper Table 1's scatter/gather, section 4.3):
``dejavu bench streaming`` section 1 measures one against the other. Serving never moves KV this way.

A region (layers x rows x all heads x positions x whole head_dim) of a contiguous ``KVCache`` tensor is
a set of contiguous element runs (``contiguous_runs``). ``scatter`` sends a region to a peer through a
transport's keyed ``flush``, ``gather`` receives it through ``fetch``; two paths, the same bytes:

* buffered (``staging`` given): ``KVCache.pack`` the region into one reusable contiguous buffer, move it
  in ONE transfer under ``key``, ``KVCache.unpack`` it at the destination: what serving's ``Streamer``
  and ``stream_in`` do with every KV message;
* per chunk (``staging=None``): one transfer per contiguous run, under keys ``key, key+1, ...``.

Both sides must use the same path, key and region. Host tensors only (this benchmark runs on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dejavulib.kvcache import KVCache, StagingBuffer
from dejavulib.layout import KVLayout, Region, Which
from dejavulib.transport.base import Transport


@dataclass(frozen=True)
class Run:
    """``count`` contiguous elements starting at element ``offset`` of the ``which`` tensor."""

    which: Which
    offset: int
    count: int


def contiguous_runs(layout: KVLayout, region: Region) -> Iterator[Run]:
    """The maximal contiguous runs of ``region`` in ``layout``, K runs before V runs: the order the
    buffered path packs the region, so concatenated they are exactly the packed payload."""
    region.check_within(layout)
    _, batch, heads, max_len, head_dim = layout.shape  # element strides of a contiguous LBHSD tensor:
    s_pos, s_head = head_dim, max_len * head_dim
    s_row, s_layer = heads * s_head, batch * heads * s_head
    l0, l1 = (region.layers[0] - layout.first_layer, region.layers[1] - layout.first_layer)
    for which in region.tensors:
        if region.n_rows == layout.batch and region.n_positions == layout.max_len:
            yield Run(which, l0 * s_layer, (l1 - l0) * s_layer)  # whole layers: one run
        elif region.n_positions == layout.max_len:
            for layer in range(l0, l1):  # rows [r0, r1) x all heads x all positions: one run per layer
                yield Run(which, layer * s_layer + region.rows[0] * s_row, region.n_rows * s_row)
        else:
            for layer in range(l0, l1):
                for row in range(*region.rows):
                    for head in range(layout.kv_heads):
                        start = layer * s_layer + row * s_row + head * s_head + region.positions[0] * s_pos
                        yield Run(which, start, region.n_positions * layout.head_dim)


def _chunks(cache: KVCache, region: Region) -> Iterator[torch.Tensor]:
    """The contiguous runs of ``region`` as flat views of ``cache``'s tensors, in packing order."""
    for run in contiguous_runs(cache.layout, region):
        tensor = cache.tensor(run.which)
        if tensor.device.type != "cpu":
            raise ValueError("the per-chunk baseline moves host tensors only")
        yield tensor.view(-1)[run.offset : run.offset + run.count]


def scatter(
    transport: Transport,
    peer_id: str,
    key: int,
    cache: KVCache,
    region: Region,
    deadline_s: float,
    staging: StagingBuffer | None = None,
) -> int:
    """Send ``region`` of ``cache`` to ``peer_id``; returns the number of transfers made."""
    if staging is not None:
        packed = cache.pack(region, staging.get(region.nbytes(cache.layout)))
        transport.flush(peer_id, key, packed.reshape(-1), deadline_s)
        return 1
    chunks = list(_chunks(cache, region))
    for n, chunk in enumerate(chunks):
        transport.flush(peer_id, key + n, chunk, deadline_s)
    return len(chunks)


def gather(
    transport: Transport,
    peer_id: str,
    key: int,
    cache: KVCache,
    region: Region,
    deadline_s: float,
    staging: StagingBuffer | None = None,
) -> int:
    """Receive ``region`` from ``peer_id`` into ``cache``; returns the number of transfers made."""
    if staging is not None:
        buf = staging.get(region.nbytes(cache.layout))
        transport.fetch(peer_id, key, buf, deadline_s)
        cache.unpack(region, buf)
        return 1
    chunks = list(_chunks(cache, region))
    for n, chunk in enumerate(chunks):
        transport.fetch(peer_id, key + n, chunk, deadline_s)
    return len(chunks)


def copy_per_chunk(cache: KVCache, region: Region, dst: torch.Tensor) -> int:
    """The host baseline: one torch copy per contiguous run of ``region`` into ``dst`` (the runs back to
    back, as packed); returns the number of copies."""
    flat, at, n = dst.view(-1), 0, 0
    for chunk in _chunks(cache, region):
        flat[at : at + chunk.numel()].copy_(chunk)
        at, n = at + chunk.numel(), n + 1
    return n


def copy_buffered(cache: KVCache, region: Region, staging: StagingBuffer, dst: torch.Tensor) -> int:
    """The buffered copy on the host: pack ``region`` (one strided copy per tensor), then one copy into
    ``dst``; returns the number of transfers (one)."""
    packed = cache.pack(region, staging.get(region.nbytes(cache.layout)))
    dst.view(-1).copy_(packed.reshape(-1))
    return 1
