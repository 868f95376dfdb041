"""DejaVuLib: KV-cache streaming primitives (stream_out/stream_in; scatter/gather as KVCache.pack/unpack;
transports).

Heavy modules (torch, ucxx) load on first use of their names, so ``import dejavulib`` stays cheap for
the pure parts (layout, topology, header, errors).
"""

from __future__ import annotations

import importlib
from typing import Any

from dejavulib.errors import (
    BackPressureTimeout,
    ClosedError,
    DejaVuLibError,
    IntegrityError,
    PeerError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from dejavulib.header import Channel, DType, Header
from dejavulib.layout import DIM_ORDER, KVLayout, Region, Which
from dejavulib.topology import Piece, Transfer, plan_pieces, right_aligned

_LAZY = {
    "Endpoint": "dejavulib.endpoint",
    "Message": "dejavulib.endpoint",
    "Handle": "dejavulib.handle",
    "KVCache": "dejavulib.kvcache",
    "StagingBuffer": "dejavulib.kvcache",
    "Streamer": "dejavulib.streamer",
    "stream_out": "dejavulib.streaming",
    "stream_in": "dejavulib.streaming",
    "LayerStreamer": "dejavulib.streaming",
    "region_of": "dejavulib.streaming",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dejavulib' has no attribute {name!r}")


__all__ = [
    "DIM_ORDER", "BackPressureTimeout", "Channel", "ClosedError", "DType", "DejaVuLibError", "Endpoint", "Handle",
    "Header", "IntegrityError", "KVCache", "KVLayout", "LayerStreamer", "Message", "PeerError", "Piece",
    "ProtocolError", "Region", "StagingBuffer", "Streamer", "Transfer", "TransferError", "TransferTimeout",
    "TransportUnavailable", "Which", "plan_pieces", "region_of", "right_aligned",
    "stream_in", "stream_out",
]  # fmt: skip
