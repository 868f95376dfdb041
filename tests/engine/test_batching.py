"""A left-padded microbatch of mixed prompt lengths computes what each request computes alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from engine.tiny_models import FAMILIES, LAYERS

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
def test_mixed_lengths_match_single_requests(family: str, device: str, tiny_checkpoints: dict[str, Path]) -> None:
    pipeline = Pipeline(tiny_checkpoints[family], 2, device)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=generator) for n in LENGTHS]
    continuations = torch.randint(3, 300, (len(LENGTHS), STEPS), generator=generator)
    batched = run(pipeline, prompts, continuations)
    for row, prompt in enumerate(prompts):
        alone = run(pipeline, [prompt], continuations[row : row + 1])
        for step, (b, a) in enumerate(zip(batched, alone, strict=True)):
            torch.testing.assert_close(b[row], a[0], atol=1e-4, rtol=0, msg=f"row {row}, step {step}")


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_decode_of_microbatches_matches_each_alone(
    family: str, device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """Iteration-level batching: microbatches at different lengths and steps share one decode call,
    each attending over its own cache, and compute what each computes alone."""
    from dejavu_engine.stage import Stage
    from dejavu_engine.stage_io import StageIO

    folder = tiny_checkpoints[family]
    n_layers = Pipeline(folder, 1).spec.num_layers
    stages = [Stage(folder, (0, 2), device), Stage(folder, (2, n_layers), device)]
    generator = torch.Generator().manual_seed(5)
    groups = [[9, 4], [3], [6, 6, 2]]  # prompt lengths per microbatch
    state = []
    for lengths in groups:
        geometry = BatchGeometry.for_prompts(lengths)
        ids = torch.zeros(len(lengths), geometry.cur_len, dtype=torch.long)
        for row, n in enumerate(lengths):
            ids[row, geometry.pad_lens[row] :] = torch.randint(3, 300, (n,), generator=generator)
        caches = [s.allocate_cache(len(lengths), geometry.cur_len + STEPS) for s in stages]
        io = StageIO(input_ids=ids)
        for stage, cache in zip(stages, caches, strict=True):
            io = stage.prefill(io, cache, geometry)
        state.append((geometry, caches))
    # The second microbatch runs one step alone first: the groups are at different steps.
    tokens = torch.randint(3, 300, (sum(len(g) for g in groups), STEPS + 1), generator=generator)
    geometry, caches = state[1]
    state[1] = (geometry.advance(), caches)
    io = StageIO(input_ids=tokens[2:3, STEPS : STEPS + 1])
    for stage, cache in zip(stages, caches, strict=True):
        io = stage.decode(io, cache, state[1][0])
    clones = [(g, [type(c)(c.layout, c.k.clone(), c.v.clone()) for c in cs]) for g, cs in state]
    for step in range(STEPS - 1):
        state = [(g.advance(), cs) for g, cs in state]
        clones = [(g.advance(), cs) for g, cs in clones]
        io = StageIO(input_ids=tokens[:, step : step + 1])
        for s, stage in enumerate(stages):
            io = stage.decode_groups(io, [(cs[s], g) for g, cs in state])
        row = 0
        for g, cs in clones:
            alone = StageIO(input_ids=tokens[row : row + g.batch, step : step + 1])
            for s, stage in enumerate(stages):
                alone = stage.decode(alone, cs[s], g)
            torch.testing.assert_close(io.logits[row : row + g.batch], alone.logits, atol=1e-4, rtol=0)
            row += g.batch


@pytest.mark.parametrize("native_attention", [True, False], ids=["native", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_of_some_rows_computes_what_those_rows_compute_in_a_full_decode(
    family: str, native_attention: bool, device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """Finished rows leave the computation: decoding only rows (0, 2) of a microbatch gives those rows'
    results of a decode of every row, writes their cache rows only, and leaves the others untouched."""
    from dejavu_engine.stage import Stage
    from dejavu_engine.stage_io import StageIO

    stage = Stage(tiny_checkpoints[family], (0, 2), device, native_attention=native_attention)
    generator = torch.Generator().manual_seed(7)
    geometry = BatchGeometry.for_prompts([5, 9, 3])
    ids = torch.randint(3, 300, (3, geometry.cur_len), generator=generator)
    full, part = stage.allocate_cache(3, geometry.cur_len + 2), stage.allocate_cache(3, geometry.cur_len + 2)
    for cache in (full, part):
        stage.prefill(StageIO(input_ids=ids), cache, geometry)
    step = geometry.advance()
    tokens = torch.tensor([[11], [12], [13]])
    every = stage.decode_groups(StageIO(input_ids=tokens), [(full, step)]).hidden
    some = stage.decode_groups(StageIO(input_ids=tokens[[0, 2]]), [(part, step.only((0, 2)))]).hidden
    assert every is not None and some is not None
    torch.testing.assert_close(some, every[[0, 2]], atol=1e-4, rtol=0)
    written = slice(step.cur_len - 1, step.cur_len)
    torch.testing.assert_close(part.k[:, [0, 2], :, written], full.k[:, [0, 2], :, written], atol=1e-5, rtol=0)
    assert not part.k[:, 1, :, written].any() and not part.v[:, 1, :, written].any()  # row 1 was not computed


@pytest.mark.parametrize("family", FAMILIES)
def test_a_ragged_prefill_computes_no_padding_and_matches_the_padded_one(
    family: str, device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """Prefill of left-padded prompts runs their tokens only, back to back (stage 0 hands the next stage
    one packed row); the caches' prompt positions and the last-position logits are the padded call's."""
    from dejavu_common.partition import split_layers
    from dejavu_engine.stage import Stage
    from dejavu_engine.stage_io import StageIO

    folder = tiny_checkpoints[family]
    generator = torch.Generator().manual_seed(5)
    geometry = BatchGeometry.for_prompts(LENGTHS)
    ids = torch.zeros(len(LENGTHS), geometry.cur_len, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        ids[row, geometry.pad_lens[row] :] = torch.randint(3, 300, (n,), generator=generator)
    results = {}
    for ragged in (True, False):
        stages = [Stage(folder, tuple(r), device, ragged_prefill=ragged) for r in split_layers(LAYERS, 2)]
        caches = [s.allocate_cache(len(LENGTHS), geometry.cur_len) for s in stages]
        hidden = stages[0].prefill(StageIO(input_ids=ids), caches[0], geometry).hidden
        shape = (1, sum(LENGTHS)) if ragged else (len(LENGTHS), geometry.cur_len)
        assert tuple(hidden.shape[:2]) == shape
        logits = stages[1].prefill(StageIO(hidden=hidden), caches[1], geometry).logits
        results[ragged] = (caches, logits)
    (ragged_caches, ragged_logits), (padded_caches, padded_logits) = results[True], results[False]
    torch.testing.assert_close(ragged_logits, padded_logits, atol=1e-4, rtol=0)
    for a, b in zip(ragged_caches, padded_caches, strict=True):
        for row, pad in enumerate(geometry.pad_lens):
            for x, y in ((a.k, b.k), (a.v, b.v)):
                torch.testing.assert_close(x[:, row, :, pad:], y[:, row, :, pad:], atol=1e-4, rtol=0)
