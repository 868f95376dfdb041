"""Microbatch swapping: same greedy outputs as resident caches, two device buffers, no stale reads."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from engine.tiny_models import LAYERS, VOCAB, build_checkpoint

from dejavu_common.errors import DeadlineExceeded
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage_io import StageIO
from dejavu_worker.swap import SwapInError, SwapManager, SwapState, SwapStateError
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout

STEPS = 6


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: the prefetch thread and the compute share a small, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("swap") / "llama")


@dataclass
class Microbatch:
    """One in-flight microbatch of the simulated token pipeline."""

    geometry: BatchGeometry
    next_ids: torch.Tensor
    tokens: list[list[int]]


def prompts(mb: int, batch: int) -> list[list[int]]:
    """Deterministic prompts of varied lengths (so rows are left-padded)."""
    rng = random.Random(mb)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))] for _ in range(batch)]


def prefill(pipeline: Pipeline, rows: list[list[int]], caches: list[KVCache]) -> Microbatch:
    geometry = BatchGeometry.for_prompts([len(r) for r in rows])
    ids = torch.zeros(len(rows), geometry.cur_len, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, geometry.pad_lens[i] :] = torch.tensor(row)
    first = pipeline.forward(ids, caches, geometry)[:, -1].argmax(-1)
    return Microbatch(geometry, first.unsqueeze(1), [[t] for t in first.tolist()])


def decode_step(
    pipeline: Pipeline,
    mb: Microbatch,
    caches: list[KVCache],
    before_stage: Callable[[int], KVCache] | None = None,
    after_stage: Callable[[int], None] | None = None,
) -> None:
    """One token step of ``mb`` through every stage. ``before_stage(s)`` returns stage ``s``'s cache
    (default ``caches[s]``); ``after_stage(s)`` runs after its compute."""
    mb.geometry = mb.geometry.advance()
    io = StageIO(input_ids=mb.next_ids)
    for s, stage in enumerate(pipeline.stages):
        cache = before_stage(s) if before_stage else caches[s]
        io = stage.decode(io, cache, mb.geometry)
        if after_stage:
            after_stage(s)
    assert io.logits is not None
    tokens = io.logits[:, -1].argmax(-1)
    mb.next_ids = tokens.unsqueeze(1)
    for row, token in zip(mb.tokens, tokens.tolist(), strict=True):
        row.append(token)


def run_resident(pipeline: Pipeline, sizes: list[int], max_len: int) -> tuple[list[Microbatch], list[list[KVCache]]]:
    """Reference: every microbatch's caches stay allocated on the device, round-robin decode."""
    caches = [pipeline.allocate(b, max_len) for b in sizes]
    mbs = [prefill(pipeline, prompts(i, b), caches[i]) for i, b in enumerate(sizes)]
    for _ in range(STEPS):
        for i, mb in enumerate(mbs):
            decode_step(pipeline, mb, caches[i])
    return mbs, caches


def run_swapped(pipeline: Pipeline, sizes: list[int], max_len: int, managers: list[SwapManager]) -> list[Microbatch]:
    """The token pipeline with swapping: per stage, acquire -> prefetch(next) -> decode -> commit."""
    depth = len(sizes)
    host = [
        [m.add(i, st.kv_layout(b, max_len)) for m, st in zip(managers, pipeline.stages, strict=True)]
        for i, b in enumerate(sizes)
    ]
    mbs = [prefill(pipeline, prompts(i, b), host[i]) for i, b in enumerate(sizes)]  # prompt KV lands in host memory
    for m in managers:
        m.prefetch(0, mbs[0].geometry.cur_len)
    for step in range(STEPS):
        for i, mb in enumerate(mbs):
            nxt = (i + 1) % depth if (step, i) != (STEPS - 1, depth - 1) else None  # None: nothing follows

            def acquire(s: int, i: int = i, nxt: int | None = nxt) -> KVCache:
                cache = managers[s].acquire(i)
                if nxt is not None:
                    managers[s].prefetch(nxt, mbs[nxt].geometry.cur_len)  # overlaps this step's compute
                return cache

            def commit(s: int, i: int = i, mb: Microbatch = mb) -> None:
                managers[s].commit(i, (mb.geometry.cur_len - 1, mb.geometry.cur_len))

            decode_step(pipeline, mb, [], acquire, commit)
    return mbs


def managers_for(pipeline: Pipeline, batch: int, max_len: int, depth: int) -> list[SwapManager]:
    return [SwapManager(stage.kv_layout(batch, max_len), depth, "cpu") for stage in pipeline.stages]


