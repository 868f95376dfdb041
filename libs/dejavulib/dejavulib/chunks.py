"""Contiguous runs of a region inside a contiguous ``LBHSD`` cache tensor (pure Python).

A region (layers x rows x all heads x positions x whole head_dim) of one cache tensor is a set of
contiguous element runs. This module says where they are, so the unbuffered path (one transfer per
run) and tests can reason about them without torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from dejavulib.layout import KVLayout, Region, Which


@dataclass(frozen=True)
class Run:
    """``count`` contiguous elements starting at element ``offset`` of the ``which`` tensor."""

    which: Which
    offset: int
    count: int


def contiguous_runs(layout: KVLayout, region: Region) -> Iterator[Run]:
    """Yield the maximal contiguous runs of ``region`` in ``layout``, K runs before V runs.

    Runs are produced in the order the buffered path packs the region, so concatenating them gives
    exactly the packed payload. ``len(list(...)) == region.n_chunks(layout)``.
    """
    region.check_within(layout)
    sL, sB, sH, sS, _ = layout.strides()
    H, D = layout.kv_heads, layout.head_dim
    l0, l1 = (region.layers[0] - layout.first_layer, region.layers[1] - layout.first_layer)
    for which in region.tensors:
        if region.n_rows == layout.batch and region.n_positions == layout.max_len:
            yield Run(which, l0 * sL, (l1 - l0) * sL)
        elif region.n_positions == layout.max_len:
            for layer in range(l0, l1):
                yield Run(which, layer * sL + region.rows[0] * sB, region.n_rows * sB)
        else:
            for layer in range(l0, l1):
                for row in range(*region.rows):
                    for head in range(H):
                        start = layer * sL + row * sB + head * sH + region.positions[0] * sS
                        yield Run(which, start, region.n_positions * D)
