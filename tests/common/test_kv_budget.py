"""Admission by device KV budget, with hand-computed numbers."""

from __future__ import annotations

import pytest

from dejavu_common.kv_budget import KVBudget, KVBudgetError, max_microbatch_size, resident_microbatches

# SmolLM2-135M as one stage: 30 layers x 3 KV heads x 64 dims x 4 bytes x (K and V) = 46,080 B per token.
SMOLLM2_BPT = 2 * 30 * 3 * 64 * 4


def test_resident_microbatches_follow_the_paper() -> None:
    assert [resident_microbatches(d, swapping=False) for d in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 8]
    assert [resident_microbatches(d, swapping=True) for d in (1, 2, 3, 4, 8)] == [1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="depth"):
        resident_microbatches(0, swapping=True)


def test_without_swapping_all_depth_caches_must_fit() -> None:
    # 10 B/token x 100 positions = 1,000 B per sequence; D = 4 -> 4,000 B per row of microbatch.
    assert max_microbatch_size(40_000, 10, 100, depth=4, swapping=False) == 10
    assert max_microbatch_size(39_999, 10, 100, depth=4, swapping=False) == 9
    assert KVBudget(40_000, 10, 100, 4, False).device_bytes_for(10) == 40_000


def test_swapping_keeps_two_buffers_plus_one_position_of_staging() -> None:
    # Per row: 2 x 1,000 B of buffers + 10 B of staging = 2,010 B.
    budget = KVBudget(40_000, 10, 100, depth=4, swapping=True)
    assert budget.resident == 2
    assert budget.device_bytes_for(1) == 2_010
    assert budget.max_batch() == 19  # 40,000 // 2,010
    assert budget.device_bytes_for(19) == 38_190
    assert budget.host_bytes_for(19) == 4 * 19 * 1_000


def test_swapping_doubles_the_batch_when_the_budget_has_staging_headroom() -> None:
    # Budget of B = 16 without swapping at D = 4, plus 2B positions of staging headroom.
    max_len, depth, b = 512, 4, 16
    device = depth * b * max_len * SMOLLM2_BPT + 2 * b * SMOLLM2_BPT
    assert max_microbatch_size(device, SMOLLM2_BPT, max_len, depth, swapping=False) == b
    assert max_microbatch_size(device, SMOLLM2_BPT, max_len, depth, swapping=True) == 2 * b


def test_depth_two_swaps_through_a_single_buffer() -> None:
    # D = 2: one 1,000 B buffer + 10 B staging per row; without swapping 2,000 B per row.
    assert max_microbatch_size(10_100, 10, 100, depth=2, swapping=True) == 10
    assert max_microbatch_size(10_100, 10, 100, depth=2, swapping=False) == 5


def test_host_budget_bounds_a_swapping_stage() -> None:
    # Host holds D = 4 caches of 1,000 B per row -> 4,000 B per row; 10,000 B of host -> 2 rows.
    assert max_microbatch_size(1_000_000, 10, 100, depth=4, swapping=True, host_bytes=10_000) == 2
    with pytest.raises(KVBudgetError, match=r"host budget 3999 B < 4000 B"):
        max_microbatch_size(1_000_000, 10, 100, depth=4, swapping=True, host_bytes=3_999)


def test_error_says_why_nothing_fits() -> None:
    with pytest.raises(KVBudgetError) as info:
        max_microbatch_size(3_999, 10, 100, depth=4, swapping=False)
    message = str(info.value)
    assert "3999 B" in message and "all 4 in-flight caches" in message and "need 4000 B" in message
    assert "swapping would keep only 2 of the 4 caches" in message
    with pytest.raises(KVBudgetError, match=r"with swapping, 2 device buffer\(s\).*need 2010 B"):
        max_microbatch_size(2_009, 10, 100, depth=4, swapping=True)


@pytest.mark.parametrize("field", ["device_bytes", "bytes_per_token", "max_len", "depth"])
def test_non_positive_inputs_are_rejected(field: str) -> None:
    args = {"device_bytes": 1000, "bytes_per_token": 1, "max_len": 10, "depth": 2, "swapping": True, field: 0}
    with pytest.raises(ValueError, match=field):
        KVBudget(**args)
