"""Token stage 0's intake of requests: colocated tasks (the prompts this pipeline computes) and, disaggregated,
the prompts a prompt pipeline announces done (:class:`Announcements`).

The controller queues one :class:`PromptTask` per token microbatch on the colocated stream, under the topology
epoch it was dispatched at. A worker claims them through the stream's consumer group (acknowledged at once: a task
a worker dies holding is re-queued by the repair, never re-read from the group). A task queued under a newer epoch
than the one served is *held* (its pass would carry the old epoch and be dropped by stages already serving the new
one) and taken once that epoch is served; one queued under an older epoch is *stale* and dropped: every epoch after
the first comes with a repair that queues again, under the new epoch, each microbatch still in flight.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis
from pydantic import ValidationError

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import MicrobatchSpec, PromptTask
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_worker.microbatch import fetch_spec

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


class ColocatedIntake:
    """The requests a colocated pipeline's stage 0 takes: each task of the colocated stream names one request (a
    one-row microbatch), whose spec it reads; a task that names anything else fails its requests (``refuse``)."""

    def __init__(self, queue: ColocatedQueue, refuse: Callable[[MicrobatchSpec, Exception], None]) -> None:
        self.queue = queue
        self.redis = queue.redis
        self.refuse = refuse

    def specs(self, block: bool, most: int) -> Iterator[tuple[PromptTask, MicrobatchSpec]]:
        """Up to ``most`` tasks claimed now (waiting a moment for the first when ``block``) with their requests'
        specs. A task whose caller fails to take it (Redis failing) goes back with :meth:`ColocatedQueue.put_back`."""
        for _ in range(most):
            task = self.queue.claim(block)
            if task is None:
                return
            block = False
            try:
                spec = self._spec(task)
            except redis.RedisError:
                self.put_back(task)
                raise
            if spec is not None:
                yield task, spec

    def put_back(self, task: PromptTask) -> None:
        """``task`` was claimed (acknowledged) but not taken, as Redis failed: the next claim returns it first."""
        self.queue.put_back(task)

    def _spec(self, task: PromptTask) -> MicrobatchSpec | None:
        one = len(task.pieces) == 1 and task.pieces[0].dst_rows == (0, 1)
        try:
            specs = [fetch_spec(self.redis, piece.mb_id, 0.0) for piece in task.pieces[:1] if one]
        except DeadlineExceeded:  # its spec is written before its task is queued: the request ended
            log.info("dropped colocated task %d: microbatch %d is gone", task.task_id, task.pieces[0].mb_id)
            return None
        if specs and len(specs[0].rows) == 1:
            return specs[0]
        error = ValueError(f"colocated task {task.task_id} is not one request: {list(task.pieces)}")
        log.error("refused %s", error)
        for piece in task.pieces:
            try:
                self.refuse(fetch_spec(self.redis, piece.mb_id, 0.0), error)
            except DeadlineExceeded:
                continue
        return None


@dataclass
class Announced:
    """A request whose prompt the prompt pipeline computed (disaggregated), waiting for its prompt KV on stage 0
    and for the blocks the policy gives it."""

    spec: MicrobatchSpec
    first_token: int
    since: float = field(default_factory=time.monotonic)


class Announcements:
    """The requests a disaggregated pipeline's stage 0 takes: prompts the prompt pipeline announces done (the
    READY stream), each admitted once its prompt KV is all on this stage (first come first served among those).
    ``forget(request)`` frees, on every stage, the prompt KV of one that ends before it is admitted."""

    def __init__(
        self, ready: ReadyPrompts, arrivals: PromptArrivals, kv_deadline_s: float, forget: Callable[[int], None]
    ) -> None:
        self.ready = ready
        self.arrivals = arrivals
        self.kv_deadline_s = kv_deadline_s
        self.forget = forget
        self.waiting: collections.deque[Announced] = collections.deque()

    def take(self, block: bool, most: int) -> None:
        """Read up to ``most`` announcements (waiting 5 ms for the first when ``block``)."""
        for _ in range(most):
            ready = self.ready.pop(block_ms=5 if block else None)
            if ready is None:
                break
            block = False
            if ready.all_finished:  # it ended at its first token
                self.forget(ready.spec.mb_id)
            else:
                self.waiting.append(Announced(ready.spec, ready.first_tokens[0]))
        while self.ready.ended:
            self.forget(self.ready.ended.popleft())

    def complete(self) -> Iterator[Announced]:
        """The waiting requests whose prompt KV is all here, in order (the caller takes each it admits with
        :meth:`admitted`)."""
        for waiting in list(self.waiting):
            if self.arrivals.complete(waiting.spec.mb_id):
                yield waiting

    def late(self) -> list[Announced]:
        """Those whose prompt KV is still incomplete ``kv_deadline_s`` after their announcement: no longer waited
        for (the caller fails them)."""
        now = time.monotonic()
        late = [w for w in self.waiting if now - w.since > self.kv_deadline_s]
        late = [w for w in late if not self.arrivals.complete(w.spec.mb_id)]
        for waiting in late:
            self.admitted(waiting)
            self.forget(waiting.spec.mb_id)
        return late

    def admitted(self, waiting: Announced) -> None:
        self.waiting.remove(waiting)

    def clear(self) -> None:
        self.waiting.clear()
