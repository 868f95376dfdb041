"""generate_batch: per-request stopping in shared passes, seeded sampling across stage splits, chunked prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dejavu_common.messages import FinishReason, SamplingSpec
from dejavu_engine.generate import GenerationError, Request, generate_batch
from dejavu_engine.geometry import Slice
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage

PROMPTS = ((5, 17, 42, 8, 99), (7, 3), (11, 12, 13, 14, 15, 16, 17, 18))


def test_rows_stop_independently_and_match_running_alone(device: str, tiny_checkpoints: dict[str, Path]) -> None:
    pipeline = Pipeline(tiny_checkpoints["llama"], 2, device)
    free = [generate_batch(pipeline, [Request(p, SamplingSpec(max_tokens=8, temperature=0))])[0][0] for p in PROMPTS]
    assert all(c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 8 for c in free)
    stop_token = free[0].token_ids[3]
    requests = [
        Request(PROMPTS[0], SamplingSpec(max_tokens=8, temperature=0, stop_token_ids=(stop_token,))),
        Request(PROMPTS[1], SamplingSpec(max_tokens=2, temperature=0)),
        Request(PROMPTS[2], SamplingSpec(max_tokens=8, temperature=0)),
    ]
    batched, timings = generate_batch(pipeline, requests)
    first_stop = free[0].token_ids.index(stop_token) + 1
    assert batched[0].token_ids == free[0].token_ids[:first_stop] and batched[0].finish_reason is FinishReason.STOP
    assert batched[1].token_ids == free[1].token_ids[:2] and batched[1].finish_reason is FinishReason.LENGTH
    assert batched[2].token_ids == free[2].token_ids  # finished rows kept computing without disturbing it
    assert timings.decode_steps == 7


def test_seeded_sampling_is_independent_of_the_stage_split(device: str, tiny_checkpoints: dict[str, Path]) -> None:
    request = Request(PROMPTS[0], SamplingSpec(max_tokens=10, temperature=1.3, top_p=0.95, seed=99))
    runs = [generate_batch(Pipeline(tiny_checkpoints["opt"], k, device), [request])[0][0].token_ids for k in (1, 3)]
    assert runs[0] == runs[1]
    other = Request(PROMPTS[0], SamplingSpec(max_tokens=10, temperature=1.3, top_p=0.95, seed=100))
    assert generate_batch(Pipeline(tiny_checkpoints["opt"], 1, device), [other])[0][0].token_ids != runs[0]


def test_prompts_in_chunks_of_a_token_budget_generate_what_whole_prompts_generate(
    device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """A budget of tokens per pass splits the prompts over passes (decodes first, then prompt chunks in what is
    left, across block boundaries); each request generates what it generates with whole prompts, sampled ones
    too (each draw is numbered by the request's own tokens)."""
    pipeline = Pipeline(tiny_checkpoints["llama"], 2, device)
    requests = [
        Request(PROMPTS[2] * 3, SamplingSpec(max_tokens=6, temperature=0)),
        Request(PROMPTS[0], SamplingSpec(max_tokens=9, temperature=0.9, seed=5)),
        Request(PROMPTS[1], SamplingSpec(max_tokens=4, temperature=0)),
    ]
    whole, _ = generate_batch(pipeline, requests)
    first = pipeline.stages[0]
    passes: list[list[Slice]] = []

    def recorded(io, pool, slices, *args, **kwargs):
        passes.append(list(slices))
        return Stage.forward_slices(first, io, pool, slices, *args, **kwargs)

    first.forward_slices = recorded  # type: ignore[method-assign]
    for budget in (1, 3, 7, 64):
        passes.clear()
        chunked, _ = generate_batch(pipeline, requests, token_budget=budget, block_size=4)
        assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
        # Within the budget, but for the decodes, which always run (one token each).
        assert all(sum(s.length for s in p) <= budget or all(s.length == 1 for s in p) for p in passes)
        if 1 < budget < 24:  # the 24-token prompt's chunks continue over its cached prefix, across blocks
            assert any(s.start > 0 and s.length > 1 and s.start % 4 for p in passes for s in p)
    with pytest.raises(GenerationError, match="token budget"):
        generate_batch(pipeline, requests, token_budget=0)


def test_generate_computes_a_long_prompt_in_chunks_of_the_token_budget(tiny_checkpoints: dict[str, Path]) -> None:
    """``dejavu generate --token-budget``: the same completion as the whole prompt's; a budget below 1 is a
    :class:`GenerationError` (the command line's one-line error)."""
    from dejavu_engine.generate import generate

    folder, prompt = tiny_checkpoints["gpt2"], "The quick brown fox jumps over the lazy dog. " * 3
    whole = generate(prompt, model=folder, max_tokens=5, stages=2)
    chunked = generate(prompt, model=folder, max_tokens=5, stages=2, token_budget=4)
    assert whole.prompt_tokens > 4 and chunked.token_ids == whole.token_ids and chunked.text == whole.text
    with pytest.raises(GenerationError, match="token budget"):
        generate(prompt, model=folder, max_tokens=5, token_budget=0)
