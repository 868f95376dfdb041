"""A request-scheduled pipeline of several stages, in-process over a real Redis and the real default model split in
stages: stage 0's :class:`RequestLoop` plans and computes its layers and sends each pass on, later stages
(:class:`SliceFollower`, each on its own thread) compute theirs over pools whose block ids stage 0's book hands out,
and the last stage samples, publishes and answers. The passes travel through an in-memory wire standing in for the
endpoints (the endpoints themselves are tested with the transports). Every stream is checked against transformers'
greedy ``generate``: prompts chunked under a small budget with passes of one stage in flight per stage, a prefix
found cached, prompt log probabilities, a pass the last stage's Redis does not take, and a pass a later stage's
values break."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from dejavu_common.messages import FinishReason, SamplingSpec
from dejavu_common.sched import BlockBook, Budget, Scheduler
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_token_worker.downstream import Downstream
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import SliceExecutor
from dejavu_token_worker.follow import SliceFollower
from dejavu_token_worker.loop import RequestLoop
from dejavu_worker.endpoint import Channel
from dejavu_worker.lifecycle import SERVE_RETRYABLE
from dejavu_worker.metrics import WorkerMetrics

from .test_request_loop import (
    BLOCK,
    GREEDY,
    Reference,
    Stream,
    _assert_exact,
    _assert_prompt_logprobs,
    _entries,
    _Pipeline,
    _queue,
    _spec,
    _stream,
    _until,
)

pytestmark = pytest.mark.model


class Wire:
    """Queues per (peer, channel): what a DataEndpoint sends to a peer arrives on that peer's channel, in order."""

    def __init__(self) -> None:
        self.queues: dict[tuple[str, Channel], queue.Queue[bytes]] = {}
        self.lock = threading.Lock()

    def of(self, peer: str, channel: Channel) -> queue.Queue[bytes]:
        with self.lock:
            return self.queues.setdefault((peer, channel), queue.Queue())


class WireEndpoint:
    """The two calls of :class:`~dejavu_worker.endpoint.DataEndpoint` a request-scheduled stage makes."""

    def __init__(self, name: str, wire: Wire) -> None:
        self.name, self.wire = name, wire

    def send(self, peer: str, channel: Channel, payload: bytes) -> None:
        self.wire.of(peer, channel).put(bytes(payload))

    def recv(self, channel: Channel, timeout_s: float) -> memoryview | None:
        try:
            return memoryview(self.wire.of(self.name, channel).get(timeout=max(timeout_s, 1e-4)))
        except queue.Empty:
            return None


@pytest.fixture(scope="module")
def stages(folder: Path) -> list[Stage]:
    """The default model in three float32 stages."""
    stages = Pipeline(folder, 3, "cpu", "float32").stages
    if not all(s.paged_attention for s in stages):
        pytest.skip("a request-scheduled pipeline needs the native paged attention kernels")
    return stages


@pytest.fixture(scope="module")
def reference(folder: Path, stages: list[Stage]) -> Reference:
    ref = Reference(folder)
    assert ref.eos == stages[-1].spec.eos_token_ids
    return ref


class Running:
    """Stage 0's loop (run by the test) and the later stages' followers on their threads. A follower that raises
    an error its worker outlives serves again, as the worker's lifecycle does; ``errors`` keeps what was raised."""

    def __init__(self, client: redis.Redis, stages: list[Stage], blocks: int, tokens: int) -> None:
        wire = Wire()
        names = [f"s{i}" for i in range(len(stages))]
        pools = [s.block_pool(BLOCK, blocks, slab_blocks=16) for s in stages]
        book = BlockBook(pools[0].max_blocks, BLOCK, b"SmolLM2-135M|float32|16")
        scheduler = Scheduler(book, Budget(tokens=tokens, max_running=8, depth=len(stages)))
        eos = stages[-1].spec.eos_token_ids
        endpoints = [WireEndpoint(name, wire) for name in names]
        downstream = Downstream(endpoints[0], names[1], len(stages), 60.0)  # type: ignore[arg-type]
        metrics = WorkerMetrics(names[0], "token")
        executors = [SliceExecutor(stage, pool) for stage, pool in zip(stages, pools, strict=True)]
        first = Emitter(client, None, eos)
        self.loop = RequestLoop(scheduler, executors[0], client, names[0], metrics, first, [], 8, depth=len(stages))
        self.loop.downstream = self.downstream = downstream
        # The last stage's own client (a test makes its writes fail).
        self.emitter = Emitter(redis.Redis(connection_pool=client.connection_pool), None, eos)
        self.followers = []
        for ex, ep, nxt in zip(executors[1:], endpoints[1:], [*names[2:], None], strict=True):
            follower = SliceFollower(ex, ep, self.emitter if nxt is None else None)  # type: ignore[arg-type]
            follower.connect(nxt, names[0], None)
            self.followers.append(follower)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._follow, args=(f,), daemon=True) for f in self.followers]
        self.most_in_flight = 0

    def _follow(self, follower: SliceFollower) -> None:
        while not self.stop.is_set():
            try:
                follower.run(self.stop.is_set)
            except SERVE_RETRYABLE as exc:
                self.errors.append(exc)

    def __enter__(self) -> Running:
        collect = self.loop._collect

        def counting(down: Downstream, wait: bool) -> None:
            self.most_in_flight = max(self.most_in_flight, len(down.inflight))
            collect(down, wait)

        self.loop._collect = counting  # type: ignore[method-assign]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


