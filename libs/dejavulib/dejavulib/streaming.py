"""High-level primitives (paper Table 1): ``stream_out`` / ``stream_in`` of KV between workers.

The pure placement (``topology.plan_pieces``) says which rectangles of a prompt batch go where;
``stream_out`` submits them (optionally one layer at a time, :class:`LayerStreamer`, as prefill computes
each layer) to the :class:`Streamer`, which packs each region off the compute thread and sends it with a
header carrying the *destination* place (microbatch, layers, rows, shifted positions, stage in ``user``).
On the receiving side :func:`region_of` reads that place from a message's authenticated header and
:func:`stream_in` scatters the payload into the destination cache (the buffered copy's unpack).
The same header-addressed regions carry replication and restores (``Streamer.submit_region``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from dejavulib.endpoint import Message
from dejavulib.errors import IntegrityError, ProtocolError
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import Region, Which
from dejavulib.streamer import Streamer
from dejavulib.topology import Transfer


def stream_out(
    streamer: Streamer,
    cache: KVCache,
    transfers: Iterable[Transfer],
    peers: Mapping[int, str],
    deadline_s: float,
    layers: tuple[int, int] | None = None,
    channel: Channel = Channel.KV_PROMPT,
    step: int = 0,
) -> list[Handle]:
    """Submit ``transfers`` of ``cache`` (restricted to global ``layers`` if given); ``peers`` maps a
    destination stage to its peer id. Returns one handle per message, in submission order."""
    handles = []
    for t in transfers:
        lo, hi = t.layers if layers is None else (max(t.layers[0], layers[0]), min(t.layers[1], layers[1]))
        if lo >= hi:
            continue
        region = Region(0, (lo, hi), t.src_rows, t.positions, Which.KV)
        header = Header(channel, microbatch=t.dst_microbatch, step=step, layers=(lo, hi), rows=t.dst_rows,
                        positions=t.dst_positions, user=t.dst_stage)  # fmt: skip
        handles.append(streamer.submit_region(peers[t.dst_stage], header, cache, region, deadline_s))
    return handles


def region_of(header: Header) -> Region:
    """Where a KV message's payload belongs: the destination region its header names. Raises
    ``ProtocolError`` for a header that names no region (a marker, or a message of another kind)."""
    try:
        return Region(header.microbatch, header.layers, header.rows, header.positions, Which(header.which))
    except ValueError as exc:
        raise ProtocolError(f"a {header.channel.name} message names no KV region: {exc}") from exc


def stream_in(cache: KVCache, message: Message, region: Region | None = None) -> Region:
    """Scatter a KV ``message`` into ``cache`` at the region its header names (or ``region``, the same
    shape elsewhere); returns that region. Raises ``IntegrityError`` when the payload is not exactly
    the region's bytes in the cache's layout, ``ValueError`` when the region lies outside the cache."""
    region = region or region_of(message.header)
    nbytes = region.nbytes(cache.layout)
    if nbytes != message.header.nbytes or nbytes != message.payload.nbytes:
        raise IntegrityError(f"region {region} needs {nbytes} bytes, the message has {message.payload.nbytes}")
    cache.unpack(region, torch.from_numpy(message.payload))
    return region


class LayerStreamer:
    """Layer-by-layer prompt streaming: the engine calls ``on_layer_done(layer)`` after computing each layer,
    and that layer's KV leaves on the streaming thread while the next layer computes."""

    def __init__(self, streamer: Streamer, cache: KVCache, transfers: Iterable[Transfer], peers: Mapping[int, str],
                 deadline_s: float) -> None:  # fmt: skip
        self._args = (streamer, cache, list(transfers), peers, deadline_s)
        self.handles: list[Handle] = []

    def on_layer_done(self, layer: int) -> None:
        """Submit global layer ``layer``'s KV (returns at once unless back-pressure blocks)."""
        self.handles.extend(stream_out(*self._args, layers=(layer, layer + 1)))

    def wait(self, timeout_s: float | None = None) -> None:
        """Until every submitted layer has been delivered; raises the first failure."""
        for handle in self.handles:
            handle.wait(timeout_s)
