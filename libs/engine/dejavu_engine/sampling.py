"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

For fault tolerance, a seeded draw is a pure function of ``(seed, step, logits)``: each step uses a
fresh generator seeded from a hash of the request seed and the step index, so a request resumed
at step ``t`` on another worker draws exactly the tokens the failed one would have drawn.
Requests without a seed get one at admission (:meth:`SamplingParams.resolved`), which makes them
resumable too.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

_SEED_BITS = 63


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and
    ``top_p == 1`` disable those filters. Raises ValueError for out-of-range values."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved(self) -> SamplingParams:
        """These parameters with a seed: the given one, or a random one drawn now (at admission)."""
        return self if self.seed is not None else replace(self, seed=draw_seed())


def draw_seed() -> int:
    """A fresh random request seed."""
    return secrets.randbits(_SEED_BITS)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of decode step ``step`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[vocab]`` (float32) after temperature, top-k and top-p, as HF applies them."""
    scores = logits.float() / params.temperature
    if not bool(torch.isfinite(scores).all()):
        # A tiny temperature overflows the scaled scores to +-inf (or rounds to 0 in float32), and softmax
        # over inf gives NaN. Shifting by the maximum first leaves softmax unchanged, and dividing in float64
        # keeps the best tokens at exactly 0 while the rest go to -inf: sampling becomes greedy, as it should.
        shifted = logits.double() - logits.double().max()
        scores = (shifted / params.temperature).float().nan_to_num(nan=float("-inf"))
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p. The first token always stays: a top_p below
        # float32's smallest value (1e-300) compares as 0, which would otherwise drop every token.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[..., 0] = False
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores.softmax(-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """One token from ``logits`` ``[vocab]``; deterministic given ``(params.seed, step, logits)``.

    Raises ValueError for a non-greedy request without a seed (call :meth:`SamplingParams.resolved`).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    if params.seed is None:
        raise ValueError("non-greedy sampling needs a seed; resolve the parameters at admission")
    generator = torch.Generator(device="cpu").manual_seed(step_seed(params.seed, step))
    probs = filtered_probs(logits.detach().to("cpu"), params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` ``[batch, vocab]``, row ``r`` at its own step ``steps[r]``."""
    if not len(params) == len(steps) == logits.shape[0]:
        raise ValueError("one SamplingParams and one step per row are required")
    if all(p.greedy for p in params):  # one vectorised argmax for the common greedy batch
        return logits.argmax(-1).tolist()
    return [sample_token(row, p, s) for row, p, s in zip(logits, params, steps, strict=True)]
