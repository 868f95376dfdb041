"""Offline generation through K in-process stages: the Python API behind ``dejavu generate``.

:func:`generate_batch` runs one left-padded microbatch of token-id requests to completion;
:func:`generate` wraps it for one text prompt (plain or chat) with model loading and checks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dejavu_common.messages import FinishReason, SamplingSpec
from dejavu_common.settings import Settings
from dejavu_common.stopping import StopCriteria
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.checkpoint import CheckpointError, ensure_default_model
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.sampling import sample

# Pad slots are masked out; any valid id works, 0 always is.
_PAD_ID = 0


class GenerationError(ValueError):
    """A request the model cannot serve (bad arguments, too long for the context, ...)."""


def _sampling_error(exc: ValueError) -> str:
    """One line per invalid sampling argument (``temperature: Input should be greater than or equal to 0``)."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors())


@dataclass(frozen=True)
class Request:
    """One sequence to generate: prompt ids, its sampling spec (a seed where it samples) and the model's
    EOS ids, which end it unless the spec says ``ignore_eos``."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def stop(self) -> StopCriteria:
        return StopCriteria.of(self.sampling, self.eos_token_ids)


@dataclass(frozen=True)
class Completion:
    """Generated ids of one request (a final EOS/stop token included) and why it ended."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True)
class BatchTimings:
    prefill_s: float
    decode_steps: int
    decode_s: float

    @property
    def decode_s_per_token(self) -> float:
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0


@dataclass(frozen=True)
class GenerationResult:
    """Outcome of :func:`generate`; :meth:`to_json` is what ``dejavu generate --json`` prints."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    timings: BatchTimings

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason.value,
            "prompt_tokens": self.prompt_tokens,
            "timings": {"prefill_s": self.timings.prefill_s, "decode_s_per_token": self.timings.decode_s_per_token},
        }


def context_limit(pipeline: Pipeline, settings: Settings) -> int:
    """Most positions (prompt + generated) a sequence may occupy."""
    return min(pipeline.spec.max_positions, settings.engine.max_context)


def generate_batch(pipeline: Pipeline, requests: Sequence[Request]) -> tuple[list[Completion], BatchTimings]:
    """Generate every request of one microbatch to completion (greedy rows match HF generate).

    Prompts are left-padded to the longest; finished rows keep computing (their cache slots are
    never read by other rows) but emit nothing more. Requests with a non-greedy sampler must
    have a resolved seed.
    """
    if not requests:
        raise GenerationError("no requests")
    lens = [len(r.prompt_ids) for r in requests]
    geometry = BatchGeometry.for_prompts(lens)
    device = pipeline.stages[0].device
    ids = torch.full((len(requests), geometry.cur_len), _PAD_ID, dtype=torch.long)
    for row, request in enumerate(requests):
        ids[row, geometry.pad_lens[row] :] = torch.tensor(request.prompt_ids)
    caches = pipeline.allocate(len(requests), geometry.cur_len + max(r.sampling.max_tokens for r in requests))
    params = [r.sampling for r in requests]
    stops = [r.stop for r in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    finished: list[FinishReason | None] = [None] * len(requests)

    start = time.perf_counter()
    logits = pipeline.forward(ids.to(device), caches, geometry)[:, -1]
    tokens = sample(logits, params, [0] * len(requests))
    prefill_s = time.perf_counter() - start
    step = 0
    while True:
        for row, token in enumerate(tokens):
            if finished[row] is None:
                outputs[row].append(token)
                finished[row] = stops[row].check(token, len(outputs[row]))
        if all(f is not None for f in finished):
            break
        step += 1
        geometry = geometry.advance()
        next_ids = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
        logits = pipeline.forward(next_ids, caches, geometry)[:, -1]
        tokens = sample(logits, params, [step] * len(requests))
    timings = BatchTimings(prefill_s, step, time.perf_counter() - start - prefill_s)
    completions = [Completion(tuple(o), f) for o, f in zip(outputs, finished, strict=True) if f is not None]
    return completions, timings


def generate(
    prompt: str,
    *,
    chat: bool = False,
    max_tokens: int = 64,
    stages: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    model: Path | None = None,
    settings: Settings | None = None,
) -> GenerationResult:
    """Generate a completion of one text prompt with the model split into ``stages`` stages.

    ``model`` is a checkpoint folder (default: the prepared SmolLM2, prepared on first use);
    ``chat`` renders the prompt as one user message through the chat template. Raises
    :class:`GenerationError` for invalid arguments or a prompt that does not fit the context, and
    :class:`~dejavu_engine.checkpoint.CheckpointError` for a missing or unusable checkpoint.
    """
    settings = settings or Settings()
    if max_tokens < 1:
        raise GenerationError(f"max tokens must be >= 1, got {max_tokens}")
    try:
        sampling = SamplingSpec(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        ).resolved()
    except ValueError as exc:
        raise GenerationError(_sampling_error(exc)) from exc
    folder = model or settings.model.path or ensure_default_model(settings)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    tokenizer = Tokenizer.from_pretrained(folder)
    prompt_ids = (
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    )
    if not prompt_ids:
        raise GenerationError("the prompt encodes to no tokens")
    try:
        pipeline = Pipeline(folder, stages, settings.model.device, settings.model.dtype)
    except ValueError as exc:
        raise GenerationError(str(exc)) from exc
    limit = context_limit(pipeline, settings)
    if len(prompt_ids) + max_tokens > limit:
        raise GenerationError(
            f"prompt of {len(prompt_ids)} tokens + max tokens {max_tokens} exceeds the context of {limit} tokens"
        )
    eos = pipeline.spec.eos_token_ids | tokenizer.eos_token_ids
    request = Request(tuple(prompt_ids), sampling, eos)
    (completion,), timings = generate_batch(pipeline, [request])
    return GenerationResult(
        completion.token_ids, tokenizer.decode(completion.token_ids), completion.finish_reason, len(prompt_ids), timings
    )
