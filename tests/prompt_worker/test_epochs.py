"""A prompt worker runs a task only at the epoch (or later) it was queued under: a repair's re-run claimed
in the moment before the worker sees the new topology would otherwise stream its KV to the token stages of
the old epoch, sealed with the old epoch, where it is dropped (and its requests fail 10 s later)."""

from __future__ import annotations

import torch

from dejavu_common.messages import PromptPiece, PromptTask
from dejavu_engine.stage_io import StageIO
from dejavu_prompt_worker.worker import PromptWorker

_IDS = StageIO(input_ids=torch.zeros(1, 1, dtype=torch.long))


def _worker(queue: list[PromptTask]) -> PromptWorker:
    worker = PromptWorker.__new__(PromptWorker)  # the task selection only: no Redis, no model
    worker._held = None
    worker._claim = lambda: (f"1-{queue[0].task_id}", queue.pop(0), _IDS) if queue else None  # type: ignore[method-assign]
    return worker


def _task(task_id: int, epoch: int) -> PromptTask:
    return PromptTask(task_id=task_id, pieces=(PromptPiece(mb_id=task_id, dst_rows=(0, 1)),), epoch=epoch)


def test_a_task_of_a_newer_epoch_waits_for_it_and_runs_first_then() -> None:
    worker = _worker([_task(1, 3), _task(2, 4), _task(3, 4)])
    assert worker._next_task(3, first=True)[1].task_id == 1  # its own epoch
    assert worker._next_task(3, first=True) is None  # task 2 is the re-run of epoch 4: held
    assert worker._next_task(3, first=True) is None  # ... and nothing else is claimed meanwhile
    assert worker._next_task(4, first=True)[1].task_id == 2  # at epoch 4 it runs first
    assert worker._next_task(4, first=True)[1].task_id == 3


def test_a_task_of_an_older_epoch_still_runs() -> None:
    """Queued before a repair that did not touch its microbatch: the pipeline of the newer epoch serves it."""
    worker = _worker([_task(1, 2)])
    assert worker._next_task(5, first=True)[1].task_id == 1
