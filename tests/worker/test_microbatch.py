"""A token stage's cache of a microbatch starts at the prompt plus a little and grows as tokens are
written, never past the microbatch's span, keeping every position already written."""

from __future__ import annotations

import pytest
import torch

from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_engine.kv_cache import KVCache
from dejavu_worker.microbatch import MicrobatchState
from dejavulib.layout import KVLayout


def _state(prompt_len: int, max_len: int, capacity: int) -> MicrobatchState:
    rows = tuple(
        RowSpec(request_id=f"r{i}", prompt_ids=(1,) * prompt_len, sampling=SamplingSpec(max_tokens=5, seed=i))
        for i in range(2)
    )
    spec = MicrobatchSpec(mb_id=1, rows=rows, prompt_len=prompt_len, max_len=max_len)
    cache = KVCache.allocate(KVLayout(3, 2, 2, capacity, 4, first_layer=5))
    return MicrobatchState(spec, cache, expected_cells=6)


def test_a_cache_doubles_up_to_its_span_and_keeps_what_was_written() -> None:
    state = _state(prompt_len=6, max_len=40, capacity=8)
    k, v = torch.randn(3, 2, 2, 6, 4), torch.randn(3, 2, 2, 6, 4)
    state.write((5, 8), (0, 2), (0, 6), k, v)
    state.ensure_capacity(8)
    assert state.cache.layout.max_len == 8  # fits: no copy
    state.ensure_capacity(9)
    assert state.cache.layout.max_len == 16  # doubled
    state.ensure_capacity(33)
    assert state.cache.layout.max_len == 33  # more than double when asked for
    state.ensure_capacity(40)
    assert state.cache.layout.max_len == 40  # never past the span
    assert torch.equal(state.cache.k[:, :, :, :6], k) and torch.equal(state.cache.v[:, :, :, :6], v)
    assert not state.cache.k[:, :, :, 6:].any()


def test_a_write_past_the_end_grows_the_cache_and_the_span_is_a_hard_limit() -> None:
    state = _state(prompt_len=4, max_len=12, capacity=5)
    k = torch.ones(1, 1, 2, 3, 4)
    state.write((6, 7), (1, 2), (7, 10), k, k)
    assert state.cache.layout.max_len == 10
    assert torch.equal(state.cache.k[1, 1, :, 7:10], k[0, 0])
    with pytest.raises(ValueError, match="grows"):
        state.cache.grown(4)