@pytest.fixture
def closing() -> Iterator[list[SwapManager]]:
    """Managers a test registers here are closed (their prefetch threads joined) afterwards."""
    managers: list[SwapManager] = []
    yield managers
    for m in managers:
        m.close()


# depth = microbatches in flight; the tiny model has 3 layers, so depth 4 runs over 3 stages.
@pytest.mark.parametrize(("depth", "sizes"), [(2, (2, 3)), (3, (1, 3, 2)), (4, (4, 1, 2, 4))])
def test_swapping_matches_resident_caches(
    tiny_llama: Path, depth: int, sizes: tuple[int, ...], closing: list[SwapManager]
) -> None:
    pipeline = Pipeline(tiny_llama, stages=min(depth, LAYERS))
    max_len = 8 + STEPS + 1
    reference, ref_caches = run_resident(pipeline, list(sizes), max_len)
    managers = managers_for(pipeline, max(sizes), max_len, depth)
    closing.extend(managers)
    swapped = run_swapped(pipeline, list(sizes), max_len, managers)
    for i, (ref, got) in enumerate(zip(reference, swapped, strict=True)):
        assert got.tokens == ref.tokens, f"microbatch {i}"
        filled = got.geometry.cur_len
        for s, m in enumerate(managers):
            host, resident = m.host(i), ref_caches[i][s]
            assert torch.equal(host.k[:, :, :, :filled], resident.k[:, :, :, :filled]), (i, s)
            assert torch.equal(host.v[:, :, :, :filled], resident.v[:, :, :, :filled]), (i, s)
    stats = managers[0].stats()
    assert stats.swap_ins == stats.swap_outs == depth * STEPS
    assert stats.swap_out_bytes == STEPS * sum(sizes) * managers[0].layout.bytes_per_token


LAYOUT = KVLayout(layers=2, batch=4, kv_heads=2, max_len=16, head_dim=8)


@pytest.mark.parametrize("depth", [2, 3, 4, 8])
def test_device_holds_two_buffers_not_depth(depth: int, closing: list[SwapManager]) -> None:
    m = SwapManager(LAYOUT, depth, "cpu")
    closing.append(m)
    for i in range(depth):
        m.add(i, LAYOUT)
    buffers = 1 if depth == 2 else 2
    staging = LAYOUT.batch * LAYOUT.bytes_per_token  # one position of every row, K and V
    assert m.slots == buffers
    assert m.device_bytes == buffers * LAYOUT.bytes_total + staging
    assert m.host_bytes == depth * LAYOUT.bytes_total + staging
    assert m.device_bytes < depth * LAYOUT.bytes_total or depth == 2


def filled_cache(m: SwapManager, mb: int, value: float, layout: KVLayout = LAYOUT) -> KVCache:
    cache = m.add(mb, layout)
    cache.k.fill_(value)
    cache.v.fill_(-value)
    return cache


def test_slow_swap_in_is_waited_for_never_read_stale(closing: list[SwapManager]) -> None:
    log: list[str] = []

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        time.sleep(0.3)  # an artificially slow link
        dst.copy_(src)
        log.append("copied")

    m = SwapManager(LAYOUT, depth=2, device="cpu", copy=slow_copy)  # one buffer: mb 1 reuses mb 0's
    closing.append(m)
    filled_cache(m, 0, 1.0)
    host1 = filled_cache(m, 1, 2.0)
    m.prefetch(0, LAYOUT.max_len)
    m.acquire(0)
    m.commit(0, (3, 3))  # frees the buffer, which still holds mb 0's values
    log.clear()
    m.prefetch(1, 5)
    assert m.state(1) in (SwapState.QUEUED, SwapState.LOADING)
    device = m.acquire(1)
    log.append("acquired")
    assert log == ["copied", "copied", "acquired"]
    assert torch.equal(device.k[:, :, :, :5], host1.k[:, :, :, :5])
    assert torch.equal(device.v[:, :, :, :5], host1.v[:, :, :, :5])
    assert m.stats().acquire_wait_s > 0


