"""Passes of per-request slices over a paged pool (Stage.forward_slices) against transformers' forward: a prompt
whole or in chunks of any size, decodes, a chunk over its cached prefix, a prompt after a prefix hit, all mixed
in one pass, one stage or split into stages, on the native kernels and on the device-generic path."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM

from dejavu_common.sched import BlockBook
from dejavu_engine.geometry import Slice
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavulib.paged import BlockPool
from engine.tiny_models import FAMILIES, LAYERS

TOLERANCE = 1e-4
PROMPT, DECODE = 23, 4
# Chunk lengths of the prompt, one pass each: whole, block-aligned for blocks of 4, across block boundaries
# (lengths 5, 1, 6, 11 start at 0, 5, 6, 12), and one token at a time.
PLANS = {"whole": [PROMPT], "aligned": [8, 8, 7], "unaligned": [5, 1, 6, 11], "tokens": [1] * PROMPT}


@pytest.fixture(scope="module")
def models(tiny_checkpoints: dict[str, Path]) -> dict[str, AutoModelForCausalLM]:
    return {
        family: AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        for family, folder in tiny_checkpoints.items()
    }


def _reference(model: AutoModelForCausalLM, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` of one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _stages(folder: Path, stages: int, path: str, device: str, dtype: str = "float32") -> list[Stage]:
    generic = path == "generic"
    return Pipeline(folder, stages, device, dtype, pack_gemms=not generic, native_attention=not generic).stages


def _pools(stages: list[Stage], block_size: int) -> list[BlockPool]:
    return [stage.block_pool(block_size, max_blocks=96, slab_blocks=16) for stage in stages]


class _Table:
    """One request's blocks in a pool, taken from the pool's book as positions are written (what the serving
    policy does for a request): ids from ``books[pool]``, their memory made by :meth:`BlockPool.ensure`."""

    books: ClassVar[weakref.WeakKeyDictionary[BlockPool, BlockBook]] = weakref.WeakKeyDictionary()

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.book = self.book_of(pool)
        self._ids: list[int] = []

    @classmethod
    def book_of(cls, pool: BlockPool) -> BlockBook:
        return cls.books.setdefault(pool, BlockBook(pool.max_blocks, pool.geometry.block_size))

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    @property
    def positions(self) -> int:
        return len(self._ids) * self.pool.geometry.block_size

    def holding(self, positions: int) -> tuple[int, ...]:
        new = self.book.allocate(self.book.blocks_for(positions) - len(self._ids))
        self.pool.ensure(new)
        self._ids += new
        return self.ids

    def release(self) -> None:
        self.book.release(self._ids)
        self._ids = []


def _all_free(pools: list[BlockPool]) -> bool:
    return all(_Table.books[pool].free == pool.max_blocks for pool in pools)


def _run(stages: list[Stage], pools: list[BlockPool], feeds: list[tuple[list[int], int, list]]) -> list[torch.Tensor]:
    """One pass through every stage: ``feeds[i] = (ids, start, tables)`` is a slice of ``ids`` at positions
    ``[start, start + len(ids))`` whose blocks in stage ``k`` are ``tables[k]`` (a :class:`_Table`, or a
    function of the slice's end giving the block ids). Returns each slice's logits of every token."""
    ids = torch.tensor([[token for feed, _, _ in feeds for token in feed]])
    io = StageIO(input_ids=ids)
    for k, (stage, pool) in enumerate(zip(stages, pools, strict=True)):
        pieces = []
        for feed, start, tables in feeds:
            table = tables[k]
            end = start + len(feed)
            pieces.append(Slice(table.holding(end) if isinstance(table, _Table) else table(end), start, len(feed)))
        io = stage.forward_slices(io, pool, pieces, all_logits=True)
    assert io.logits is not None and io.logits.shape[:2] == (1, ids.shape[1])
    return list(io.logits[0].cpu().split([len(feed) for feed, _, _ in feeds]))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("path", ["native", "generic"])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_in_chunks_of_any_size_computes_what_transformers_computes(
    family: str,
    stages: int,
    path: str,
    block_size: int,
    device: str,
    tiny_checkpoints: dict[str, Path],
    models: dict[str, AutoModelForCausalLM],
) -> None:
    """Each chunk attends over the chunks before it (read from its blocks) and itself; then decode steps read
    them all. Every position's logits equal transformers' forward over the whole sequence."""
    ids = torch.randint(3, 300, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = _reference(models[family], ids)
    pipeline = _stages(tiny_checkpoints[family], stages, path, device)
    pools = _pools(pipeline, block_size)
    for plan in PLANS.values():
        tables = [_Table(pool) for pool in pools]
        position = 0
        for n in plan + [1] * DECODE:
            (logits,) = _run(pipeline, pools, [(ids[position : position + n], position, tables)])
            torch.testing.assert_close(logits, expected[position : position + n], atol=TOLERANCE, rtol=0)
            position += n
        assert [t.positions for t in tables] == [-(-(PROMPT + DECODE) // block_size) * block_size] * stages
        for table in tables:
            table.release()
    assert _all_free(pools)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("path", ["native", "generic"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_decodes_chunks_whole_prompts_and_a_prefix_hit_in_one_pass(
    family: str,
    stages: int,
    path: str,
    block_size: int,
    device: str,
    tiny_checkpoints: dict[str, Path],
    models: dict[str, AutoModelForCausalLM],
) -> None:
    """One pass of five requests at different points: A and B decode, C computes a chunk over its first 10
    positions (computed in an earlier pass), D a whole prompt, and E, whose first 32 tokens are A's, only its own
    6 tokens over A's blocks of them (a prefix-cache hit: the blocks are shared, read by both). Each request's
    logits equal transformers' over its sequence alone, and a decode pass of all five afterwards reads what the
    mixed pass wrote."""
    generator = torch.Generator().manual_seed(11)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 300, (n,), generator=generator).tolist()

    a, b, c, d = tokens(37 + 2), tokens(9 + 2), tokens(30), tokens(7 + 1)
    e = a[:32] + tokens(6 + 1)
    model = models[family]
    expected = {name: _reference(model, seq) for name, seq in {"a": a, "b": b, "c": c, "d": d, "e": e}.items()}
    pipeline = _stages(tiny_checkpoints[family], stages, path, device)
    pools = _pools(pipeline, block_size)
    tables = {name: [_Table(pool) for pool in pools] for name in "abcd"}
    # E's blocks: A's for its first 32 positions (whole blocks of both sizes), then its own.
    shared = 32 // block_size
    own = [_Table.book_of(pool).allocate(-(-(len(e) - 32) // block_size)) for pool in pools]
    for pool, ids in zip(pools, own, strict=True):
        pool.ensure(ids)
    e_tables = [lambda end, k=k: tables["a"][k].ids[:shared] + tuple(own[k][: -(-end // block_size) - shared])
                for k in range(stages)]  # fmt: skip
    # Earlier passes: A, B whole; C's first 10 positions.
    for logits, (name, n) in zip(
        _run(pipeline, pools, [(a[:37], 0, tables["a"]), (b[:9], 0, tables["b"]), (c[:10], 0, tables["c"])]),
        [("a", 37), ("b", 9), ("c", 10)],
        strict=True,
    ):
        torch.testing.assert_close(logits, expected[name][:n], atol=TOLERANCE, rtol=0)
    mixed = [
        (a[37:38], 37, tables["a"]),
        (b[9:10], 9, tables["b"]),
        (c[10:21], 10, tables["c"]),
        (d[:7], 0, tables["d"]),
        (e[32:38], 32, e_tables),
    ]
    want = [expected["a"][37:38], expected["b"][9:10], expected["c"][10:21], expected["d"][:7], expected["e"][32:38]]
    for got, wanted in zip(_run(pipeline, pools, mixed), want, strict=True):
        torch.testing.assert_close(got, wanted, atol=TOLERANCE, rtol=0)
    after = [
        (a[38:39], 38, tables["a"]),
        (b[10:11], 10, tables["b"]),
        (c[21:22], 21, tables["c"]),
        (d[7:8], 7, tables["d"]),
        (e[38:39], 38, e_tables),
    ]
    want = [expected["a"][38:39], expected["b"][10:11], expected["c"][21:22], expected["d"][7:8], expected["e"][38:39]]
    for got, wanted in zip(_run(pipeline, pools, after), want, strict=True):
        torch.testing.assert_close(got, wanted, atol=TOLERANCE, rtol=0)
    for name in "abcd":
        for table in tables[name]:
            table.release()
    for pool, ids in zip(pools, own, strict=True):
        _Table.book_of(pool).release(ids)
    assert _all_free(pools)


@pytest.mark.parametrize("path", ["native", "generic"])
def test_bfloat16_chunks_are_as_exact_as_transformers_in_bfloat16(
    path: str, device: str, tiny_checkpoints: dict[str, Path], models: dict[str, AutoModelForCausalLM]
) -> None:
    """bfloat16 weights and KV, a prompt in unaligned chunks then decodes: every position's logits are as close to
    the float32 model's as transformers' own bfloat16 forward is (mean and largest distance, within a factor)."""
    folder = tiny_checkpoints["llama"]
    ids = torch.randint(3, 300, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(5)).tolist()
    f32 = _reference(models["llama"], ids)
    bf16 = _reference(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval(), ids)
    pipeline = _stages(folder, 2, path, device, "bfloat16")
    pools = _pools(pipeline, 4)
    tables = [_Table(pool) for pool in pools]
    position, got = 0, []
    for n in PLANS["unaligned"] + [1] * DECODE:
        got += _run(pipeline, pools, [(ids[position : position + n], position, tables)])
        position += n
    ours, theirs = (torch.cat(got) - f32).abs(), (bf16 - f32).abs()
    assert float(ours.mean()) <= 1.5 * float(theirs.mean()), (ours.mean(), theirs.mean())
    assert float(ours.max()) <= 1.5 * float(theirs.max()), (ours.max(), theirs.max())


def test_a_middle_stage_passes_the_packed_hidden_states(device: str, tiny_checkpoints: dict[str, Path]) -> None:
    """A first stage embeds the slices' ids, a middle stage returns every token's hidden state ``[1, tokens,
    hidden]``, a last stage the logits of each slice's last token ``[slices, 1, vocab]``."""
    stages = _stages(tiny_checkpoints["llama"], 3, "native", device)
    pools = _pools(stages, 4)
    tables = [[_Table(pool) for pool in pools] for _ in range(2)]
    io = StageIO(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11]]))
    for k, stage in enumerate(stages):
        pieces = [Slice(tables[0][k].holding(4), 0, 4), Slice(tables[1][k].holding(3), 0, 3)]
        io = stage.forward_slices(io, pools[k], pieces)
        if not stage.is_last:
            assert io.hidden is not None and io.hidden.shape == (1, 7, stage.spec.hidden_size)
    assert io.logits is not None and io.logits.shape == (2, 1, stages[0].spec.vocab_size)


