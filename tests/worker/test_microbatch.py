"""A worker's microbatch state. A token stage's cache of a microbatch starts at the prompt plus a little
and grows as tokens are written, never past the microbatch's span, keeping every position already
written; waiting for a spec ends at its deadline, or at once when the epoch changes."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_worker.microbatch import MicrobatchState, fetch_spec
from dejavulib.endpoint import Message
from dejavulib.errors import IntegrityError
from dejavulib.header import Channel, Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout, Region


def _place(state: MicrobatchState, layers, rows, positions, k, v) -> None:
    """Deliver K/V of a region to ``state`` as a DejaVuLib KV message (packed: K then V)."""
    data = torch.stack((k, v)).reshape(-1).view(torch.uint8).numpy()
    header = Header(Channel.KV_PROMPT, microbatch=state.mb_id, layers=layers, rows=rows, positions=positions,
                    which=3, nbytes=data.nbytes)  # fmt: skip
    state.place(Region(state.mb_id, layers, rows, positions), Message(header, data))


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
    _place(state, (5, 8), (0, 2), (0, 6), k, v)
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
    _place(state, (6, 7), (1, 2), (7, 10), k, k)
    assert state.cache.layout.max_len == 10
    assert torch.equal(state.cache.k[1, 1, :, 7:10], k[0, 0])
    with pytest.raises(ValueError, match="grows"):
        state.cache.grown(4)
    with pytest.raises(ValueError, match="span"):
        _place(state, (6, 7), (1, 2), (11, 13), torch.ones(1, 1, 2, 2, 4), torch.ones(1, 1, 2, 2, 4))
    with pytest.raises(IntegrityError):  # a payload that is not the region's bytes is refused, not misread
        _place(state, (6, 7), (0, 2), (7, 10), k, k)


def test_waiting_for_a_spec_ends_at_its_deadline_or_at_once_when_the_epoch_changes(redis_url: str) -> None:
    """After a Redis restart a microbatch's spec never comes back: a worker waiting for it must move on to
    the new epoch at once, not sit out the deadline (which once made a Redis recovery take 22.7 s)."""
    client = redis.Redis.from_url(redis_url)
    spec = _state(prompt_len=4, max_len=16, capacity=8).spec
    client.set(keys.microbatch(1), spec.encode())
    assert fetch_spec(client, 1, 0.0) == spec
    with pytest.raises(DeadlineExceeded, match=r"after 0\.2 s"):
        fetch_spec(client, 2, 0.2)
    changed = threading.Event()
    threading.Timer(0.1, changed.set).start()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="epoch changed"):
        fetch_spec(client, 2, 60.0, changed.is_set)
    assert time.monotonic() - started < 30  # not the 60 s deadline
    # a spec that appears while waiting is returned
    threading.Timer(0.1, lambda: client.set(keys.microbatch(3), spec.model_copy(update={"mb_id": 3}).encode())).start()
    assert fetch_spec(client, 3, 30.0, lambda: False).mb_id == 3
    client.close()


def test_the_kv_status_follows_arrival_preemption_and_release() -> None:
    from dejavu_worker.microbatch import IllegalKVTransition, KVStatus
    from dejavulib.paged import BlockGeometry, BlockPool

    layout = KVLayout(3, 2, 2, 40, 4, first_layer=5)
    pool = BlockPool(BlockGeometry.of(layout, 4), max_blocks=64)
    state = _state(prompt_len=6, max_len=40, capacity=8)
    state.cache = pool.cache(layout)
    assert state.status is KVStatus.RECEIVING and state.preempt() == 0  # nothing to move before it is whole
    k, v = torch.randn(3, 2, 2, 6, 4), torch.randn(3, 2, 2, 6, 4)
    _place(state, (5, 8), (0, 2), (0, 6), k, v)
    state.add_prompt_cells((5, 8), (0, 2))
    assert state.status is KVStatus.READY and state.complete.is_set() and state.done_step == 0
    assert state.preempt() == 4 and state.status is KVStatus.PREEMPTED and pool.used_blocks == 0
    state.ensure_capacity(7)  # computed again: back in blocks, whole
    assert state.status is KVStatus.READY and pool.used_blocks == 4
    back = state.cache.dense(6)
    assert torch.equal(back.k, k) and torch.equal(back.v, v)
    assert state.preempt() == 4 and state.discard() == 0  # preempted: its blocks are back, its host copy goes
    assert state.status is KVStatus.DISCARDED and not state.cache.evicted and state.preempt() == 0
    state.ensure_capacity(7)  # a recompute pass takes blocks for every position and rewrites them
    assert state.status is KVStatus.READY and pool.used_blocks == 4 and state.discard() == 4
    state.ensure_capacity(7)
    state.release()
    assert state.status is KVStatus.RELEASED and pool.used_blocks == 0
    state.release()  # idempotent
    with pytest.raises(ValueError):
        state.ensure_capacity(8)  # nothing revives it
    with pytest.raises(IllegalKVTransition):
        state._move(KVStatus.READY)
