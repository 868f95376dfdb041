"""One pass of per-request slices on a stage that computes them all: the executor of a request-scheduled pipeline.

No policy here: the pass comes planned (:class:`dejavu_common.sched.ScheduledPass`, whose block ids are the pool's),
the executor makes the blocks it names, feeds every slice's tokens back to back through
:meth:`~dejavu_engine.stage.Stage.forward_slices` and hands back the logits the sampler and the log probabilities
need: each slice's last position, and every position of the slices that ask for their prompt's log probabilities.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from dejavu_common.sched import ScheduledPass
from dejavu_engine.geometry import Slice
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavulib.paged import BlockPool


@dataclass(frozen=True)
class PassLogits:
    """``last[i]``: the logits ``[vocab]`` after slice ``i``'s last position; ``every[i]``: the logits
    ``[length, vocab]`` after each of its positions, for the slices asked for (position ``p``'s predict ``p + 1``)."""

    last: torch.Tensor
    every: dict[int, torch.Tensor]


class SliceExecutor:
    """Runs planned passes of a one-stage pipeline (prompts and decodes alike) over its paged pool."""

    def __init__(self, stage: Stage, pool: BlockPool) -> None:
        if not stage.is_first or not stage.is_last:
            raise ValueError("a request-scheduled pass runs on a stage that holds every layer")
        self.stage = stage
        self.pool = pool

    def run(self, step: ScheduledPass, every: Collection[int] = ()) -> PassLogits:
        """Compute ``step``: every slice's positions write their K/V into its blocks and attend over its own
        positions before them. ``every``: indices of slices whose every position's logits are returned too."""
        self.pool.ensure(b for s in step.slices for b in s.new_blocks)
        ids: list[int] = []
        at: list[int] = []  # the pass's token indices whose logits come back, slice by slice
        last: list[int] = []  # per slice, the index in ``at`` of its last position
        spans: dict[int, tuple[int, int]] = {}  # slice -> its range in ``at`` (slices in ``every``)
        for i, s in enumerate(step.slices):
            first = len(ids)
            ids += s.request.token_ids[s.start : s.start + s.length]
            if i in every:
                spans[i] = (len(at), len(at) + s.length)
                at += range(first, len(ids))
            else:
                at.append(len(ids) - 1)
            last.append(len(at) - 1)
        slices = [Slice(s.table, s.start, s.length) for s in step.slices]
        io = StageIO(input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0))
        out = self.stage.forward_slices(io, self.pool, slices, logits_at=at)
        assert out.logits is not None  # a last stage returns logits
        logits = out.logits[:, 0]
        if not spans:
            return PassLogits(logits, {})
        picked = logits[torch.tensor(last, dtype=torch.long, device=logits.device)]
        return PassLogits(picked, {i: logits[a:b] for i, (a, b) in spans.items()})