def test_slices_that_do_not_fit_are_refused_before_anything_is_written(tiny_checkpoints: dict[str, Path]) -> None:
    folder = tiny_checkpoints["llama"]
    stage = Stage(folder, (0, LAYERS))
    pool = stage.block_pool(4, max_blocks=16, slab_blocks=8)
    a, b = pool.allocate(3), pool.allocate(2)
    ids = StageIO(input_ids=torch.tensor([[5, 6, 7]]))
    cases = [
        ([Slice((a[0],), 2, 3)], "does not reach position 5"),  # positions 4 and 5 have no block
        ([Slice((a[0], 63), 2, 3)], "names one past the pool's 8"),  # block 63: no slab holds it yet
        ([Slice((a[0], a[0]), 2, 3)], "repeats a block"),
        ([Slice(tuple(a), 8, 2), Slice((a[2], b[0]), 4, 1)], "written by one slice of the pass and used by another"),
        ([Slice((a[0], b[0]), 6, 1), Slice((a[1], b[0]), 6, 2)], "written by one slice"),  # both write block b[0]
        ([Slice((a[0],), 0, 2)], "in one row"),  # 3 ids for 2 tokens
        ([], "at least one slice"),
    ]
    for slices, message in cases:
        with pytest.raises(ValueError, match=message):
            stage.forward_slices(ids, pool, slices)
    assert not any(slab.any() for slab in pool.k_slabs + pool.v_slabs)
    other = Stage(folder, (1, LAYERS))  # another stage's layers: not this pool
    with pytest.raises(ValueError, match="does not hold stage"):
        other.forward_slices(StageIO(hidden=torch.zeros(1, 1, 64)), pool, [Slice((a[0],), 0, 1)])
    with pytest.raises(ValueError, match=">= 1 token"):
        Slice((a[0],), 0, 0)
    with pytest.raises(ValueError, match="block ids are >= 0"):
        Slice((-1,), 0, 1)


