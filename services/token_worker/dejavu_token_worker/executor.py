"""One pass of per-request slices on one stage: the executor of a request-scheduled pipeline.

No policy here: the pass comes planned (by stage 0's :class:`dejavu_common.sched.Scheduler`, whose block ids every
stage's pool uses), the executor makes the blocks it names, feeds every slice's tokens (or the hidden states the
stage before returned) back to back through :meth:`~dejavu_engine.stage.Stage.forward_slices` and hands back the
hidden states for the next stage or, on the last stage, the logits the sampler and the log probabilities need: each
slice's last position, and every position of the slices that ask for their prompt's log probabilities.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from dejavu_common.sched import ScheduledPass
from dejavu_engine.geometry import LogitPicks, Slice
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavulib.layout import KVLayout
from dejavulib.paged import BlockPool


def request_layout(pool: BlockPool, blocks: int) -> KVLayout:
    """The layout of one request's KV on the stage of ``pool`` whose table has ``blocks`` entries (the coordinates
    a view of it moves through DejaVuLib: :meth:`~dejavulib.paged.PagedKVCache.view`)."""
    g = pool.geometry
    return KVLayout(g.layers, 1, g.kv_heads, blocks * g.block_size, g.head_dim, g.dtype, g.first_layer)


@dataclass(frozen=True)
class PassLogits:
    """``last[i]``: the logits ``[vocab]`` after slice ``i``'s last position; ``every[i]``: the logits
    ``[length, vocab]`` after each of its positions, for the slices asked for (position ``p``'s predict ``p + 1``)."""

    last: torch.Tensor
    every: dict[int, torch.Tensor]


class SliceExecutor:
    """Runs planned passes over one stage's paged pool (prompts and decodes alike): stage 0 feeds the slices'
    token ids, a later stage the hidden states the stage before returned; the last stage returns logits, the
    others hidden states."""

    def __init__(self, stage: Stage, pool: BlockPool) -> None:
        self.stage = stage
        self.pool = pool

    def run(self, step: ScheduledPass, every: Collection[int] = ()) -> PassLogits | torch.Tensor:
        """Compute ``step`` on stage 0 from its requests' token ids (see :meth:`forward`)."""
        ids: list[int] = []
        for s in step.slices:
            ids += s.request.token_ids[s.start : s.start + s.length]
        pieces = [(Slice(s.table, s.start, s.length), s.new_blocks) for s in step.slices]
        return self.forward(pieces, StageIO(input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0)), every)

    def forward(
        self, pieces: Sequence[tuple[Slice, Iterable[int]]], io: StageIO, every: Collection[int] = ()
    ) -> PassLogits | torch.Tensor:
        """One pass of ``pieces`` (each slice with the blocks new to its table, made here first): every slice's
        positions write their K/V into its blocks and attend over its own positions before them. ``io``: the
        slices' tokens back to back (``input_ids`` into stage 0, ``hidden`` into the others). Returns the hidden
        states ``[1, tokens, hidden]`` from a stage that is not the last; from the last, the logits of each slice's
        last position and, for the indices in ``every``, of its every position."""
        self.pool.ensure(b for _s, new in pieces for b in new)
        slices = [s for s, _new in pieces]
        if not self.stage.is_last:
            hidden = self.stage.forward_slices(io, self.pool, slices).hidden
            assert hidden is not None  # a stage that is not the last returns hidden states
            return hidden
        picks = LogitPicks.of([s.length for s in slices], every)
        out = self.stage.forward_slices(io, self.pool, slices, logits_at=picks.at)
        assert out.logits is not None  # a last stage returns logits
        logits = out.logits[:, 0]
        if not picks.spans:
            return PassLogits(logits, {})
        picked = logits[torch.tensor(picks.last, dtype=torch.long, device=logits.device)]
        return PassLogits(picked, {i: logits[a:b] for i, (a, b) in picks.spans.items()})
