"""The paged pool: block geometry, allocation and return of blocks, and a paged cache that holds exactly what
a contiguous ``KVCache`` of the same layout holds, region by region."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout, Which
from dejavulib.paged import BlockGeometry, BlockPool, PagedKVCache, PoolExhausted

LAYOUT = KVLayout(layers=3, batch=4, kv_heads=2, max_len=40, head_dim=8, first_layer=5)


def test_block_geometry_counts_blocks_and_maps_positions_to_chunks() -> None:
    g = BlockGeometry.of(LAYOUT, block_size=16)
    assert g.bytes_per_block == 2 * 3 * 2 * 16 * 8 * 4
    assert (g.blocks(1), g.blocks(16), g.blocks(17)) == (1, 1, 2)
    assert g.first_block(15) == 0 and g.first_block(16) == 1
    blocks, offsets = g.slots((14, 35))  # positions 14-15 in block 0, 16-31 in block 1, 32-34 in block 2
    assert blocks.tolist() == [0] * 2 + [1] * 16 + [2] * 3
    assert offsets.tolist() == [14, 15, *range(16), 0, 1, 2]
    assert [t.tolist() for t in g.slots((16, 17))] == [[1], [0]]
    with pytest.raises(ValueError):
        g.slots((3, 3))
    with pytest.raises(ValueError):
        BlockGeometry(1, 1, 0, 8)


def test_pool_grows_by_slabs_up_to_its_bound_and_takes_nothing_when_short() -> None:
    pool = BlockPool(BlockGeometry.of(LAYOUT, 4), max_blocks=10, slab_blocks=4)
    # Whole slabs only: 2 blocks of a third slab could never be made, so they are not counted as free
    # (counting them admitted prompts whose blocks then could not be had).
    assert (pool.max_blocks, pool.allocated_blocks, pool.free_blocks) == (8, 0, 8)
    a = pool.allocate(5)
    assert len(set(a)) == 5 and pool.allocated_blocks == 8 and pool.free_blocks == 3
    with pytest.raises(PoolExhausted):
        pool.allocate(4)  # the bound holds, and nothing is taken
    assert pool.free_blocks == 3 and pool.used_blocks == 5
    b = pool.allocate(pool.free_blocks)  # every block said to be free can be had
    assert pool.free_blocks == 0 and not set(a) & set(b)
    pool.free(a + b)
    assert pool.used_blocks == 0 and pool.free_blocks == 8
    assert BlockPool(BlockGeometry.of(LAYOUT, 4), max_blocks=3, slab_blocks=4).max_blocks == 3  # one small slab


def _filled(layout: KVLayout, seed: int) -> KVCache:
    torch.manual_seed(seed)
    cache = KVCache.allocate(layout)
    cache.k.copy_(torch.randn(layout.shape))
    cache.v.copy_(torch.randn(layout.shape))
    return cache


def _region_bytes(cache: KVCache | PagedKVCache, region) -> torch.Tensor:
    out = torch.empty(region.nbytes(cache.layout), dtype=torch.uint8)
    return cache.pack(region, out).clone()


@pytest.mark.parametrize("slab_blocks", [64, 3], ids=["one-slab", "many-slabs"])
def test_a_paged_cache_holds_what_a_contiguous_cache_holds(slab_blocks: int) -> None:
    pads = (0, 5, 17, 2)
    pool = BlockPool(BlockGeometry.of(LAYOUT, 8), max_blocks=64, slab_blocks=slab_blocks)
    paged = pool.cache(LAYOUT, pads).holding(30)
    # Blocks wholly in a row's padding are never taken: row 2 (pad 17) starts at block 2.
    assert paged.blocks_held == 4 + 4 + 2 + 4
    source = _filled(LAYOUT, 0)
    whole = LAYOUT.region(positions=(0, 30))
    paged.unpack(whole, _region_bytes(source, whole))
    reference = KVCache.allocate(LAYOUT)
    reference.unpack(whole, _region_bytes(source, whole))
    for r, pad in enumerate(pads):  # padding of a row without a block reads as zeros
        if pad >= 8:
            reference.k[:, r, :, : (pad // 8) * 8] = 0
            reference.v[:, r, :, : (pad // 8) * 8] = 0
    for region in (
        whole,
        LAYOUT.region(layers=(6, 8), rows=(1, 3), positions=(3, 29)),
        LAYOUT.region(positions=(29, 30), which=Which.V),
        LAYOUT.region(layers=(5, 6), rows=(2, 3), positions=(16, 24), which=Which.K),
    ):
        assert torch.equal(_region_bytes(paged, region), _region_bytes(reference, region)), region
    dense = paged.dense(30)
    assert torch.equal(dense.k, reference.k[:, :, :, :30]) and torch.equal(dense.v, reference.v[:, :, :, :30])


def test_written_positions_go_back_from_a_dense_copy_and_a_decode_step_lands_in_its_block() -> None:
    pool = BlockPool(BlockGeometry.of(LAYOUT, 8), max_blocks=64)
    paged = pool.cache(LAYOUT).holding(9)
    dense = paged.dense(9)
    dense.k[:, :, :, 8] = 1.5
    paged.write_back(dense, (8, 9))
    assert torch.equal(paged.dense(9).k, dense.k)
    step = LAYOUT.region(positions=(8, 9))
    assert torch.all(_region_bytes(paged, step)[0] == 1.5)  # [which][layer][row][head][position][dim]: K


def test_blocks_are_taken_as_positions_are_written_and_returned_by_row_and_by_cache() -> None:
    pool = BlockPool(BlockGeometry.of(LAYOUT, 8), max_blocks=20, slab_blocks=4)
    paged = pool.cache(LAYOUT)
    assert paged.blocks_needed(17) == 12 and paged.blocks_held == 0
    paged.holding(17)
    assert pool.used_blocks == 12 and paged.holding(17) is paged and pool.used_blocks == 12
    paged.free_rows([1, 3])
    assert pool.used_blocks == 6 and paged.blocks_needed(25) == 2  # live rows 0 and 2 only
    with pytest.raises(PoolExhausted):
        pool.cache(LAYOUT).holding(40)  # 20 blocks wanted, 14 free: nothing taken
    assert pool.used_blocks == 6
    with pytest.raises(ValueError):
        paged.holding(41)  # past the span
    paged.free()
    assert pool.used_blocks == 0
    with pytest.raises(ValueError):
        paged.holding(30)  # a freed cache takes nothing again
    paged.free()  # idempotent


def test_a_cache_dropped_without_free_returns_its_blocks() -> None:
    pool = BlockPool(BlockGeometry.of(LAYOUT, 8), max_blocks=20)
    pool.cache(LAYOUT).holding(16)
    gc.collect()
    assert pool.used_blocks == 0


def test_a_layout_of_other_heads_is_refused() -> None:
    pool = BlockPool(BlockGeometry.of(LAYOUT, 8), max_blocks=4)
    with pytest.raises(ValueError):
        PagedKVCache(pool, dataclasses.replace(LAYOUT, first_layer=0, layers=3))


def test_an_evicted_cache_keeps_its_contents_in_host_memory_and_takes_blocks_back_when_used() -> None:
    pool = BlockPool(BlockGeometry.of(LAYOUT, 8), max_blocks=16, slab_blocks=4)
    paged = pool.cache(LAYOUT, (0, 3, 9, 0)).holding(20)
    source = _filled(LAYOUT, 1)
    written = LAYOUT.region(positions=(0, 20))
    paged.unpack(written, _region_bytes(source, written))
    before = _region_bytes(paged, written)
    held = pool.used_blocks
    assert paged.evict() == held and paged.evicted and pool.used_blocks == 0 and paged.nbytes > 0
    assert paged.evict() == 0  # once
    assert torch.equal(_region_bytes(paged, written), before)  # read from the host copy meanwhile
    step = LAYOUT.region(positions=(20, 21))
    paged.unpack(step, _region_bytes(source, step))  # a write while evicted lands in the host copy
    other = pool.cache(LAYOUT).holding(32)  # someone else takes 16 blocks: nothing left
    with pytest.raises(PoolExhausted):
        paged.holding(21)
    assert paged.evicted and torch.equal(_region_bytes(paged, written), before)  # still whole, still evicted
    other.free()
    paged.holding(24)
    assert not paged.evicted and pool.used_blocks == held  # position 20 is in block 2, taken already
    assert torch.equal(_region_bytes(paged, written), before)
    assert torch.equal(_region_bytes(paged, step), _region_bytes(source, step))
    assert paged.evictions == 1
