"""DejaVuLib: KV-cache streaming primitives (stream_out/stream_in, scatter/gather, flush/fetch)."""

from dejavulib.layout import DIM_ORDER, KVLayout, Region, Which

__all__ = ["DIM_ORDER", "KVLayout", "Region", "Which"]
