"""Microbatches whose caches are blocks of a paged pool compute what contiguous caches compute: prefill,
grouped decode at different steps, some rows only, in the native paged kernel and through the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dejavu_engine import native
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from engine.tiny_models import FAMILIES, LAYERS

STEPS = 5
GROUPS = [[9, 4], [3], [6, 6, 2], [5, 5]]  # prompt lengths per microbatch: padded, alone, padded, unpadded


def _prefill(stages: list[Stage], caches: list, geometry: BatchGeometry, ids: torch.Tensor) -> torch.Tensor:
    io = StageIO(input_ids=ids)
    for stage, cache in zip(stages, caches, strict=True):
        io = stage.prefill(io, cache, geometry)
    assert io.logits is not None
    return io.logits


# bfloat16 through the native kernels, paged against contiguous (the kernels against torch's attention in
# bfloat16: tests/engine/test_native.py, and transformers' tokens: tests/engine/test_smollm2.py).
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-4}


@pytest.mark.parametrize(
    ("native_attention", "dtype"),
    [(True, "float32"), (False, "float32"), (True, "bfloat16")],
    ids=["native", "torch", "native-bfloat16"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_caches_compute_what_contiguous_caches_compute(
    family: str, native_attention: bool, dtype: str, device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    folder = tiny_checkpoints[family]
    ranges = [(0, 2), (2, LAYERS)]
    plain = [Stage(folder, r, device, dtype, native_attention=native_attention) for r in ranges]
    paged = [Stage(folder, r, device, dtype, native_attention=native_attention) for r in ranges]
    atol = TOLERANCE[dtype]
    pools = [s.block_pool(block_size=4, max_blocks=64, slab_blocks=8) for s in paged]
    generator = torch.Generator().manual_seed(3)
    state = []
    for lengths in GROUPS:
        geometry = BatchGeometry.for_prompts(lengths)
        ids = torch.zeros(len(lengths), geometry.cur_len, dtype=torch.long)
        for row, n in enumerate(lengths):
            ids[row, geometry.pad_lens[row] :] = torch.randint(3, 300, (n,), generator=generator)
        span = geometry.cur_len + STEPS
        contiguous = [s.allocate_cache(len(lengths), span) for s in plain]
        blocks = [pool.cache(s.kv_layout(len(lengths), span), geometry.pad_lens).holding(geometry.cur_len)
                  for s, pool in zip(paged, pools, strict=True)]  # fmt: skip
        torch.testing.assert_close(
            _prefill(paged, blocks, geometry, ids), _prefill(plain, contiguous, geometry, ids), atol=atol, rtol=0
        )
        for cache, reference in zip(blocks, contiguous, strict=True):  # the blocks hold what the rows hold
            dense = cache.dense(geometry.cur_len)
            for row, pad in enumerate(geometry.pad_lens):
                for got, want in ((dense.k, reference.k), (dense.v, reference.v)):
                    torch.testing.assert_close(
                        got[:, row, :, pad:], want[:, row, :, pad : geometry.cur_len], atol=atol, rtol=0
                    )
        state.append([geometry, contiguous, blocks])
    assert all(pool.used_blocks > 0 for pool in pools)
    tokens = torch.randint(3, 300, (sum(len(g) for g in GROUPS), STEPS), generator=generator)
    for step in range(STEPS):
        # From step 2 on, row 1 of the last microbatch has finished: it leaves the computation and its
        # blocks go back to the pool.
        done = step >= 2
        if step == 2:
            for cache in state[2][2]:
                cache.free_rows([1])
        feeds, groups_plain, groups_paged, row = [], [], [], 0
        for i, (geometry, contiguous, blocks) in enumerate(state):
            geometry = state[i][0] = geometry.advance()
            rows = (0, 2) if (i == 2 and done) else tuple(range(geometry.batch))
            feeds.append(tokens[[row + r for r in rows], step : step + 1])
            groups_plain.append((contiguous, geometry.only(rows)))
            groups_paged.append((blocks, geometry.only(rows)))
            row += geometry.batch
        io_plain = io_paged = StageIO(input_ids=torch.cat(feeds))
        for s in range(len(ranges)):
            io_plain = plain[s].decode_groups(io_plain, [(cs[s], g) for cs, g in groups_plain])
            io_paged = paged[s].decode_groups(io_paged, [(cs[s], g) for cs, g in groups_paged])
        torch.testing.assert_close(io_paged.logits, io_plain.logits, atol=atol, rtol=0)
    for _, _, blocks in state:
        for cache in blocks:
            cache.free()
    assert all(pool.used_blocks == 0 for pool in pools)


def test_the_paged_kernel_is_used_where_it_applies(device: str, tiny_checkpoints: dict[str, Path]) -> None:
    stage = Stage(tiny_checkpoints["llama"], (0, LAYERS), device)
    if not stage.native_attention:
        pytest.skip("native kernels unavailable on this host")
    assert stage.paged_attention
    assert not Stage(tiny_checkpoints["llama"], (0, LAYERS), native_attention=False).paged_attention
    assert not Stage(tiny_checkpoints["bloom"], (0, LAYERS)).paged_attention  # ALiBi biases: not in the kernel
    assert Stage(tiny_checkpoints["llama"], (0, LAYERS), dtype="bfloat16").paged_attention


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bloom"])  # ALiBi: no paged kernel, no mixing
def test_a_mixed_pass_computes_a_decode_step_and_a_prefill(
    family: str, dtype: str, device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """Decoding rows of two microbatches and the prefill of a third (left-padded prompts) in one pass give the
    logits and caches that a decode step and a prefill give one after the other."""
    folder = tiny_checkpoints[family]
    mixed, apart = Stage(folder, (0, LAYERS), device, dtype), Stage(folder, (0, LAYERS), device, dtype)
    if not mixed.mixes:
        pytest.skip("native kernels unavailable on this host")
    assert not Stage(folder, (0, 2), dtype=dtype).mixes  # only a stage that is the whole model mixes
    runs = []
    for stage in (mixed, apart):
        pool = stage.block_pool(block_size=4, max_blocks=64, slab_blocks=8)
        groups = []
        for lengths in ([9, 4], [3]):  # already prefilled, decoding
            geometry = BatchGeometry.for_prompts(lengths)
            ids = torch.randint(3, 300, (len(lengths), geometry.cur_len), generator=torch.Generator().manual_seed(1))
            cache = pool.cache(stage.kv_layout(len(lengths), geometry.cur_len + STEPS), geometry.pad_lens)
            stage.prefill(StageIO(input_ids=ids), cache.holding(geometry.cur_len), geometry)
            groups.append((cache, geometry.advance()))
        feed = StageIO(input_ids=torch.tensor([[11], [12], [13]]))
        geometry = BatchGeometry.for_prompts([6, 6, 2])
        ids = torch.zeros(3, geometry.cur_len, dtype=torch.long)
        for row, n in enumerate([6, 6, 2]):
            ids[row, geometry.pad_lens[row] :] = torch.randint(
                3, 300, (n,), generator=torch.Generator().manual_seed(row)
            )
        cache = pool.cache(stage.kv_layout(3, geometry.cur_len + STEPS), geometry.pad_lens)
        if stage is mixed:
            logits = stage.mixed(feed, groups, (StageIO(input_ids=ids), cache, geometry)).logits
        else:
            decoded = stage.decode_groups(feed, groups).logits
            prefilled = stage.prefill(StageIO(input_ids=ids), cache, geometry).logits
            logits = torch.cat([decoded, prefilled])
        # One more decode step of all three reads what the mixed pass wrote.
        groups = [(c, g.advance()) for c, g in groups] + [(cache, geometry.advance())]
        after = stage.decode_groups(StageIO(input_ids=torch.arange(20, 26).unsqueeze(1)), groups).logits
        runs.append((logits, after))
        for c, _ in groups:
            c.free()
        assert pool.used_blocks == 0
    (logits, after), (logits_apart, after_apart) = runs
    assert logits is not None and logits.shape == (6, 1, mixed.spec.vocab_size)
    torch.testing.assert_close(logits, logits_apart, atol=1e-4, rtol=0)
    torch.testing.assert_close(after, after_apart, atol=1e-4, rtol=0)


@pytest.mark.parametrize("from_len", [None, 5, 1], ids=["kernel", "split", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_over_a_cache_with_a_finished_row_keeps_nothing_of_it(
    dtype: str, from_len: int | None, device: str, tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recompute prefills every row of its microbatch, the finished ones too: a finished row holds no blocks
    and takes none, and the other rows' logits and K/V are what a contiguous cache gives, whichever prompts
    attend through torch's flash attention rather than the native kernel (native.torch_prefill_from)."""
    folder = tiny_checkpoints["llama"]
    paged, plain = Stage(folder, (0, LAYERS), device, dtype), Stage(folder, (0, LAYERS), device, dtype)
    if not paged.prefills_into_blocks:
        pytest.skip("native kernels unavailable on this host")
    monkeypatch.setattr(native, "torch_prefill_from", lambda _dtype: from_len)
    pool = paged.block_pool(block_size=4, max_blocks=64, slab_blocks=8)
    geometry = BatchGeometry.for_prompts([6, 9, 3])
    ids = torch.randint(3, 300, (3, geometry.cur_len), generator=torch.Generator().manual_seed(2))
    cache = pool.cache(paged.kv_layout(3, geometry.cur_len + STEPS), geometry.pad_lens)
    cache.free_rows([1])
    got = paged.prefill(StageIO(input_ids=ids), cache, geometry).logits
    contiguous = plain.allocate_cache(3, geometry.cur_len + STEPS)
    want = plain.prefill(StageIO(input_ids=ids), contiguous, geometry).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (cache.table[1] < 0).all() and pool.used_blocks == (cache.table >= 0).sum() == 3 + 2  # positions 3-8, 6-8
    dense = cache.dense(geometry.cur_len)
    for row in (0, 2):
        pad = geometry.pad_lens[row]
        for got_kv, want_kv in ((dense.k, contiguous.k), (dense.v, contiguous.v)):
            torch.testing.assert_close(
                got_kv[:, row, :, pad:], want_kv[:, row, :, pad : geometry.cur_len], atol=1e-4, rtol=0
            )
    cache.free()


def test_a_pool_whose_blocks_a_book_allocates_makes_the_slabs_of_the_ids_it_is_given() -> None:
    from dejavu_common.sched import BlockBook
    from dejavulib.paged import BlockGeometry, BlockPool

    pool = BlockPool(BlockGeometry(layers=2, kv_heads=1, block_size=4, head_dim=8), max_blocks=8, slab_blocks=4)
    book = BlockBook(pool.max_blocks, pool.geometry.block_size)
    pool.ensure(book.allocate(3))  # ids 0-2: the first slab
    assert pool.allocated_blocks == 4
    pool.ensure([5])
    assert pool.allocated_blocks == 8 and len(pool.layer(0)[0]) == 2
    pool.ensure([])
    with pytest.raises(ValueError, match="past the pool"):
        pool.ensure([8])
