"""Colocated intake at token stage 0: the tasks the controller queues for the prompts this pipeline computes.

The controller queues one :class:`PromptTask` per token microbatch on the colocated stream, under the topology
epoch it was dispatched at. A worker claims them through the stream's consumer group (acknowledged at once: a task
a worker dies holding is re-queued by the repair, never re-read from the group). A task queued under a newer epoch
than the one served is *held* (its pass would carry the old epoch and be dropped by stages already serving the new
one) and taken once that epoch is served; one queued under an older epoch is *stale* and dropped: every epoch after
the first comes with a repair that queues again, under the new epoch, each microbatch still in flight.
"""

from __future__ import annotations

import logging
import time

import redis
from pydantic import ValidationError

from dejavu_common import keys
from dejavu_common.messages import PromptTask

log = logging.getLogger("dejavu.token_worker.intake")


class ColocatedQueue:
    """The colocated stream as one worker at one epoch claims it. ``held`` is kept by the worker across epochs
    (tasks of an epoch it does not serve yet); a task taken back after a failure is put back at its head."""

    def __init__(self, client: redis.Redis, worker_id: str, epoch: int, held: list[PromptTask]) -> None:
        self.redis = client
        self.worker_id = worker_id
        self.epoch = epoch
        self.held = held

    def claim(self, block: bool) -> PromptTask | None:
        """The next task to run at this epoch: a held one first, else one claimed now (waiting up to 5 ms when
        ``block``), or None."""
        while self.held and self._stale(self.held[0]):
            self.held.pop(0)
        if self.held:
            if self.held[0].epoch <= self.epoch:
                return self.held.pop(0)
            if block:
                time.sleep(0.005)  # idle until the newer topology ends this epoch (the claim would have blocked)
            return None
        task = self._claim_queued(block)
        if task is None or self._stale(task):
            return None
        if task.epoch > self.epoch:
            log.info("colocated task %d was queued at epoch %d: holding it (serving %d)", task.task_id, task.epoch,
                     self.epoch)  # fmt: skip
            self.held.append(task)
            return None
        return task

    def put_back(self, task: PromptTask) -> None:
        """``task`` was claimed but not begun (no room yet, or an error came first): it is claimed first next."""
        if task not in self.held:
            self.held.insert(0, task)

    def _stale(self, task: PromptTask) -> bool:
        """Whether ``task`` was queued under an older epoch than this one (its microbatches were queued again by
        the repair that began this epoch): dropped, and logged."""
        if task.epoch >= self.epoch:
            return False
        log.info("dropped colocated task %d of epoch %d: the repair at epoch %d queued its prompts again",
                 task.task_id, task.epoch, self.epoch)  # fmt: skip
        return True

    def _claim_queued(self, block: bool) -> PromptTask | None:
        resp = self.redis.xreadgroup(
            keys.COLOCATED_GROUP, self.worker_id, {keys.COLOCATED_QUEUE: ">"}, count=1, block=5 if block else None
        )
        entries = [e for _s, es in resp or [] for e in es]
        if not entries:
            return None
        entry_id, fields = entries[0]
        self.redis.xack(keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP, entry_id)
        try:
            return PromptTask.decode(fields[b"task"])
        except (KeyError, ValidationError) as exc:
            log.error("dropped a malformed colocated task: %s", exc)
            return None