@pytest.mark.model
@pytest.mark.parametrize("stages", [1, 3])
def test_smollm2_generates_transformers_greedy_tokens_from_chunked_prompts(stages: int, smollm2: Path) -> None:
    """The real model, prompts in chunks of 5 and 13 tokens a pass (never block-aligned), alone and all four in
    shared passes: the greedy tokens of transformers' generate() on each prompt alone."""
    from dejavu_common.messages import SamplingSpec
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.generate import Request, generate_batch

    tokenizer = Tokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")] + [
        tokenizer.apply_chat_template([{"role": "user", "content": c}])
        for c in ("What is the tallest mountain on Earth?", "Write a haiku about the sea.")
    ]
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    with torch.inference_mode():
        expected = [
            model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
            for ids in prompts
        ]
    pipeline = Pipeline(smollm2, stages)
    eos = pipeline.spec.eos_token_ids  # generate() stops at them too
    requests = [Request(tuple(ids), SamplingSpec(max_tokens=12, temperature=0), eos) for ids in prompts]
    for budget in (5, 13):
        alone = [generate_batch(pipeline, [r], token_budget=budget)[0][0].token_ids for r in requests]
        together, _ = generate_batch(pipeline, requests, token_budget=budget)
        assert [list(t) for t in alone] == expected
        assert [list(c.token_ids) for c in together] == expected
