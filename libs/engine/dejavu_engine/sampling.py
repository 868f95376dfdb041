"""Token sampling: penalties, logit bias, ``min_tokens``, greedy, temperature, top-k, top-p, min-p, with
per-request seeds, and the log probabilities a request asks for.

One row's logits go through, in vLLM's order:

1. ``min_tokens``: while the row has generated fewer tokens, its stop ids (EOS unless ``ignore_eos``, and
   ``stop_token_ids``) are masked out (HF's ``MinNewTokensLengthLogitsProcessor``);
2. ``logit_bias``: added to the logits; -100 bans a token, +100 forces it (every token not forced is masked
   out, as long as a forced token is still possible);
3. ``repetition_penalty`` over the prompt and the generated tokens (HF's ``RepetitionPenaltyLogitsProcessor``:
   a positive logit is divided by it, a negative one multiplied), then ``frequency_penalty`` times each
   generated token's count and ``presence_penalty`` once per generated token subtracted (OpenAI's formula);
4. the grammar of a structured output (``SamplingSpec.grammar``): every token it cannot continue with is
   masked out, EOS and the other stop ids included until the grammar is complete (``dejavu_engine.grammar``;
   its state is rebuilt from the generated tokens, so a resumed row is constrained exactly as before).

These are the *processed* logits: the token comes from them (their argmax, or a draw after temperature,
top-k, top-p and min-p, in HF's order), and the reported log probabilities are their log-softmax (before
temperature and the truncating filters, which only choose among them), or, for a request that asks for
raw ones (``SamplingSpec.raw_logprobs``), the log-softmax of the model's logits. With none of 1-4 set,
the two are the same (log probabilities of a constrained row are therefore reported after its grammar's
mask, or before it with ``raw_logprobs``). A row whose processing would leave no possible token keeps its
model logits (a ban list or a forced stop token cannot make a row unsampleable), masked by its grammar if it
has one.

For fault tolerance, a seeded draw is a pure function of ``(seed, step, processed logits)``, and the
processing a pure function of the logits, the prompt and the tokens generated so far (which a resumed row
rebuilds from its token stream): each step uses a fresh generator seeded from a hash of the request seed
and the step index, so a request resumed at step ``t`` on another worker draws exactly the tokens the
failed one would have drawn. Requests without a seed get one at admission (:meth:`SamplingSpec.resolved`),
which makes them resumable too. What a request asks for is the one ``dejavu_common.messages.SamplingSpec``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dejavu_common.messages import LOGIT_BIAS_LIMIT, LOGPROB_FLOOR, SEED_BITS, Logprob, SamplingSpec
from dejavu_engine import grammar


def step_seed(seed: int, step: int) -> int:
    """The generator seed of decode step ``step`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


@dataclass(frozen=True)
class RowContext:
    """What a row's sampling sees besides its logits: its prompt, the tokens it generated before this
    step (in order), and the ids that would stop it (``StopCriteria.stop_ids``, for ``min_tokens``)."""

    prompt_ids: Sequence[int] = ()
    generated: Sequence[int] = ()
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SampledRow:
    """One row's token and, when its request asked, the log probabilities at its position; or, for a row whose
    grammar the engine cannot compile, no token (-1) and the reason it is ``refused``."""

    token: int
    logprob: Logprob | None = None
    refused: str | None = None


_EMPTY = RowContext()


def process_logits(logits: torch.Tensor, params: SamplingSpec, context: RowContext = _EMPTY) -> torch.Tensor:
    """The processed logits ``[vocab]`` (float32) of one row: ``min_tokens``, ``logit_bias`` and the
    penalties applied to ``logits``, then the grammar's mask; the model's logits (as float32) when none is
    set. The grammar wins: where it leaves none of the tokens 1-3 leave, the model's logits are masked.
    Raises ``grammar.GrammarError`` where the row's grammar does not compile."""
    raw = logits.detach().float()
    if not params.processes_logits:
        return raw
    scores = _penalised(raw, params, context)
    if params.grammar is not None:
        allowed = grammar.allowed_tokens(
            params.grammar, raw.shape[-1], _row_key(params, context), context.generated, context.stop_ids
        )
        if allowed is not None:
            allowed = allowed.to(raw.device)
            for candidate in (scores, raw):
                masked = candidate.masked_fill(~allowed, float("-inf"))
                if _possible(masked):
                    return masked
    return scores if _possible(scores) else raw  # nothing left to sample: the model's logits instead


def _possible(scores: torch.Tensor) -> bool:
    return bool((scores > float("-inf")).any())


def _row_key(params: SamplingSpec, context: RowContext) -> tuple[SamplingSpec, tuple[int, ...]]:
    """What tells a row's grammar matcher apart from other rows' (its seed is in ``params``)."""
    return params, tuple(context.prompt_ids)


def _penalised(raw: torch.Tensor, params: SamplingSpec, context: RowContext) -> torch.Tensor:
    """``raw`` after steps 1-3 (possibly every token at -inf)."""
    scores = raw.clone()
    vocab, device = scores.shape[-1], scores.device
    if len(context.generated) < params.min_tokens and context.stop_ids:
        stops = torch.tensor([t for t in context.stop_ids if t < vocab], dtype=torch.long, device=device)
        scores[stops] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long, device=device)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=torch.float32, device=device)
        scores[ids] += bias.masked_fill(bias.abs() >= LOGIT_BIAS_LIMIT, 0.0)
        scores[ids[bias <= -LOGIT_BIAS_LIMIT]] = float("-inf")
        forced = ids[bias >= LOGIT_BIAS_LIMIT]
        if len(forced) and bool(torch.isfinite(scores[forced]).any()):
            keep = torch.full_like(scores, float("-inf"))
            keep[forced] = scores[forced]
            scores = keep
    if params.repetition_penalty != 1 and (context.prompt_ids or context.generated):
        seen = torch.tensor(sorted({*context.prompt_ids, *context.generated}), dtype=torch.long, device=device)
        picked = scores[seen]
        penalty = params.repetition_penalty
        scores[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if (params.frequency_penalty or params.presence_penalty) and context.generated:
        generated = torch.tensor(context.generated, dtype=torch.long, device=device)
        counts = torch.bincount(generated, minlength=vocab)[:vocab].to(torch.float32)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    return scores


def filtered_probs(logits: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
    """Probabilities ``[vocab]`` (float32) after temperature, top-k, top-p and min-p, as HF applies them."""
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
    if params.min_p > 0:  # HF's MinPLogitsWarper: drop what is less likely than min_p times the best token
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores.softmax(-1)


def draw(scores: torch.Tensor, params: SamplingSpec, step: int) -> int:
    """The token of processed logits ``scores`` ``[vocab]``: their argmax (greedy) or a seeded draw.

    Raises ValueError for a non-greedy request without a seed (call :meth:`SamplingSpec.resolved`).
    """
    if params.greedy:
        return int(torch.argmax(scores))
    if params.seed is None:
        raise ValueError("non-greedy sampling needs a seed; resolve the parameters at admission")
    generator = torch.Generator(device="cpu").manual_seed(step_seed(params.seed, step))
    probs = filtered_probs(scores.detach().to("cpu"), params)
    # Inverse transform sampling: one uniform number of the step's generator through the cumulative distribution
    # (the first token whose cumulative probability passes it; a token of probability 0 is never picked). It draws
    # from the same distribution as torch.multinomial at one random number instead of one per vocabulary entry.
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[-1] - 1)


def sample_token(logits: torch.Tensor, params: SamplingSpec, step: int, context: RowContext = _EMPTY) -> int:
    """One token from ``logits`` ``[vocab]``; deterministic given ``(params.seed, step, logits, context)``."""
    return draw(process_logits(logits, params, context), params, step)


def logprob(log_probs: torch.Tensor, token: int, top: int) -> Logprob:
    """The log probability of ``token`` and of the ``top`` most likely tokens in ``log_probs`` ``[vocab]``
    (a log-softmax), floored at ``LOGPROB_FLOOR``."""
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(log_probs, min(top, log_probs.shape[-1]))
        best = tuple((int(i), max(float(v), LOGPROB_FLOOR)) for i, v in zip(ids, values, strict=True))
    return Logprob(logprob=max(float(log_probs[token]), LOGPROB_FLOOR), top=best)


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingSpec],
    steps: Sequence[int],
    contexts: Sequence[RowContext] | None = None,
) -> list[SampledRow]:
    """One token per row of ``logits`` ``[batch, vocab]``, row ``r`` at its own step ``steps[r]`` with its
    own ``contexts[r]`` (default: none), and its log probabilities where ``params[r].logprobs`` asks. A row
    whose grammar does not compile is refused (``SampledRow.refused``); the other rows sample as usual."""
    if not len(params) == len(steps) == logits.shape[0] or (contexts is not None and len(contexts) != len(params)):
        raise ValueError("one SamplingSpec, one step (and one context) per row are required")
    if all(p.plain_greedy for p in params):  # one vectorised argmax for the common greedy batch
        return [SampledRow(t) for t in logits.argmax(-1).tolist()]
    rows = []
    for r, (p, s) in enumerate(zip(params, steps, strict=True)):
        try:
            scores = process_logits(logits[r], p, contexts[r] if contexts is not None else _EMPTY)
        except grammar.GrammarError as exc:
            rows.append(SampledRow(-1, refused=str(exc)))
            continue
        token = draw(scores, p, s)
        lp = None
        if p.logprobs is not None:
            reported = logits[r].detach().float() if p.raw_logprobs else scores
            lp = logprob(torch.log_softmax(reported, -1), token, p.logprobs)
        rows.append(SampledRow(token, lp))
    return rows


def sample(logits: torch.Tensor, params: Sequence[SamplingSpec], steps: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` ``[batch, vocab]``, row ``r`` at its own step ``steps[r]`` (no
    prompt or history: penalties see none)."""
    return [row.token for row in sample_rows(logits, params, steps)]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int], top: int) -> tuple[Logprob | None, ...]:
    """Per prompt position, the log probability of its token given the ones before (the model's logits:
    nothing processes a prompt) and of the ``top`` most likely tokens there; None for the first position.
    ``logits`` ``[len(prompt_ids), vocab]`` are the row's logits at its prompt positions."""
    if logits.shape[0] != len(prompt_ids):
        raise ValueError(f"{logits.shape[0]} positions of logits for a prompt of {len(prompt_ids)} tokens")
    log_probs = torch.log_softmax(logits[:-1].float(), -1)
    return (None, *(logprob(log_probs[i], prompt_ids[i + 1], top) for i in range(len(prompt_ids) - 1)))
