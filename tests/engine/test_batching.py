"""A left-padded microbatch of mixed prompt lengths computes what each request computes alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from engine.tiny_models import FAMILIES

LENGTHS = (7, 3, 11, 1)
STEPS = 4


def run(pipeline: Pipeline, prompts: list[torch.Tensor], continuations: torch.Tensor) -> list[torch.Tensor]:
    """Logits [batch, vocab] of the prefill and of each teacher-forced decode step."""
    geometry = BatchGeometry.for_prompts([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), geometry.cur_len, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, geometry.pad_lens[row] :] = prompt
    caches = pipeline.allocate(len(prompts), geometry.cur_len + STEPS)
    out = [pipeline.forward(ids, caches, geometry)[:, -1]]
    for step in range(STEPS):
        geometry = geometry.advance()
        out.append(pipeline.forward(continuations[:, step : step + 1], caches, geometry)[:, -1])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_lengths_match_single_requests(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    pipeline = Pipeline(tiny_checkpoints[family], 2)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=generator) for n in LENGTHS]
    continuations = torch.randint(3, 300, (len(LENGTHS), STEPS), generator=generator)
    batched = run(pipeline, prompts, continuations)
    for row, prompt in enumerate(prompts):
        alone = run(pipeline, [prompt], continuations[row : row + 1])
        for step, (b, a) in enumerate(zip(batched, alone, strict=True)):
            torch.testing.assert_close(b[row], a[0], atol=1e-4, rtol=0, msg=f"row {row}, step {step}")
