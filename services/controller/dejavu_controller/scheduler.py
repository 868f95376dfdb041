"""Microbatch formation and slot accounting (pure logic; no I/O, no asyncio).

Requests wait in FIFO order; a token microbatch is formed from up to ``token_microbatch`` of them
when that many are waiting, when the oldest has waited ``batch_wait_ms``, or at once when the workers
have nothing to do (waiting for company then only delays the request), as long as fewer than
``max_outstanding_rows`` requests are dispatched and unfinished: the token pipeline decodes up to
``max_running`` of them at once (its stage 0 batches microbatches into D_t cohorts whose membership
changes at every step: iteration-level batching), and the prompt pipeline may run ahead by D_p prompt
microbatches, whose caches wait in the token workers' memory. A microbatch is the unit of admission,
of token streams and of recovery; it leaves the token pipeline the step its last row finishes. Rows
of new token microbatches are packed, in order, into prompt microbatches of up to
``prompt_microbatch`` rows, so a prompt microbatch can feed several token microbatches (split) or
several prompt microbatches one token microbatch (merge); colocated, where stage 0 prefills a token
microbatch in one pass, each token microbatch is one prompt task.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dejavu_common.messages import MicrobatchSpec, PromptPiece, PromptTask
from dejavu_controller.backend import QueueFullError
from dejavu_controller.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerLimits:
    token_microbatch: int
    prompt_microbatch: int
    max_outstanding_rows: int  # requests dispatched and not finished (a microbatch forms below it)
    queue_bound: int
    batch_wait_s: float
    max_len: int = 1 << 30  # cache positions a microbatch may span: the model's context
    # Disaggregated: prompt microbatches split and merge token microbatches. Colocated: stage 0 prefills
    # each token microbatch as one pass, so each is a prompt task of its own, whatever its size.
    split_prompts: bool = True
    prompt_task_tokens: int = 1 << 30  # prompt tokens a prompt microbatch packs at most (when split)


@dataclass
class Microbatch:
    spec: MicrobatchSpec
    requests: list[Request]
    finished_rows: set[int] = field(default_factory=set)  # rows the workers reported finished
    started_rows: set[int] = field(default_factory=set)  # rows whose first token (step 0) was seen
    stalled_repairs: int = 0  # consecutive repairs this microbatch was in flight for without progress
    _progress_at_repair: int = -1

    @property
    def progress(self) -> int:
        """Tokens delivered to its requests so far (first tokens and finishes included)."""
        return len(self.started_rows) + sum(len(r.output_ids) for r in self.requests)

    def note_repair(self, limit: int) -> bool:
        """Count a repair this microbatch was in flight for; True once it has been in flight for more
        than ``limit`` repairs in a row without delivering a token in between. Work that keeps killing
        the workers that take it (a deterministic failure) stops there instead of looping forever;
        a microbatch that progresses between failures is never counted out."""
        progress = self.progress
        self.stalled_repairs = 1 if progress > self._progress_at_repair else self.stalled_repairs + 1
        self._progress_at_repair = progress
        return self.stalled_repairs > limit

    @property
    def first_complete(self) -> bool:
        """Every row has its first token: the token pipeline has (or had) this microbatch."""
        return len(self.started_rows) == len(self.requests)

    @property
    def done(self) -> bool:
        """The workers are done with every row (a cancelled row counts once a worker confirms it)."""
        return len(self.finished_rows) == len(self.requests)


class Scheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Microbatch] = {}
        # Each controller incarnation numbers from its own range (start_ids_at), so late output of an
        # earlier incarnation's workers can never land on a new microbatch.
        self._next_mb = 0
        self._next_task = 0

    def start_ids_at(self, first_id: int) -> None:
        """Number new microbatches and tasks from ``first_id`` on (before any was formed)."""
        if self.active or self._next_mb not in (0, first_id):
            raise RuntimeError("ids can only be moved before the first microbatch")
        self._next_mb = self._next_task = first_id

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def admit(self, request: Request) -> None:
        """Queue ``request``; raises :class:`QueueFullError` at the bound."""
        if len(self.waiting) >= self.limits.queue_bound:
            raise QueueFullError(retry_after_s=1.0)
        self.waiting.append(request)

    def drop_cancelled(self) -> None:
        self.waiting = deque(r for r in self.waiting if not r.done)

    def form(self, now: float | None = None) -> list[Microbatch]:
        """New token microbatches for the free slots (possibly none)."""
        now = time.monotonic() if now is None else now
        self.drop_cancelled()
        formed: list[Microbatch] = []
        b = self.limits.token_microbatch
        while self.waiting and self.outstanding_rows < self.limits.max_outstanding_rows:
            full = len(self.waiting) >= b
            stale = now - self.waiting[0].arrival >= self.limits.batch_wait_s
            idle = self.outstanding_rows == 0  # nothing to batch with: the pipeline would wait too
            if not (full or stale or idle):
                break
            reqs = [self.waiting.popleft()]
            while self.waiting and len(reqs) < b and self._fits([*reqs, self.waiting[0]]):
                reqs.append(self.waiting.popleft())
            mb = self._make(reqs)
            self.active[mb.spec.mb_id] = mb
            formed.append(mb)
        return formed

    @property
    def outstanding_rows(self) -> int:
        """Requests of the active microbatches the workers have not finished."""
        return sum(len(mb.requests) - len(mb.finished_rows) for mb in self.active.values())

    def _fits(self, reqs: list[Request]) -> bool:
        """Left padding aligns every row to the longest prompt, so a row's last position is the longest
        prompt plus its budget, which must stay within ``max_len``. A request that asked for the whole
        context (no ``max_tokens``: its budget is ``max_len`` minus its prompt) fits anyway: it gets
        what fits, and finishes with ``length`` where the microbatch's cache ends."""
        longest = max(len(r.prompt_ids) for r in reqs)
        return all(
            longest + r.sampling.max_tokens <= self.limits.max_len
            or len(r.prompt_ids) + r.sampling.max_tokens >= self.limits.max_len
            for r in reqs
        )

    def _make(self, reqs: list[Request]) -> Microbatch:
        mb_id = self._next_mb
        self._next_mb += 1
        prompt_len = max(len(r.prompt_ids) for r in reqs)
        max_len = min(prompt_len + max(r.sampling.max_tokens for r in reqs), self.limits.max_len)
        for row, r in enumerate(reqs):
            r.mb_id, r.row = mb_id, row
            r.transition(RequestStatus.SCHEDULED)
        spec = MicrobatchSpec(
            mb_id=mb_id, rows=tuple(r.row_spec() for r in reqs), prompt_len=prompt_len, max_len=max_len
        )
        return Microbatch(spec=spec, requests=reqs)

    def pack_prompt_tasks(self, mbs: list[Microbatch], epoch: int = 0) -> list[PromptTask]:
        """Pack the rows of ``mbs`` in order into prompt microbatches of at most ``prompt_microbatch`` rows and
        ``prompt_task_tokens`` prompt tokens (a longer prompt is a task of its own), queued under topology
        ``epoch``; without ``split_prompts``, one task per whole microbatch."""
        if not self.limits.split_prompts:
            whole = ([PromptPiece(mb_id=mb.spec.mb_id, dst_rows=(0, len(mb.spec.rows)))] for mb in mbs)
            return [self._task(pieces, epoch) for pieces in whole]
        tasks: list[PromptTask] = []
        pieces: list[PromptPiece] = []
        rows = tokens = 0
        for mb in mbs:
            first = 0
            for row, spec in enumerate(mb.spec.rows):
                n = len(spec.prompt_ids)
                full = rows == self.limits.prompt_microbatch or (rows and tokens + n > self.limits.prompt_task_tokens)
                if full:
                    if row > first:
                        pieces.append(PromptPiece(mb_id=mb.spec.mb_id, dst_rows=(first, row)))
                    tasks.append(self._task(pieces, epoch))
                    pieces, rows, tokens, first = [], 0, 0, row
                rows += 1
                tokens += n
            pieces.append(PromptPiece(mb_id=mb.spec.mb_id, dst_rows=(first, len(mb.spec.rows))))
        if pieces:
            tasks.append(self._task(pieces, epoch))
        return tasks

    def _task(self, pieces: list[PromptPiece], epoch: int) -> PromptTask:
        task = PromptTask(task_id=self._next_task, pieces=tuple(pieces), epoch=epoch)
        self._next_task += 1
        return task

    def unform(self, mbs: list[Microbatch]) -> None:
        """Undo :meth:`form` for ``mbs``, whose write to Redis failed (no worker ever saw them): their
        slots are free again and their live requests go back to the head of the queue, in their order,
        to be formed again under new microbatch ids. Requests that ended meanwhile are left out."""
        for mb in reversed(mbs):
            self.active.pop(mb.spec.mb_id, None)
            for req in reversed(mb.requests):
                if not req.done:
                    req.unschedule()
                    self.waiting.appendleft(req)

    def complete(self, mb_id: int) -> Microbatch | None:
        """Free ``mb_id``'s slot."""
        return self.active.pop(mb_id, None)
