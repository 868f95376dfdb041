"""When a generated sequence ends: EOS, a stop token, or the token budget (pure Python).

The one token-level stopping rule: the workers' rows (``dejavu_worker.rows.RowTracker``) and
``dejavu generate`` both check it; stop strings are matched on text by the gateway.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dejavu_common.messages import FinishReason, SamplingSpec


@dataclass(frozen=True)
class StopCriteria:
    """Token-level stopping rules of one request; stop strings are matched on text by callers."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop token ends the sequence before this many tokens (the budget still does)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @classmethod
    def of(cls, sampling: SamplingSpec, eos_token_ids: Iterable[int]) -> StopCriteria:
        """The rules of a request served with ``sampling`` on a model whose EOS ids are ``eos_token_ids``."""
        stop_ids = frozenset(sampling.stop_token_ids)
        return cls(sampling.max_tokens, frozenset(eos_token_ids), stop_ids, sampling.ignore_eos, sampling.min_tokens)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end the sequence: its stop tokens, and the EOS ids unless ``ignore_eos``."""
        return self.stop_token_ids if self.ignore_eos else self.stop_token_ids | self.eos_token_ids

    def check(self, token_id: int, generated: int) -> FinishReason | None:
        """The finish reason after emitting ``token_id`` as the ``generated``-th token, or None."""
        if token_id in self.stop_ids and generated > self.min_tokens:
            return FinishReason.STOP
        if generated >= self.max_tokens:
            return FinishReason.LENGTH
        return None
