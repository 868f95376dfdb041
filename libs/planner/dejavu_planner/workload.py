"""The workload summary the formulas need: prompt length and generation lengths."""

from __future__ import annotations

from dataclasses import dataclass

from dejavu_planner.trace import Trace


@dataclass(frozen=True)
class Workload:
    """Prompt length, mean and longest generation (tokens, the first one yielded by the prompt).

    ``token_steps`` is the paper's ``N``: token-generation steps after the prompt, averaged.
    ``max_new_tokens`` sizes the preallocated KV caches.
    """

    prompt_len: int
    mean_new_tokens: float
    max_new_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.mean_new_tokens < 1 or self.max_new_tokens < self.mean_new_tokens:
            raise ValueError(f"invalid workload {self}: need prompt_len >= 1, 1 <= mean <= max new tokens")

    @property
    def token_steps(self) -> float:
        return self.mean_new_tokens - 1

    @classmethod
    def from_trace(cls, trace: Trace) -> Workload:
        """Longest prompt, mean and longest generation of a trace."""
        news = [r.new_tokens for r in trace.requests]
        return cls(
            prompt_len=max(r.prompt_len for r in trace.requests),
            mean_new_tokens=sum(news) / len(news),
            max_new_tokens=max(news),
        )