def test_acquire_deadline_raises_a_typed_error(closing: list[SwapManager]) -> None:
    gate = threading.Event()

    def stuck_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        gate.wait(10)
        dst.copy_(src)

    m = SwapManager(LAYOUT, depth=3, device="cpu", copy=stuck_copy)
    closing.append(m)
    filled_cache(m, 0, 1.0)
    m.prefetch(0, 4)
    with pytest.raises(DeadlineExceeded, match="microbatch 0"):
        m.acquire(0, deadline_s=0.2)
    gate.set()
    assert torch.equal(m.acquire(0).k[:, :, :, :4], m.host(0).k[:, :, :, :4])


def test_failed_swap_in_is_reraised_on_acquire(closing: list[SwapManager]) -> None:
    def broken_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        raise RuntimeError("link down")

    m = SwapManager(LAYOUT, depth=3, device="cpu", copy=broken_copy)
    closing.append(m)
    filled_cache(m, 0, 1.0)
    m.prefetch(0, 4)
    with pytest.raises(SwapInError, match="link down"):
        m.acquire(0)
    m.drop(0)
    filled_cache(m, 0, 1.0)  # the freed buffers serve a new microbatch
    m.prefetch(0, 0)
    m.acquire(0)


def test_commit_copies_back_only_the_written_positions(closing: list[SwapManager]) -> None:
    m = SwapManager(LAYOUT, depth=4, device="cpu")
    closing.append(m)
    small = replace(LAYOUT, batch=3)
    host = filled_cache(m, 0, 1.0, small)
    m.prefetch(0, 6)
    device = m.acquire(0)
    assert device.layout == small and device.k.data_ptr() != host.k.data_ptr()
    device.k.fill_(7.0)  # a step writes position 6; everything else in the buffer must not travel back
    device.v.fill_(-7.0)
    m.commit(0, (6, 7))
    expected_k = torch.ones(small.shape)
    expected_k[:, :, :, 6] = 7.0
    assert torch.equal(host.k, expected_k)
    assert torch.equal(host.v, -expected_k)
    assert m.state(0) is SwapState.HOST
    assert m.stats().swap_out_bytes == small.batch * small.bytes_per_token


def test_multi_position_commit_goes_through_the_staging_buffer_in_chunks(closing: list[SwapManager]) -> None:
    m = SwapManager(LAYOUT, depth=3, device="cpu", staging_positions=2)
    closing.append(m)
    host = filled_cache(m, 0, 0.0)
    m.prefetch(0, 0)
    device = m.acquire(0)
    device.k.copy_(torch.arange(device.k.numel(), dtype=torch.float32).view(LAYOUT.shape))
    m.commit(0, (2, 7))
    assert torch.equal(host.k[:, :, :, 2:7], device.k[:, :, :, 2:7])
    assert not host.k[:, :, :, :2].any() and not host.k[:, :, :, 7:].any()


def test_protocol_misuse_is_rejected(closing: list[SwapManager]) -> None:
    m = SwapManager(LAYOUT, depth=3, device="cpu")
    closing.append(m)
    filled_cache(m, 0, 1.0)
    with pytest.raises(SwapStateError, match="without a prefetch"):
        m.acquire(0)
    with pytest.raises(SwapStateError, match="commit while host"):
        m.commit(0, (0, 1))
    with pytest.raises(SwapStateError, match="already registered"):
        m.add(0, LAYOUT)
    with pytest.raises(SwapStateError, match="not registered"):
        m.prefetch(9, 0)
    with pytest.raises(ValueError, match="does not fit"):
        m.add(1, replace(LAYOUT, batch=5))
    with pytest.raises(ValueError, match="does not match"):
        m.add(1, replace(LAYOUT, first_layer=2, layers=2))
    m.prefetch(0, 3)
    m.prefetch(0, 3)  # idempotent while pending
    with pytest.raises(SwapStateError, match=r"(ready|loading|queued) -> queued"):
        m.prefetch(0, 4)


def test_drop_frees_the_buffer_in_any_state(closing: list[SwapManager]) -> None:
    m = SwapManager(LAYOUT, depth=2, device="cpu")  # a single buffer makes a leak visible
    closing.append(m)
    for mb in range(3):
        filled_cache(m, mb, float(mb))
    m.prefetch(0, 4)
    m.acquire(0)
    m.prefetch(1, 4)  # queued behind mb 0's buffer
    m.drop(1)
    m.drop(0)  # in use: the buffer is released
    m.prefetch(2, 4)
    assert torch.equal(m.acquire(2).k[:, :, :, :4], m.host(2).k[:, :, :, :4])
    m.commit(2, (4, 5))
    assert m.host_bytes == LAYOUT.bytes_total + LAYOUT.batch * LAYOUT.bytes_per_token
