"""Offline generation through K in-process stages: the Python API behind ``dejavu generate``.

:func:`generate_batch` runs token-id requests to completion, each on its own positions and blocks, in passes of
per-request slices (:meth:`~dejavu_engine.stage.Stage.forward_slices`: decodes and whole or chunked prompts in one
pass); :func:`generate` wraps it for one text prompt (plain or chat) with model loading and checks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dejavu_common.messages import FinishReason, Logprob, SamplingSpec
from dejavu_common.sched import BlockBook, Budget, RequestState, ScheduledPass, Scheduler, most_blocks
from dejavu_common.settings import Settings
from dejavu_common.stopping import StopCriteria
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.checkpoint import CheckpointError, ensure_default_model
from dejavu_engine.geometry import Slice
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.sampling import RowContext, sample_rows
from dejavu_engine.stage_io import StageIO
from dejavulib.paged import BlockPool


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
    """Generated ids of one request (a final EOS/stop token included), why it ended, and each token's log
    probabilities when the request asked for them (``SamplingSpec.logprobs``; empty otherwise)."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[Logprob, ...] = ()


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


def kv_window(pipeline: Pipeline) -> int | None:
    """The sliding window every layer of every stage attends within (the one block table of a request serves them
    all), or None: a pipeline whose requests give back the blocks that fall out of it (:class:`Scheduler`)."""
    windows = {stage.kv_window for stage in pipeline.stages}
    return windows.pop() if len(windows) == 1 else None


def _tokens_of(step: ScheduledPass) -> torch.Tensor:
    """The token ids a pass feeds: each slice's positions, back to back in one row ``[1, tokens]``."""
    ids = [t for s in step.slices for t in s.request.token_ids[s.start : s.start + s.length]]
    return torch.tensor(ids, dtype=torch.long).unsqueeze(0)


def _run_pass(pipeline: Pipeline, pools: list[BlockPool], step: ScheduledPass) -> torch.Tensor:
    """One pass through every stage: each request's next positions as one slice over its blocks (the same
    block ids on every stage); returns the logits of each slice's last token ``[slices, vocab]``."""
    slices = [Slice(s.table, s.start, s.length) for s in step.slices]
    for pool in pools:
        pool.ensure(b for s in step.slices for b in s.new_blocks)
    io = StageIO(input_ids=_tokens_of(step))
    for stage, pool in zip(pipeline.stages, pools, strict=True):
        io = stage.forward_slices(io, pool, slices)
    assert io.logits is not None  # the last stage returns logits
    return io.logits[:, -1]


@dataclass
class _Output:
    """What one request generated so far, and why it ended."""

    request: Request
    logprobs: list[Logprob] = field(default_factory=list)
    finished: FinishReason | None = None


def _sample(step: ScheduledPass, logits: torch.Tensor, outputs: dict[str, _Output]) -> dict[str, int]:
    """The next token of every request whose slice sampled (at its own step, its penalties seeing its prompt and
    what it generated); records their log probabilities and finish reasons."""
    done = [(row, s.request) for row, s in enumerate(step.slices) if s.samples]
    if not done:
        return {}
    rows = torch.tensor([row for row, _ in done], device=logits.device)
    outs = [outputs[state.request_id] for _, state in done]
    stops = [out.request.stop for out in outs]
    contexts = [
        RowContext(state.token_ids[: state.prompt_len], state.token_ids[state.prompt_len :], stop.stop_ids)
        for (_, state), stop in zip(done, stops, strict=True)
    ]
    params = [out.request.sampling for out in outs]
    sampled = sample_rows(logits[rows], params, [state.generated for _, state in done], contexts)
    tokens: dict[str, int] = {}
    for (_, state), out, stop, row in zip(done, outs, stops, sampled, strict=True):
        if row.refused is not None:  # its grammar does not compile: it ends without a token
            out.finished = FinishReason.REFUSED
            continue
        tokens[state.request_id] = row.token
        if row.logprob is not None:
            out.logprobs.append(row.logprob)
        out.finished = stop.check(row.token, state.generated + 1)
    return tokens


