"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

For fault tolerance, a seeded draw is a pure function of ``(seed, step, logits)``: each step uses a
fresh generator seeded from a hash of the request seed and the step index, so a request resumed
at step ``t`` on another worker draws exactly the tokens the failed one would have drawn.
Requests without a seed get one at admission (:meth:`SamplingSpec.resolved`), which makes them
resumable too. What a request asks for is the one ``dejavu_common.messages.SamplingSpec``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from dejavu_common.messages import SEED_BITS, SamplingSpec


def step_seed(seed: int, step: int) -> int:
    """The generator seed of decode step ``step`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def filtered_probs(logits: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
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


def sample_token(logits: torch.Tensor, params: SamplingSpec, step: int) -> int:
    """One token from ``logits`` ``[vocab]``; deterministic given ``(params.seed, step, logits)``.

    Raises ValueError for a non-greedy request without a seed (call :meth:`SamplingSpec.resolved`).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    if params.seed is None:
        raise ValueError("non-greedy sampling needs a seed; resolve the parameters at admission")
    generator = torch.Generator(device="cpu").manual_seed(step_seed(params.seed, step))
    probs = filtered_probs(logits.detach().to("cpu"), params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: Sequence[SamplingSpec], steps: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` ``[batch, vocab]``, row ``r`` at its own step ``steps[r]``."""
    if not len(params) == len(steps) == logits.shape[0]:
        raise ValueError("one SamplingSpec and one step per row are required")
    if all(p.greedy for p in params):  # one vectorised argmax for the common greedy batch
        return logits.argmax(-1).tolist()
    return [sample_token(row, p, s) for row, p, s in zip(logits, params, steps, strict=True)]
