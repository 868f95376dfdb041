"""Blocks that fall out of a sliding window go back to the pool (``Scheduler(window=...)``), and nothing reads them
again: on a tiny random Mistral-like checkpoint with a window of 32 positions and blocks of 16, long generations
(a prompt longer than the window in chunks, a prefix-cache hit on blocks given back, 200+ tokens) give
transformers' greedy tokens with freeing on and off, whole and split into stages, and in a pool of a few blocks that
could not hold one request without freeing (preemptions, evictions). A slice whose freed blocks hold NaN attends as
one that holds them all; a stage where a layer attends fully refuses freed blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from dejavu_common.messages import SamplingSpec
from dejavu_common.sched import FREED, RequestTooLong
from dejavu_engine.generate import Request, generate_batch, kv_window
from dejavu_engine.geometry import Slice
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavulib.paged import BlockPool
from engine.tiny_models import build_checkpoint

WINDOW = 32
BLOCK = 16
BUDGET = 16  # tokens a pass: prompts go in chunks of a block
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    overrides = {"sliding_window": WINDOW, "max_position_embeddings": 512}
    return build_checkpoint("mistral", tmp_path_factory.mktemp("window-freeing") / "mistral", overrides=overrides)


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def prompts() -> list[tuple[int, ...]]:
    """A prompt longer than the window, one sharing its first four blocks (a prefix hit past the window), a short
    one."""
    generator = torch.Generator().manual_seed(3)
    long = torch.randint(3, 380, (80,), generator=generator).tolist()
    other = torch.randint(3, 380, (10,), generator=generator).tolist()
    return [tuple(long), tuple(long[:64] + other), tuple(torch.randint(3, 380, (5,), generator=generator).tolist())]


MAX_TOKENS = (220, 60, 30)


@pytest.fixture(scope="module")
def expected(model: Any, prompts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """transformers' greedy tokens, each step's logits over the whole sequence (no cache of its own)."""
    out = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, MAX_TOKENS, strict=True):
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(tuple(ids[len(prompt) :]))
    return out


def _requests(prompts: list[tuple[int, ...]]) -> list[Request]:
    # No EOS ids: every request generates its max_tokens.
    return [Request(p, SamplingSpec(max_tokens=n, temperature=0)) for p, n in zip(prompts, MAX_TOKENS, strict=True)]


def _generate(pipeline: Pipeline, prompts: list[tuple[int, ...]], **kwargs: Any) -> list[tuple[int, ...]]:
    completions, _ = generate_batch(pipeline, _requests(prompts), token_budget=BUDGET, block_size=BLOCK, **kwargs)
    return [c.token_ids for c in completions]


@pytest.mark.parametrize("stages", [1, 2])
def test_freeing_blocks_out_of_the_window_gives_transformers_tokens_as_keeping_them_does(
    stages: int,
    device: str,
    folder: Path,
    prompts: list[tuple[int, ...]],
    expected: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipeline = Pipeline(folder, stages, device)
    assert kv_window(pipeline) == WINDOW
    assert _generate(pipeline, prompts) == expected
    monkeypatch.setattr(Stage, "kv_window", None)  # every block kept, as for a stage with a global layer
    kept = Pipeline(folder, stages, device)
    assert kv_window(kept) is None
    assert _generate(kept, prompts) == expected


def test_a_pool_of_a_few_blocks_serves_long_generations_under_the_window(
    device: str,
    folder: Path,
    prompts: list[tuple[int, ...]],
    expected: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight blocks (128 positions) for three requests of up to 300 positions, each holding up to four blocks at
    once: requests are preempted and recomputed, freed blocks are handed out to others (cached ones evicted), and
    every token is still transformers'. Without freeing the pool could not hold the longest request at all."""
    pipeline = Pipeline(folder, 1, device)
    assert _generate(pipeline, prompts, pool_blocks=8) == expected
    monkeypatch.setattr(Stage, "kv_window", None)
    with pytest.raises(RequestTooLong):
        _generate(Pipeline(folder, 1, device), prompts, pool_blocks=8)


def _poison(stage: Stage, pool: BlockPool, blocks: list[int]) -> None:
    """NaN into every layer's K and V of ``blocks``: a read of one would make the logits NaN."""
    for layer in range(stage.num_layers):
        for slabs in pool.layer(layer):
            for b in blocks:
                slabs[b // pool.slab_blocks][b % pool.slab_blocks].fill_(float("nan"))


def test_a_chunk_past_the_window_reads_none_of_its_freed_blocks(device: str, folder: Path, model: Any) -> None:
    """A prompt of 70: one pass of it whole, and one of its first 64 positions then (blocks 0 and 1 freed, and
    every block of the pool but the three it still names poisoned) its last 6, whose first query reads positions 33
    on: the same logits, transformers'."""
    (stage,) = Pipeline(folder, 1, device).stages
    ids = torch.randint(3, 380, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, -6:].float()
    whole = stage.block_pool(BLOCK, 16, slab_blocks=8)
    whole.ensure(range(5))
    io = stage.forward_slices(StageIO(input_ids=torch.tensor([ids])), whole, [Slice((0, 1, 2, 3, 4), 0, 70)], True)
    assert io.logits is not None
    torch.testing.assert_close(io.logits[0, -6:].cpu(), reference, atol=TOLERANCE, rtol=0)

    pool = stage.block_pool(BLOCK, 16, slab_blocks=8)
    pool.ensure(range(10))
    table = (5, 9, 2, 7, 3)  # blocks of any ids, in any slab
    stage.forward_slices(StageIO(input_ids=torch.tensor([ids[:64]])), pool, [Slice(table[:4], 0, 64)])
    _poison(stage, pool, [b for b in range(pool.allocated_blocks) if b not in table[2:]])
    freed = (FREED, FREED, *table[2:])
    io = stage.forward_slices(StageIO(input_ids=torch.tensor([ids[64:]])), pool, [Slice(freed, 64, 6)], True)
    assert io.logits is not None
    torch.testing.assert_close(io.logits[0].cpu(), reference, atol=TOLERANCE, rtol=0)
    # A decode at 70 reads positions 39.. : block 2 (32..47) still counts, so it may not be freed.
    with pytest.raises(ValueError, match="freed"):
        stage.forward_slices(StageIO(input_ids=torch.tensor([[1]])), pool, [Slice((FREED,) * 3 + table[3:], 70, 1)])
    with pytest.raises(ValueError, match="block ids are >= 0"):
        Slice((5, FREED, 2), 64, 6)  # freed entries only lead a table


def test_a_stage_with_a_global_layer_keeps_every_block(device: str, tmp_path: Path) -> None:
    """Qwen2 windowed from layer 1 on: one table serves the global layer 0 too, so no block may be freed (and a
    pipeline whose stage 0 holds it frees none, though its stage 1 is all windowed)."""
    overrides = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
    qwen = build_checkpoint("qwen2", tmp_path / "qwen2", overrides=overrides)
    split = Pipeline(qwen, 2, device)
    assert [s.kv_window for s in split.stages] == [None, WINDOW] and kv_window(split) is None
    (stage,) = Pipeline(qwen, 1, device).stages
    pool = stage.block_pool(BLOCK, 8, slab_blocks=8)
    pool.ensure(range(8))
    with pytest.raises(ValueError, match="reads them all"):
        stage.forward_slices(StageIO(input_ids=torch.tensor([[1]])), pool, [Slice((FREED, FREED, FREED, 3, 4), 70, 1)])