def generate_batch(
    pipeline: Pipeline,
    requests: Sequence[Request],
    *,
    token_budget: int | None = None,
    block_size: int = 16,
    pool_blocks: int | None = None,
) -> tuple[list[Completion], BatchTimings]:
    """Generate every request to completion (greedy rows match HF generate), each on its own positions and
    blocks (no padding) in a paged pool per stage, all in shared passes (:meth:`Stage.forward_slices`).

    The passes are what the serving policy (:class:`dejavu_common.sched.Scheduler`) plans: every pass decodes
    one token of each request whose prompt is in, then computes prompts, whole (``token_budget`` None) or in
    chunks of what ``token_budget`` tokens a pass leave after the decodes (chunked prefill: a long prompt over
    several passes, each chunk attending over the ones before it); a request that shares a prompt prefix with
    one computed before it reads that prefix's blocks instead of computing them (prefix caching). A request
    leaves the passes when it finishes, and its blocks go back at once. Each row's penalties see its prompt and
    what it generated; its draws are numbered by its own generated tokens. Requests with a non-greedy sampler
    must have a resolved seed. ``timings.prefill_s`` runs until every request has its first token, the decode
    steps are the passes after that.

    Each stage's pool has ``pool_blocks`` blocks (rounded down to whole slabs of 32), by default room for every
    request at once at the most it holds: its whole length, or where every layer attends within a sliding window
    (:func:`kv_window`), the window's blocks and a pass's (the blocks that fall out of the window go back as a
    request advances). A smaller pool preempts and recomputes requests (their cached prefixes kept); a request it
    could never hold raises :class:`~dejavu_common.sched.RequestTooLong`.
    """
    if not requests:
        raise GenerationError("no requests")
    if not all(r.prompt_ids for r in requests):
        raise GenerationError("every prompt needs at least one token")
    if token_budget is not None and token_budget < 1:
        raise GenerationError(f"the token budget of a pass must be >= 1, got {token_budget}")
    if pool_blocks is not None and pool_blocks < 1:
        raise GenerationError(f"a pool needs >= 1 block, got {pool_blocks}")
    lengths = [len(r.prompt_ids) + r.sampling.max_tokens for r in requests]
    window = kv_window(pipeline)
    budget = Budget(tokens=token_budget or sum(lengths), max_running=len(requests))
    if pool_blocks is None:
        # Room for every request at the most it holds at once, and a block each beyond (what admission keeps free
        # for the running requests' next positions), in whole slabs; memory is made a slab at a time, as used.
        blocks = sum(most_blocks(n, block_size, window, budget.tokens) for n in lengths) + len(requests)
        slab = min(blocks, 32)
        blocks = -(-blocks // slab) * slab
    else:
        blocks, slab = pool_blocks, min(pool_blocks, 32)
    pools = [stage.block_pool(block_size, blocks, slab) for stage in pipeline.stages]
    scheduler = Scheduler(BlockBook(pools[0].max_blocks, block_size), budget, window)
    outputs: dict[str, _Output] = {}
    for index, request in enumerate(requests):
        state = RequestState(str(index), list(request.prompt_ids), len(request.prompt_ids), request.sampling.max_tokens)
        outputs[state.request_id] = _Output(request)
        scheduler.add(state)
    states = [scheduler.get(str(i)) for i in range(len(requests))]
    start = time.perf_counter()
    prefill_s: float | None = None  # until every request has its first token
    steps = 0
    while len(scheduler):
        step = scheduler.schedule()
        if not step:
            raise RuntimeError("requests are left but the scheduler planned no pass")  # the pool holds any one
        sampled = _sample(step, _run_pass(pipeline, pools, step), outputs)
        for s in step.slices:  # a refused request ends without a token
            if outputs[s.request.request_id].finished is FinishReason.REFUSED:
                scheduler.finish(s.request.request_id)
        stopped = [rid for rid in sampled if outputs[rid].finished is not None]
        scheduler.update(step, sampled, stopped)
        if prefill_s is not None:
            steps += 1
        elif all(state is not None and (state.generated or outputs[state.request_id].finished) for state in states):
            prefill_s = time.perf_counter() - start
    assert prefill_s is not None  # a request leaves the passes only once it has a token or is refused
    timings = BatchTimings(prefill_s, steps, time.perf_counter() - start - prefill_s)
    completions = []
    for state, out in zip(states, outputs.values(), strict=True):
        assert state is not None and out.finished is not None
        completions.append(Completion(tuple(state.token_ids[state.prompt_len :]), out.finished, tuple(out.logprobs)))
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
    token_budget: int | None = None,
    **controls: Any,
) -> GenerationResult:
    """Generate a completion of one text prompt with the model split into ``stages`` stages.

    ``model`` is a checkpoint folder (default: the prepared SmolLM2, prepared on first use);
    ``token_budget`` computes the prompt in chunks of that many tokens a pass (see :func:`generate_batch`;
    None: whole);
    ``chat`` renders the prompt as one user message through the chat template; ``controls`` are further
    :class:`SamplingSpec` fields (``min_p``, ``min_tokens``, the penalties, ``logit_bias``). Raises
    :class:`GenerationError` for invalid arguments or a prompt that does not fit the context, and
    :class:`~dejavu_engine.checkpoint.CheckpointError` for a missing or unusable checkpoint.
    """
    settings = settings or Settings()
    if max_tokens < 1:
        raise GenerationError(f"max tokens must be >= 1, got {max_tokens}")
    if token_budget is not None and token_budget < 1:
        raise GenerationError(f"the token budget of a pass must be >= 1, got {token_budget}")
    try:
        sampling = SamplingSpec(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **controls
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
    block_size = settings.engine.kv_block_size or 16  # 0 (contiguous caches) for the workers: the default here
    (completion,), timings = generate_batch(pipeline, [request], token_budget=token_budget, block_size=block_size)
    return GenerationResult(
        completion.token_ids, tokenizer.decode(completion.token_ids), completion.finish_reason, len(prompt_ids), timings
    )