@pytest.fixture
def pipeline(client: redis.Redis, stages: list[Stage]) -> Iterator[Running]:
    with Running(client, stages, blocks=64, tokens=32) as running:
        yield running


def _all_free(loop: RequestLoop) -> bool:
    book = loop.scheduler.book
    idle = loop.downstream is None or not loop.downstream.inflight
    return book.free == book.num_blocks and not loop.requests.served and len(loop.scheduler) == 0 and idle


def test_prompts_chunked_over_three_stages_with_passes_in_flight_deliver_transformers_greedy_tokens(
    client: redis.Redis, pipeline: Running, reference: Reference, text_ids: list[int]
) -> None:
    """Prompts of 3 to 150 tokens, budget 32 positions a pass, three stages: up to three passes are in flight,
    each request's stream is transformers' greedy one, and every block is free at the end."""
    cases = {
        mb: (text_ids[offset : offset + length], SamplingSpec(max_tokens=n, temperature=0))
        for mb, (offset, length, n) in enumerate([(0, 3, 6), (5, 150, 5), (40, 17, 8), (70, 45, 6), (100, 9, 2)], 1)
    }
    for mb, (prompt, sampling) in cases.items():
        _queue(client, _spec(mb, prompt, sampling))
    pipeline.loop.run(_until(pipeline.loop, cases))
    for mb, (prompt, sampling) in cases.items():
        _assert_exact(client, reference, mb, prompt, sampling)
    assert pipeline.most_in_flight >= 2
    assert _all_free(pipeline.loop) and not pipeline.errors
    assert not pipeline.emitter.records  # the last stage forgot every request that ended


def test_a_cached_prefix_is_skipped_on_every_stage_and_prompt_logprobs_are_exact(
    client: redis.Redis, pipeline: Running, reference: Reference, text_ids: list[int]
) -> None:
    """The second request sharing a 64-token prefix hits it (stage 0's book names blocks every stage wrote) and is
    exact; a third asks for its prompt's log probabilities, computed on the last stage, transformers' within 1e-4."""
    prefix = text_ids[:64]
    first, second = prefix + text_ids[100:120], prefix + text_ids[150:165]
    _queue(client, _spec(1, first, GREEDY))
    pipeline.loop.run(_until(pipeline.loop, [1]))
    hits = pipeline.loop.scheduler.book.stats().hits
    _queue(client, _spec(2, second, GREEDY))
    wants = SamplingSpec(max_tokens=3, temperature=0, prompt_logprobs=2)
    third = text_ids[30:100]
    _queue(client, _spec(3, third, wants))
    pipeline.loop.run(_until(pipeline.loop, [2, 3]))
    assert pipeline.loop.scheduler.book.stats().hits - hits == 64
    _assert_exact(client, reference, 1, first, GREEDY)
    _assert_exact(client, reference, 2, second, GREEDY)
    _assert_exact(client, reference, 3, third, wants)
    _assert_prompt_logprobs(_entries(client, 3)[0].prompt_logprobs[0], third, reference, 2)
    assert _all_free(pipeline.loop)


