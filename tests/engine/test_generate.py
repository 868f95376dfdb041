"""generate_batch: per-row stopping in a shared microbatch, and seeded sampling across stage splits."""

from __future__ import annotations

from pathlib import Path

from dejavu_common.messages import FinishReason, SamplingSpec
from dejavu_engine.generate import Request, generate_batch
from dejavu_engine.pipeline import Pipeline

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
