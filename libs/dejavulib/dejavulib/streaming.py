"""High-level primitives (paper Table 1): ``stream_out`` / ``stream_in`` of prompt KV between pipelines.

The pure planner (``topology.plan_transfers``) says which rectangles go where; these functions move
them: ``stream_out`` submits, for one source (stage, microbatch), every transfer's region to the
``Streamer`` (optionally only some layers, for layer-by-layer streaming), with a header carrying the
*destination* coordinates (microbatch, rows, shifted positions). ``stream_in`` receives until its
destination caches hold every byte the plan sends them, scattering each message where its header says.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from dejavulib.endpoint import Endpoint
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
    src_stage: int,
    src_microbatch: int,
    peers: Mapping[int, str],
    deadline_s: float,
    layers: tuple[int, int] | None = None,
    channel: Channel = Channel.KV_PROMPT,
    step: int = 0,
) -> list[Handle]:
    """Submit this (stage, microbatch)'s transfers, restricted to ``layers`` if given; ``peers`` maps a
    destination stage to its peer id. Returns one handle per message, in submission order."""
    handles = []
    for t in transfers:
        if (t.src_stage, t.src_microbatch) != (src_stage, src_microbatch):
            continue
        lo, hi = t.layers if layers is None else (max(t.layers[0], layers[0]), min(t.layers[1], layers[1]))
        if lo >= hi:
            continue
        region = Region(src_microbatch, (lo, hi), t.src_rows, t.positions, Which.KV)
        header = Header(channel, microbatch=t.dst_microbatch, step=step, layers=(lo, hi), rows=t.dst_rows,
                        positions=t.dst_positions, user=t.dst_stage)  # fmt: skip
        handles.append(streamer.submit_region(peers[t.dst_stage], header, cache, region, deadline_s))
    return handles


def expected_bytes(transfers: Iterable[Transfer], caches: Mapping[int, KVCache], dst_stage: int) -> int:
    """Bytes the plan sends to ``dst_stage``'s microbatches in ``caches``."""
    total = 0
    for t in transfers:
        if t.dst_stage == dst_stage and t.dst_microbatch in caches:
            region = Region(t.dst_microbatch, t.layers, t.dst_rows, t.dst_positions, Which.KV)
            total += region.nbytes(caches[t.dst_microbatch].layout)
    return total


def stream_in(
    endpoint: Endpoint,
    caches: Mapping[int, KVCache],
    transfers: Iterable[Transfer],
    dst_stage: int,
    deadline_s: float,
    channel: Channel = Channel.KV_PROMPT,
) -> int:
    """Receive into ``caches`` (destination microbatch -> cache) every byte the plan sends ``dst_stage``.

    Returns the number of messages received. Raises ``TransferTimeout`` if they do not all arrive within
    ``deadline_s``, ``ProtocolError`` for a message addressed elsewhere, ``IntegrityError`` for a payload
    that does not match its region.
    """
    left_bytes = expected_bytes(transfers, caches, dst_stage)
    end, received = time.monotonic() + deadline_s, 0
    while left_bytes > 0:
        message = endpoint.recv(channel, max(0.0, end - time.monotonic()))
        h = message.header
        if h.user != dst_stage or h.microbatch not in caches:
            raise ProtocolError(f"KV for stage {h.user} microbatch {h.microbatch} arrived at stage {dst_stage}")
        cache = caches[h.microbatch]
        region = Region(h.microbatch, h.layers, h.rows, h.positions, Which(h.which))
        if region.nbytes(cache.layout) != h.nbytes:
            raise IntegrityError(f"region {region} needs {region.nbytes(cache.layout)} bytes, got {h.nbytes}")
        cache.unpack(region, torch.from_numpy(message.payload))
        left_bytes -= h.nbytes
        received += 1
    return received


class LayerStreamer:
    """Layer-by-layer prompt streaming: the engine calls ``on_layer_done(layer)`` after computing each layer,
    and that layer's KV leaves on the streaming thread while the next layer computes."""

    def __init__(self, streamer: Streamer, cache: KVCache, transfers: Iterable[Transfer], src_stage: int,
                 src_microbatch: int, peers: Mapping[int, str], deadline_s: float) -> None:  # fmt: skip
        self._args = (streamer, cache, list(transfers), src_stage, src_microbatch, peers, deadline_s)
        self.handles: list[Handle] = []

    def on_layer_done(self, layer: int) -> None:
        """Submit global layer ``layer``'s KV (returns at once unless back-pressure blocks)."""
        self.handles.extend(stream_out(*self._args, layers=(layer, layer + 1)))

    def wait(self, timeout_s: float | None = None) -> None:
        """Until every submitted layer has been delivered; raises the first failure."""
        for handle in self.handles:
            handle.wait(timeout_s)
