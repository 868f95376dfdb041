"""Prompts over a paged pool with a prefix cache (:mod:`dejavu_prompt_worker.paged`): prompt stage 0's planner (books
only), the split of a task into passes, and a two-stage prompt pipeline of a tiny random-weight Llama checkpoint,
whose prompt logits after a prefix hit and over chunked passes equal transformers' forward over the whole prompt,
and whose later stage refuses a cached block it never wrote or a chunk whose earlier ones it did not compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine.tiny_models import build_checkpoint
from transformers import AutoModelForCausalLM

from dejavu_common.messages import PromptSlice
from dejavu_common.sched import BlockBook
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_prompt_worker.paged import PagedPrompts, Prompt, PromptPlanner, SliceLogits, input_ids, split_passes

BLOCK = 4


def _planner(blocks: int = 32) -> PromptPlanner:
    return PromptPlanner(BlockBook(blocks, BLOCK, b"test"))


# -- the planner ------------------------------------------------------------------------------------------------
def test_a_computed_prompt_is_found_by_the_next_one_that_shares_its_whole_blocks() -> None:
    planner = _planner()
    system = list(range(100, 110))  # 2 whole blocks and 2 positions
    first = [Prompt(1, [*system, 7, 8, 9])]
    (s1,) = planner.plan(1, first)
    assert (s1.start, s1.end, len(s1.table), s1.writers) == (0, 13, 4, ())
    planner.finish(1, [s1], first)
    assert planner.book.free == 32  # referenced by nobody, its 3 full blocks still cached

    second = [Prompt(2, [*system, 7, 8, 9, 10, 11]), Prompt(3, [*system, 5])]
    s2, s3 = planner.plan(2, second)
    assert (s2.start, s2.end, s2.table[:3], s2.writers) == (12, 15, s1.table[:3], (1, 1, 1))
    assert (s3.start, s3.table[:2], s3.writers) == (8, s1.table[:2], (1, 1))  # the system prompt's 2 blocks
    assert planner.book.ref(s1.table[0]) == 2
    stats = planner.book.stats()
    assert (stats.queries, stats.hits) == (13 + 15 + 11, 12 + 8)
    planner.abort([s2, s3])  # a failed task caches nothing of its own
    (s4,) = planner.plan(4, [Prompt(4, [*system, 7, 8, 9, 10, 11])])
    assert s4.start == 12 and s4.writers == (1, 1, 1)


def test_a_whole_cached_prompt_still_computes_its_last_block() -> None:
    planner = _planner()
    prompt = [Prompt(1, list(range(8)))]
    (s1,) = planner.plan(1, prompt)
    planner.finish(1, [s1], prompt)
    (s2,) = planner.plan(2, prompt)
    assert (s2.start, s2.end) == (4, 8)  # the last position has to be computed for its logits


def test_a_request_for_prompt_log_probabilities_computes_everything_but_is_cached_for_others() -> None:
    planner = _planner()
    ids = list(range(12))
    (s1,) = planner.plan(1, [Prompt(1, ids, looks_up=False)])
    planner.finish(1, [s1], [Prompt(1, ids, looks_up=False)])
    (s2,) = planner.plan(2, [Prompt(2, ids, looks_up=False)])
    assert s2.start == 0
    planner.abort([s2])
    (s3,) = planner.plan(3, [Prompt(3, [*ids, 1])])
    assert s3.start == 12


def test_a_task_the_pool_cannot_hold_is_refused_and_references_nothing() -> None:
    planner = _planner(blocks=5)
    prompts = [Prompt(1, list(range(12))), Prompt(2, list(range(50, 62)))]  # 3 + 3 blocks
    with pytest.raises(ValueError, match="cannot hold task 7"):
        planner.plan(7, prompts)
    assert planner.book.free == 5


def test_cached_blocks_are_evicted_least_recently_used_first_when_the_pool_needs_them() -> None:
    planner = _planner(blocks=4)
    old = [Prompt(1, list(range(8)))]
    (s1,) = planner.plan(1, old)
    planner.finish(1, [s1], old)
    fresh = [Prompt(2, list(range(50, 66)))]  # 4 blocks: both cached ones are taken
    (s2,) = planner.plan(2, fresh)
    planner.finish(2, [s2], fresh)
    (s3,) = planner.plan(3, old)
    assert s3.start == 0


# -- passes ---------------------------------------------------------------------------------------------------
def test_a_task_splits_into_passes_of_the_budget_and_long_prompts_into_chunks() -> None:
    planner = _planner(64)
    system = list(range(100, 108))
    first = [Prompt(1, [*system, 1])]
    planner.finish(1, planner.plan(1, first), first)
    prompts = [Prompt(2, system + list(range(20))), Prompt(3, list(range(50, 55))), Prompt(4, list(range(60, 70)))]
    plan = planner.plan(2, prompts)
    assert [s.start for s in plan] == [8, 0, 0]
    passes = split_passes(plan, tokens=12, block_size=BLOCK)
    got = [[(s.mb, s.start, s.end, len(s.table), s.writers) for s in p] for p in passes]
    assert got == [
        [(2, 8, 20, 5, (1, 1))],  # the cached prefix is read by the first chunk only
        [(2, 20, 28, 7, ()), (3, 0, 4, 1, ())],
        [(3, 4, 5, 2, ()), (4, 0, 10, 3, ())],
    ]
    assert all(sum(s.end - s.start for s in p) <= 12 for p in passes)
    # A slice that needs every position's logits is never split: it closes the pass before it and goes alone.
    whole = split_passes(plan, tokens=12, block_size=BLOCK, whole={0})
    assert [[(s.mb, s.start, s.end) for s in p] for p in whole] == [[(2, 8, 28)], [(3, 0, 5), (4, 0, 7)], [(4, 7, 10)]]
    with pytest.raises(ValueError, match=">= 1 position"):
        split_passes(plan, tokens=0, block_size=BLOCK)


# -- a two-stage pipeline of a tiny checkpoint -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))


def _stages(folder: Path) -> list[PagedPrompts]:
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    stages = [Stage(folder, layers, "cpu", "float32") for layers in ((0, n // 2), (n // 2, n))]
    return [PagedPrompts(s, s.block_pool(BLOCK, 64, slab_blocks=8)) for s in stages]


def _run(stages: list[PagedPrompts], task_id: int, slices, prompts, every=()) -> SliceLogits:
    io = StageIO(input_ids=input_ids(slices, prompts))
    for paged in stages:
        paged.check(task_id, slices)
        out = paged.run(io, slices, every)
        paged.computed(task_id, slices)
        if isinstance(out, SliceLogits):
            return out
        io = StageIO(hidden=out)
    raise AssertionError("the last stage returns logits")


def test_prompts_after_a_prefix_hit_give_transformers_logits(tiny: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    stages, planner = _stages(tiny), _planner(64)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, 100, (17,), generator=gen).tolist()
    first = [Prompt(1, [*system, 3, 4]), Prompt(2, torch.randint(0, 100, (9,), generator=gen).tolist())]
    slices = planner.plan(1, first)
    _run(stages, 1, slices, first)
    planner.finish(1, slices, first)

    second = [Prompt(3, [*system, 5, 6, 7]), Prompt(4, [*system, 3, 4, 8], looks_up=False)]
    slices = planner.plan(2, second)
    assert [s.start for s in slices] == [16, 0]
    out = _run(stages, 2, slices, second, every={1})
    with torch.inference_mode():
        for i, p in enumerate(second):
            expected = reference(torch.tensor([list(p.ids)])).logits[0]
            torch.testing.assert_close(out.last[i], expected[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.every[1], expected, rtol=1e-4, atol=1e-4)


def test_a_later_stage_refuses_a_cached_block_it_did_not_write(tiny: Path) -> None:
    stages, planner = _stages(tiny), _planner(64)
    prompt = [Prompt(1, list(range(10)))]
    slices = planner.plan(1, prompt)
    stages[0].run(StageIO(input_ids=input_ids(slices, prompt)), slices)  # the later stage failed this task
    stages[0].computed(1, slices)
    planner.finish(1, slices, prompt)
    (hit,) = planner.plan(2, [Prompt(2, [*list(range(10)), 11])])
    assert hit.start == 8
    stages[0].check(2, [hit])
    with pytest.raises(ValueError, match="was not written here by task 1"):
        stages[1].check(2, [hit])
    with pytest.raises(ValueError, match="were not computed here"):  # not a cached prefix: an earlier chunk
        stages[1].check(2, [PromptSlice(mb=2, start=6, end=11, table=hit.table, writers=(1,))])


def test_a_long_prompt_in_chunks_over_a_cached_prefix_gives_transformers_logits(tiny: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    stages, planner = _stages(tiny), _planner(64)
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, 100, (12,), generator=gen).tolist()
    first = [Prompt(1, [*system, 3])]
    plan = planner.plan(1, first)
    _run(stages, 1, plan, first)
    planner.finish(1, plan, first)
    prompts = [Prompt(2, system + torch.randint(0, 100, (29,), generator=gen).tolist())]
    plan = planner.plan(2, prompts)
    passes = split_passes(plan, tokens=7, block_size=BLOCK)
    assert len(passes) == 5 and plan[0].start == 12
    for k, slices in enumerate(passes):
        out = _run(stages, 2, slices, prompts)
        if k < len(passes) - 1:  # a later chunk cannot be computed where the earlier one was not
            with pytest.raises(ValueError, match="were not computed here"):
                skipping = {"start": slices[0].end + 1, "end": slices[0].end + 2, "table": plan[0].table}
                stages[1].check(2, [slices[0].model_copy(update=skipping)])
    with torch.inference_mode():
        expected = reference(torch.tensor([list(prompts[0].ids)])).logits[0, -1]
    torch.testing.assert_close(out.last[0], expected, rtol=1e-4, atol=1e-4)
