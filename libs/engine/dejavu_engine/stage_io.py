"""The named container stages exchange: token ids into the first stage, hidden states between
stages, logits out of the last."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageIO:
    """Input or output of one stage for one forward pass of a microbatch.

    Exactly one field is set: ``input_ids`` ``[batch, n]`` (int64) enter the first stage,
    ``hidden`` ``[batch, n, hidden_size]`` flows between stages, ``logits`` ``[batch, n_out, vocab]``
    leave the last stage (``n_out`` is 1 unless all positions' logits were requested).
    """

    hidden: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if sum(t is not None for t in (self.hidden, self.input_ids, self.logits)) != 1:
            raise ValueError("StageIO holds exactly one of hidden, input_ids, logits")

    @property
    def tensor(self) -> torch.Tensor:
        """Whichever tensor is set."""
        for t in (self.hidden, self.input_ids, self.logits):
            if t is not None:
                return t
        raise AssertionError("unreachable: __post_init__ guarantees one tensor")
