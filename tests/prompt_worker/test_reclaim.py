"""Prompt stage 0 takes over a prompt task claimed long ago and never finished (real Redis, no model).

A stage that stalls, or activations lost between stages, leave the task pending in the queue's consumer
group with no change of topology to re-run it: without a reclaim its requests would wait for their
request timeout. Stage 0 claims such a task again (XAUTOCLAIM past ``recovery.prompt_reclaim_s``) and
runs it, unless it is stale: of an epoch before the one served, or of a microbatch that has ended.
"""

from __future__ import annotations

import pytest
import redis

from dejavu_common import keys
from dejavu_common.messages import MicrobatchSpec, PromptPiece, PromptTask, RowSpec, SamplingSpec
from dejavu_common.settings import Settings
from dejavu_prompt_worker.worker import PromptWorker


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.xgroup_create(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, id="0", mkstream=True)
    yield c
    c.close()


def _worker(client: redis.Redis, reclaim_s: float, epoch: int = 3) -> PromptWorker:
    """Stage 0's task selection only: Redis, settings and the epoch it serves; no model, no data plane."""
    base = Settings()
    worker = PromptWorker.__new__(PromptWorker)
    worker.settings = base.model_copy(
        update={"recovery": base.recovery.model_copy(update={"prompt_reclaim_s": reclaim_s})}
    )
    worker.redis = client
    worker.worker_id = "p0"
    worker.serve_epoch = epoch
    worker._held = None
    worker._reclaim_at = 0.0
    worker._reclaim_cursor = "0-0"
    return worker


def _queue(client: redis.Redis, mb_id: int, epoch: int = 3, spec: bool = True) -> str:
    """Queue a one-row prompt task for microbatch ``mb_id`` and let a stage that then stalls claim it."""
    if spec:
        row = RowSpec(request_id=f"r{mb_id}", prompt_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=4, seed=1))
        client.set(keys.microbatch(mb_id), MicrobatchSpec(mb_id=mb_id, rows=(row,), prompt_len=3, max_len=7).encode())
    task = PromptTask(task_id=mb_id, pieces=(PromptPiece(mb_id=mb_id, dst_rows=(0, 1)),), epoch=epoch)
    entry = client.xadd(keys.PROMPT_QUEUE, {"task": task.encode()})
    client.xreadgroup(keys.PROMPT_GROUP, "p-stalled", {keys.PROMPT_QUEUE: ">"}, count=1)
    return entry.decode()


def _pending(client: redis.Redis) -> dict[str, str]:
    """Pending entry id -> the consumer holding it."""
    rows = client.xpending_range(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, "-", "+", 100)
    return {r["message_id"].decode(): r["consumer"].decode() for r in rows}


def test_a_task_claimed_and_never_finished_is_claimed_again_and_run(client) -> None:
    entry = _queue(client, 1)
    worker = _worker(client, reclaim_s=1e-4)  # anything pending is overdue
    claimed = worker._claim()
    assert claimed is not None
    got_entry, task, io = claimed
    assert got_entry == entry and task.task_id == 1
    assert io.input_ids.tolist() == [[1, 2, 3]]
    assert _pending(client) == {entry: "p0"}  # still pending, now under stage 0, until its last stage acks


def test_stale_unfinished_tasks_are_acknowledged_not_run(client) -> None:
    _queue(client, 1, epoch=2)  # queued before the epoch served: the repair that began it re-ran it
    _queue(client, 2, spec=False)  # its microbatch has ended
    fresh = _queue(client, 3)
    worker = _worker(client, reclaim_s=1e-4)
    claimed = worker._claim()
    assert claimed is not None and claimed[0] == fresh
    assert _pending(client) == {fresh: "p0"}


def test_a_task_claimed_recently_is_left_to_its_stage(client) -> None:
    entry = _queue(client, 1)
    worker = _worker(client, reclaim_s=60.0)
    assert worker._claim() is None
    new = client.xadd(
        keys.PROMPT_QUEUE,
        {"task": PromptTask(task_id=9, pieces=(PromptPiece(mb_id=1, dst_rows=(0, 1)),), epoch=3).encode()},
    )
    claimed = worker._claim()
    assert claimed is not None and claimed[0] == new.decode()  # the next new task, not the pending one
    assert _pending(client) == {entry: "p-stalled", new.decode(): "p0"}
