"""When a generated sequence ends: EOS, a stop token, or the token budget."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    """Why a sequence ended (the OpenAI API's ``finish_reason`` values)."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class StopCriteria:
    """Token-level stopping rules of one request; stop strings are matched on text by callers."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def check(self, token_id: int, generated: int) -> FinishReason | None:
        """The finish reason after emitting ``token_id`` as the ``generated``-th token, or None."""
        if token_id in self.stop_token_ids or (not self.ignore_eos and token_id in self.eos_token_ids):
            return FinishReason.STOP
        if generated >= self.max_tokens:
            return FinishReason.LENGTH
        return None
