"""Where prompt KV goes: the pure-Python planner behind ``stream_out``/``stream_in``.

Requests are numbered in order across a *round* of prompt microbatches: prompt microbatch ``i`` holds
global requests ``[i*m_p, i*m_p + n_i)`` and token microbatch ``j`` holds ``[j*m_t, (j+1)*m_t)``. A
transfer is the intersection of one source stage's layers with one destination stage's layers and of
one source microbatch's rows with one destination microbatch's rows. Prompts are LEFT padded, so a
prompt microbatch of padded length ``P1`` merged into a token microbatch of padded length ``P`` lands
right-aligned: its positions shift by ``P - P1`` (``Transfer.dst_position_offset``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Topology:
    """A pipeline: each stage's global layer range [a, b) (contiguous, from 0) and its microbatch size."""

    stage_layer_ranges: tuple[tuple[int, int], ...]
    microbatch_size: int

    def __post_init__(self) -> None:
        ranges = tuple(tuple(r) for r in self.stage_layer_ranges)
        object.__setattr__(self, "stage_layer_ranges", ranges)
        if not ranges:
            raise ValueError("a topology needs at least one stage")
        expected = 0
        for lo, hi in ranges:
            if lo != expected or hi <= lo:
                raise ValueError(f"stage layer ranges must tile [0, L) in order, got {ranges}")
            expected = hi
        if self.microbatch_size <= 0:
            raise ValueError("microbatch_size must be positive")

    @classmethod
    def even(cls, n_layers: int, depth: int, microbatch_size: int) -> Topology:
        """``depth`` stages splitting ``n_layers`` as evenly as possible (earlier stages get the extra)."""
        if not 1 <= depth <= n_layers:
            raise ValueError(f"depth must be in [1, {n_layers}], got {depth}")
        base, extra = divmod(n_layers, depth)
        ranges, lo = [], 0
        for s in range(depth):
            hi = lo + base + (1 if s < extra else 0)
            ranges.append((lo, hi))
            lo = hi
        return cls(tuple(ranges), microbatch_size)

    @property
    def depth(self) -> int:
        return len(self.stage_layer_ranges)

    @property
    def n_layers(self) -> int:
        return self.stage_layer_ranges[-1][1]


@dataclass(frozen=True)
class Transfer:
    """One rectangular piece of prompt KV: source rows/positions -> destination rows, shifted positions."""

    src_stage: int
    src_microbatch: int
    src_rows: tuple[int, int]
    dst_stage: int
    dst_microbatch: int
    dst_rows: tuple[int, int]
    layers: tuple[int, int]
    positions: tuple[int, int]
    dst_position_offset: int = 0

    @property
    def dst_positions(self) -> tuple[int, int]:
        return (self.positions[0] + self.dst_position_offset, self.positions[1] + self.dst_position_offset)

    @property
    def n_rows(self) -> int:
        return self.src_rows[1] - self.src_rows[0]


def right_aligned(src_padded: int, length: int, dst_padded: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Source and destination positions of rows whose prompts are at most ``length`` long.

    Prompts are LEFT padded, so such rows hold data only in the last ``length`` positions of a batch
    padded to ``src_padded``; moved into a batch padded to ``dst_padded`` they land right-aligned there.
    Both batches may be longer than ``length`` (and either may be the longer one): only the positions
    that carry a prompt move. Raises ``ValueError`` when ``length`` fits in neither.
    """
    if not 0 < length <= min(src_padded, dst_padded):
        raise ValueError(f"prompts of {length} positions do not fit padded lengths {src_padded} -> {dst_padded}")
    return (src_padded - length, src_padded), (dst_padded - length, dst_padded)


def token_padded_lengths(src: Topology, dst: Topology, padded_lengths: Sequence[int]) -> list[int]:
    """Padded prompt length of each destination microbatch: the longest of the prompt microbatches it merges."""
    n_requests = len(padded_lengths) * src.microbatch_size
    n_dst = -(-n_requests // dst.microbatch_size)
    out = [0] * n_dst
    for i, length in enumerate(padded_lengths):
        first, last = i * src.microbatch_size, (i + 1) * src.microbatch_size - 1
        for j in range(first // dst.microbatch_size, last // dst.microbatch_size + 1):
            out[j] = max(out[j], length)
    return out


def plan_transfers(src: Topology, dst: Topology, padded_lengths: Sequence[int]) -> list[Transfer]:
    """All transfers moving one round of prompt microbatches into the token pipeline.

    ``padded_lengths[i]`` is the (left-padded) prompt length of prompt microbatch ``i``; every prompt
    microbatch is full (``src.microbatch_size`` rows). Covers every (layer, request, position) of the
    round exactly once. ``stream_out`` keeps the transfers of its (stage, microbatch), ``stream_in``
    those of its own.
    """
    if src.n_layers != dst.n_layers:
        raise ValueError(f"source has {src.n_layers} layers, destination {dst.n_layers}")
    if any(p <= 0 for p in padded_lengths):
        raise ValueError("padded lengths must be positive")
    dst_lengths = token_padded_lengths(src, dst, padded_lengths)
    transfers: list[Transfer] = []
    m_p, m_t = src.microbatch_size, dst.microbatch_size
    for i, length in enumerate(padded_lengths):
        for j in range((i * m_p) // m_t, ((i + 1) * m_p - 1) // m_t + 1):
            rows = _intersect((i * m_p, (i + 1) * m_p), (j * m_t, (j + 1) * m_t))
            assert rows is not None  # j ranges exactly over the overlapping token microbatches
            for s, s_layers in enumerate(src.stage_layer_ranges):
                for d, d_layers in enumerate(dst.stage_layer_ranges):
                    layers = _intersect(s_layers, d_layers)
                    if layers is None:
                        continue
                    transfers.append(
                        Transfer(
                            src_stage=s,
                            src_microbatch=i,
                            src_rows=(rows[0] - i * m_p, rows[1] - i * m_p),
                            dst_stage=d,
                            dst_microbatch=j,
                            dst_rows=(rows[0] - j * m_t, rows[1] - j * m_t),
                            layers=layers,
                            positions=(0, length),
                            dst_position_offset=dst_lengths[j] - length,
                        )
                    )
    return transfers
