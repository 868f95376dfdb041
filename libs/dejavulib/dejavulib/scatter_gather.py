"""Middle-level primitives (paper Table 1): a non-contiguous KV region as contiguous transfers.

``scatter`` sends a region of a local cache to a peer through a transport's ``flush``; ``gather``
receives it into a local cache through ``fetch``. Two paths, same bytes:

* buffered (``staging`` given): pack the region into one reusable contiguous buffer on the source
  device, move it in ONE transfer under ``key``, unpack at the destination (the paper's 95x win);
* unbuffered (``staging=None``): one transfer per contiguous chunk, under keys ``key, key+1, ...``.

Both sides must use the same path, key, and region shape. Errors are the transport's
(``TransferTimeout``, ``PeerError``, ``IntegrityError``).
"""

from __future__ import annotations

import torch

from dejavulib.chunks import contiguous_runs
from dejavulib.kvcache import KVCache, StagingBuffer
from dejavulib.layout import Region
from dejavulib.transport.base import Transport


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
        transport.flush(peer_id, key, _reachable(transport, packed.reshape(-1)), deadline_s)
        return 1
    n = 0
    for n, run in enumerate(contiguous_runs(cache.layout, region)):
        chunk = cache.tensor(run.which).view(-1)[run.offset : run.offset + run.count]
        transport.flush(peer_id, key + n, _reachable(transport, chunk), deadline_s)
    return n + 1


def gather(
    transport: Transport,
    peer_id: str,
    key: int,
    cache: KVCache,
    region: Region,
    deadline_s: float,
    staging: StagingBuffer | None = None,
    position_offset: int = 0,
) -> int:
    """Receive ``region`` from ``peer_id`` into ``cache`` (positions shifted by ``position_offset``, buffered
    path only); returns the number of transfers made."""
    if staging is not None:
        buf = staging.get(region.nbytes(cache.layout))
        transport.fetch(peer_id, key, buf, deadline_s)
        cache.unpack(region, buf, position_offset)
        return 1
    if position_offset:
        raise ValueError("the unbuffered path moves chunks in place; use the buffered path to shift positions")
    n = 0
    for n, run in enumerate(contiguous_runs(cache.layout, region)):
        chunk = cache.tensor(run.which).view(-1)[run.offset : run.offset + run.count]
        _fetch_into(transport, peer_id, key + n, chunk, deadline_s)
    return n + 1


def _fetch_into(transport: Transport, peer_id: str, key: int, chunk: torch.Tensor, deadline_s: float) -> None:
    if chunk.device.type == "cpu" or transport.moves_device_memory:
        transport.fetch(peer_id, key, chunk, deadline_s)
        return
    # Host transports cannot write device memory: land on the host, then copy.
    host = torch.empty_like(chunk, device="cpu")
    transport.fetch(peer_id, key, host, deadline_s)
    chunk.copy_(host)


def _reachable(transport: Transport, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if the transport can read it, else one copy of it in host memory."""
    return tensor if tensor.device.type == "cpu" or transport.moves_device_memory else tensor.cpu()
