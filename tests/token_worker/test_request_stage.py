"""Stage 0's book and a later stage's pool of a request-scheduled pipeline are sized apart, each by the memory its
host has. Stage 0 publishes how many blocks its book hands out as it begins serving an epoch, and a later stage
waits for that before following: one whose pool cannot hold that many blocks of its layers refuses to serve, naming
the numbers, instead of failing requests once the book hands out ids past its pool. Real Redis; pools without a
model behind them (nothing here computes a pass)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import redis

from dejavu_common import keys
from dejavu_common.messages import StageAssignment, Topology
from dejavu_common.sched import BlockBook, Budget, Scheduler
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import SliceExecutor
from dejavu_token_worker.follow import SliceFollower
from dejavu_token_worker.loop import RequestLoop
from dejavu_token_worker.request_stage import BOOK_FIELD, PoolTooSmall, RequestStage, book_blocks, publish_book
from dejavu_token_worker.runner import Position
from dejavu_worker.metrics import WorkerMetrics
from dejavulib.paged import BlockGeometry, BlockPool

BLOCK = 16
FIRST = StageAssignment(worker_id="t0", stage=0, layers=(0, 2))
SECOND = StageAssignment(worker_id="t1", stage=1, layers=(2, 4))
TOPOLOGY = Topology(epoch=3, mode="colocated", n_layers=4, prompt_microbatch=1, token_microbatch=1,
                    token_stages=(FIRST, SECOND))  # fmt: skip
POSITIONS = (Position(0, 2, "t1", "t0", colocated=False), Position(1, 2, None, "t0", colocated=False))


def _executor(layers: tuple[int, int], blocks: int) -> SliceExecutor:
    """An executor over a pool of ``blocks`` blocks of ``layers`` (no stage: nothing is computed here)."""
    geometry = BlockGeometry(layers[1] - layers[0], 2, BLOCK, 8, "float32", layers[0])
    return SliceExecutor(None, BlockPool(geometry, blocks, slab_blocks=BLOCK))  # type: ignore[arg-type]


def _first(client: redis.Redis, blocks: int) -> RequestStage:
    """Stage 0, whose book hands out the ids of its pool of ``blocks`` blocks."""
    executor = _executor(FIRST.layers, blocks)
    scheduler = Scheduler(
        BlockBook(executor.pool.max_blocks, BLOCK, b"test"), Budget(tokens=32, max_running=4, depth=2)
    )
    emitter = Emitter(client, None, frozenset({0}))
    loop = RequestLoop(scheduler, executor, client, FIRST.worker_id, WorkerMetrics("t0", "token"), emitter, [], depth=2)
    return RequestStage(executor, emitter, loop=loop)


def _last(client: redis.Redis, blocks: int) -> RequestStage:
    """The last stage, over a pool of ``blocks`` blocks."""
    executor = _executor(SECOND.layers, blocks)
    emitter = Emitter(client, None, frozenset({0}))
    follower = SliceFollower(executor, Idle(), emitter)  # type: ignore[arg-type]
    return RequestStage(executor, emitter, follower=follower)


class Idle:
    """A data endpoint over which nothing arrives."""

    def recv(self, channel: object, timeout_s: float) -> None:
        return None


def _calls(answers: Iterable[bool], then: Callable[[int], None] = lambda n: None) -> Callable[[], bool]:
    """A ``stop`` answering ``answers`` in turn (``then(n)`` runs at the ``n``-th call first), then True."""
    it, count = iter(answers), [0]

    def stop() -> bool:
        count[0] += 1
        then(count[0])
        return next(it, True)

    return stop


def _run(stage: RequestStage, client: redis.Redis, index: int, stop: Callable[[], bool]) -> None:
    stage.run(TOPOLOGY, POSITIONS[index], client, None, None, lambda mbs: None, stop)


def test_stage_0_publishes_its_books_blocks_as_it_begins_serving(client: redis.Redis) -> None:
    _run(_first(client, 128), client, 0, lambda: True)
    assert client.hget(keys.worker("t0"), BOOK_FIELD) == b"0:2:128"


def test_a_later_stage_whose_pool_cannot_hold_stage_0s_book_refuses_to_serve(client: redis.Redis) -> None:
    _run(_first(client, 128), client, 0, lambda: True)
    last = _last(client, 96)
    with pytest.raises(PoolTooSmall, match=r"token stage 1's KV pool holds 96 blocks .* book hands out 128"):
        _run(last, client, 1, _calls([False] * 3))
    assert last.follower is not None and last.follower.first_peer == ""  # it never began following


def test_a_later_stage_whose_pool_holds_stage_0s_book_follows(client: redis.Redis) -> None:
    _run(_first(client, 128), client, 0, lambda: True)
    last = _last(client, 160)
    _run(last, client, 1, _calls([False, False]))  # the book is read, then the follower runs until stopped
    assert last.follower is not None and last.follower.first_peer == "t0"


def test_a_later_stage_waits_for_the_book_of_the_layers_stage_0_serves_now(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A record an earlier load of other layers left is waited past; a worker that never publishes is waited for
    until the epoch ends (``stop``), and a long wait is logged."""
    client.hset(keys.worker("t0"), BOOK_FIELD, "0:3:999")
    publish_at_third = _calls([False] * 5, lambda n: n == 3 and publish_book(client, "t0", (0, 2), 128))
    assert book_blocks(client, FIRST, publish_at_third) == 128
    client.hset(keys.worker("t0"), BOOK_FIELD, "0:2:many")
    with caplog.at_level("WARNING", logger="dejavu.token_worker"):
        assert book_blocks(client, FIRST, _calls([False, False]), warn_after_s=0.0) is None
    assert [r.message for r in caplog.records].count(
        "still waiting for stage 0 (t0) to say how many blocks its book of layers (0, 2) hands out (its record says "
        "'0:2:many')"
    ) == 1
    assert book_blocks(client, StageAssignment(worker_id="t9", stage=0, layers=(0, 2)), lambda: True) is None