@pytest.mark.parametrize("written", [False, True], ids=["refused", "reply-lost"])
def test_a_pass_whose_tokens_the_last_stage_cannot_write_runs_again_and_every_stream_is_exact(
    written: bool,
    client: redis.Redis,
    pipeline: Running,
    reference: Reference,
    text_ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last stage's token write of one pass fails (Redis refuses it, or applies it and the reply is lost): the
    stage answers the pass broken and serves on; stage 0 runs its requests again from their streams, and no step is
    lost or emitted twice."""
    sampling = SamplingSpec(max_tokens=6, temperature=0)
    prompts = {mb: text_ids[20 * mb : 20 * mb + 25] for mb in range(1, 4)}
    plan: dict[str, int | bool] = {"left": 3, "written": written}
    last = pipeline.emitter.redis
    real = last.pipeline
    monkeypatch.setattr(last, "pipeline", lambda *a, **kw: _Pipeline(real(*a, **kw), plan))
    for mb, prompt in prompts.items():
        _queue(client, _spec(mb, prompt, sampling))
    pipeline.loop.run(_until(pipeline.loop, prompts))
    assert len(pipeline.errors) == 1 and plan["left"] == -1
    for mb, prompt in prompts.items():
        _assert_exact(client, reference, mb, prompt, sampling)
    assert _all_free(pipeline.loop)


def test_a_pass_a_later_stage_cannot_compute_fails_its_requests_and_the_others_are_served(
    client: redis.Redis, pipeline: Running, reference: Reference, text_ids: list[int]
) -> None:
    """Stage 1 raises on the pass holding request 2's slice (its values broke it there): request 2 ends with an
    error after what it delivered, the other requests are exact, and every block is free again."""
    follower = pipeline.followers[0]
    forward = follower.executor.forward

    def breaking(pieces, io, every=()):  # type: ignore[no-untyped-def]
        if io.hidden is not None and torch.isfinite(io.hidden).all() and _has(pipeline, "2"):
            raise RuntimeError("the values of this pass broke stage 1")
        return forward(pieces, io, every)

    follower.executor.forward = breaking  # type: ignore[method-assign]
    sampling = SamplingSpec(max_tokens=4, temperature=0)
    prompts = {mb: text_ids[10 * mb : 10 * mb + 12] for mb in range(1, 4)}
    _queue(client, _spec(1, prompts[1], sampling))
    _queue(client, _spec(3, prompts[3], sampling))
    pipeline.loop.run(_until(pipeline.loop, [1, 3]))
    _queue(client, _spec(2, prompts[2], sampling))
    pipeline.loop.run(_until(pipeline.loop, [2]))
    assert _stream(client, 2) == Stream([], FinishReason.ERROR)
    for mb in (1, 3):
        _assert_exact(client, reference, mb, prompts[mb], sampling)
    assert _all_free(pipeline.loop)


def _has(pipeline: Running, rid: str) -> bool:
    return any(s.request.request_id == rid for f in pipeline.downstream.inflight.values() for s in f.step.slices)


def test_preempted_requests_are_released_on_every_stage_so_tables_never_overlap(
    client: redis.Redis, stages: list[Stage], reference: Reference, text_ids: list[int]
) -> None:
    """A pool too small for what is admitted: stage 0 preempts requests and hands their blocks to others, and tells
    the later stages with that pass (``released``), so no stage ever holds two requests' tables over one block
    (what a replaced stage 0 takes requests over from); every stream is still transformers' greedy one."""
    overlaps: list[str] = []
    with Running(client, stages, blocks=16, tokens=64) as running:
        for follower in running.followers:
            handle = follower.handle

            def checked(msg, handle=handle, follower=follower) -> None:
                handle(msg)
                owners: dict[int, int] = {}
                for mb, (table, _end) in list(follower.held.items()):
                    for block in table:
                        if block >= 0 and owners.setdefault(block, mb) != mb:
                            overlaps.append(f"block {block}: requests {owners[block]} and {mb}")

            follower.handle = checked  # type: ignore[method-assign]
        cases = {
            mb: (text_ids[40 * mb : 40 * mb + 60], SamplingSpec(max_tokens=40, temperature=0)) for mb in range(1, 5)
        }
        for mb, (prompt, sampling) in cases.items():
            _queue(client, _spec(mb, prompt, sampling))
        running.loop.run(_until(running.loop, cases))
        registry = running.loop.requests.metrics.registry
        preempted = registry.get_sample_value("dejavu_preemptions_total", {"mode": "recompute"})
        for mb, (prompt, sampling) in cases.items():
            _assert_exact(client, reference, mb, prompt, sampling)
        assert not overlaps, overlaps[:3]
        assert not running.errors
    assert preempted and preempted > 0
