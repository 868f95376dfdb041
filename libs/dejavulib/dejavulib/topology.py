"""Where prompt KV goes: the pure-Python placement behind ``stream_out``.

A prompt batch (one prompt stage's cache for one prompt microbatch) holds, in order, pieces of one or
more token microbatches: consecutive rows of the prompt batch are rows ``dst_rows`` of token
microbatch ``dst_microbatch``. Placing it is the paper's split/merge, done per piece:

- *across depths*: each piece's KV is split by the token stages' layer ranges (the intersection of
  the prompt stage's layers with each token stage's);
- *across batch sizes*: a prompt batch may carry several token microbatches' rows (split) and a
  token microbatch may be filled by several prompt batches (merge): each piece names its own rows;
- *across padded lengths*: prompts are LEFT padded, so a piece's rows hold data only in the last
  ``longest`` positions of the prompt batch; they land right-aligned in the token microbatch, which is
  padded to its own longest prompt (:func:`right_aligned`). Only the positions holding prompts move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Piece:
    """Rows ``dst_rows`` of token microbatch ``dst_microbatch`` (padded to ``dst_padded`` prompt
    positions), sitting consecutively in a prompt batch; ``longest`` is their longest prompt."""

    dst_microbatch: int
    dst_rows: tuple[int, int]
    longest: int
    dst_padded: int

    def __post_init__(self) -> None:
        if not 0 <= self.dst_rows[0] < self.dst_rows[1]:
            raise ValueError(f"a piece needs rows, got {self.dst_rows}")
        if not 0 < self.longest <= self.dst_padded:
            raise ValueError(f"prompts of {self.longest} positions do not fit {self.dst_padded}")

    @property
    def n_rows(self) -> int:
        return self.dst_rows[1] - self.dst_rows[0]


@dataclass(frozen=True)
class Transfer:
    """One rectangle of prompt KV: source rows/positions of global ``layers`` -> destination stage,
    microbatch and rows, positions shifted by ``dst_position_offset``."""

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


def plan_pieces(
    pieces: Sequence[Piece],
    src_padded: int,
    src_layers: tuple[int, int],
    dst_stages: Sequence[tuple[int, int]],
) -> list[Transfer]:
    """Every transfer moving a prompt batch of ``pieces`` (in row order, padded to ``src_padded``) held
    by a prompt stage of global layers ``src_layers`` into token stages of layer ranges ``dst_stages``
    (stage ``i`` holds ``dst_stages[i]``). Covers each (layer, row, prompt position) exactly once.
    Raises ``ValueError`` when the token stages do not cover the prompt stage's layers."""
    covered = 0
    for d in dst_stages:
        both = _intersect(src_layers, d)
        covered += both[1] - both[0] if both is not None else 0
    if covered != src_layers[1] - src_layers[0]:
        raise ValueError(f"token stages {list(dst_stages)} do not cover layers {src_layers} exactly once")
    transfers: list[Transfer] = []
    src = 0
    for piece in pieces:
        (s0, s1), (d0, _d1) = right_aligned(src_padded, piece.longest, piece.dst_padded)
        rows = (src, src + piece.n_rows)
        for stage, layers in enumerate(dst_stages):
            both = _intersect(src_layers, layers)
            if both is None:
                continue
            transfers.append(Transfer(rows, stage, piece.dst_microbatch, piece.dst_rows, both, (s0, s1), d0 - s0))
        src += piece.n_rows
    return transfers
