"""The loop of a request-scheduled pipeline (a colocated one-stage pipeline over the paged pool): plan, execute, update.

Every iteration takes the colocated tasks queued for it (each one request: a one-row token microbatch), lets the
scheduling policy (:class:`dejavu_common.sched.Scheduler`) plan the next pass (the running requests' decodes, then
prompt chunks under the token budget, prefixes found cached skipped), has the executor compute it, samples the
requests whose slice ends at their last known token, publishes their tokens on their token streams (one pipelined
Redis write per pass), and hands the results back to the policy, which frees the blocks of requests that finished.

A request's state here is a function of its spec and its token stream: a request taken again (after a repair, or
after an error broke its pass) starts over from what its stream says, its prompt and the tokens it delivered
computed in one go (mostly found in the prefix cache) and its next token sampled at the step it had reached, so
its stream goes on exactly where it was and no step is emitted twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, Logprob, MicrobatchSpec, PromptTask, TokenStep
from dejavu_common.sched import RequestState, RequestTooLong, ScheduledPass, Scheduler
from dejavu_common.signing import EntrySigner, token_entry
from dejavu_engine.sampling import RowContext, logprob, sample_rows
from dejavu_token_worker.executor import SliceExecutor
from dejavu_token_worker.intake import ColocatedQueue
from dejavu_token_worker.runner import STEP_FAILURES, history
from dejavu_token_worker.traces import MemberTrace
from dejavu_worker.metrics import Occupancy, PassKind, PoolUsage, Preemption, PrefixCacheStats, WorkerMetrics
from dejavu_worker.microbatch import fetch_spec
from dejavu_worker.rows import RowTracker

log = logging.getLogger("dejavu.token_worker.loop")

CLAIMS_PER_PASS = 16  # colocated tasks taken before each pass at most (the controller bounds what it dispatches)


@dataclass
class Served:
    """One request as this loop serves it: its spec (one row), its progress through the policy, what it emitted."""

    spec: MicrobatchSpec
    state: RequestState
    tracker: RowTracker
    trace: MemberTrace | None = None
    prompt_logprobs: dict[int, Logprob] | None = None  # position -> log probability, when its request asks
    since: float = field(default_factory=time.monotonic)

    @property
    def mb_id(self) -> int:
        return self.spec.mb_id


class RequestLoop:
    """Stage 0 (and only stage) of a request-scheduled pipeline. Its books outlive epochs (the prefix cache
    does); what it serves is dropped when a new epoch begins with a recovery (:meth:`drop_all`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: SliceExecutor,
        client: redis.Redis,
        worker_id: str,
        metrics: WorkerMetrics,
        signer: EntrySigner | None,
        eos_ids: frozenset[int],
        held: list[PromptTask],
        max_recomputes: int = 8,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.redis = client
        self.metrics = metrics
        self.signer = signer
        self.eos_ids = eos_ids
        self.max_recomputes = max_recomputes
        self.queue = ColocatedQueue(client, worker_id, 0, held)
        self.served: dict[str, Served] = {}
        self._broken: ScheduledPass | None = None  # a pass an error stopped: its requests start over (_settle)

    def serve(self, epoch: int) -> None:
        """Serve ``epoch`` from now on (tasks queued under another epoch are held or dropped)."""
        self.queue.epoch = epoch

    def occupancy(self) -> Occupancy:
        """Requests holding blocks (running) and queued for their first pass (waiting); safe from another thread."""
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        return Occupancy(running, running, waiting, waiting)

    def pool_usage(self) -> PoolUsage:
        """Blocks referenced by requests now, of the pool's; safe from another thread."""
        book = self.scheduler.book
        return PoolUsage(book.num_blocks - book.free, book.num_blocks)

    def prefix_cache(self) -> PrefixCacheStats:
        """The prefix cache's figures now; safe from another thread (counts only)."""
        stats = self.scheduler.book.stats()
        return PrefixCacheStats(stats.queries, stats.hits, stats.shared, stats.cached_free)

    def held_bytes(self) -> int:
        """Memory of the blocks requests reference now (the pool's slabs are made as it fills)."""
        return self.pool_usage().used * self.executor.pool.geometry.bytes_per_block

    def drop_all(self) -> None:
        """Forget every request (a new epoch's recovery re-queues those still wanted); their blocks go back to the
        pool, their cached prefixes stay."""
        self._settle()
        for rid in list(self.served):
            self._leave(rid)

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()``. An error leaving it (Redis refusing a write) leaves the books in order: the
        next call first restarts the requests of the pass it broke from their token streams."""
        self._settle()
        idle = True
        while not stop():
            self._take_tasks(block=idle)  # nothing ran last time: wait a moment for a task instead of spinning
            if idle:  # a pass reads the cancellations after it computes; without one, they are read here
                self._end_cancelled(self._cancelled(self.served.values()))
            step = self.scheduler.schedule()
            self._preempted(step)
            idle = not step
            if idle:
                continue
            self._broken = step
            self._execute(step)
            self._broken = None

    def _settle(self) -> None:
        if self._broken is None:
            return
        broken, self._broken = self._broken, None
        self.scheduler.abandon(broken)
        rids = [s.request.request_id for s in broken.slices if s.request.request_id in self.served]
        log.warning("a pass broke here: requests %s run again from their token streams", rids)
        for rid in rids:
            self._restart(self.served[rid].spec)

    def _execute(self, step: ScheduledPass) -> None:
        started = time.perf_counter()
        slices = step.slices
        every = {i for i, s in enumerate(slices) if self.served[s.request.request_id].prompt_logprobs is not None
                 and s.start < s.request.prompt_len}  # fmt: skip
        try:
            out = self.executor.run(step, every)
        except STEP_FAILURES as exc:  # the pass's own values broke it: its requests fail, the stage serves on
            self.scheduler.abandon(step)
            for s in slices:
                self._fail(s.request.request_id, exc)
            return
        for i, logits in out.every.items():
            self._note_prompt_logprobs(self.served[slices[i].request.request_id], slices[i].start, logits)
        cancels = self._cancelled(self.served.values())  # one read a pass, every request's
        sampling = [i for i, s in enumerate(slices) if s.samples]
        entries = self._sample(step, sampling, out.last, cancels) if sampling else []
        if entries:
            pipe = self.redis.pipeline(transaction=False)
            for entry in entries:
                key = keys.tokens(entry.mb_id)
                pipe.xadd(key, token_entry(self.signer, key, entry.encode()))
            pipe.execute()
        sampled, stopped = {}, []
        for entry in entries:
            rid, token = str(entry.mb_id), entry.tokens[0]
            if token >= 0:
                sampled[rid] = token
            else:  # cancelled or refused: nothing to append
                self.scheduler.finish(rid)
            if entry.finished[0] is not None:
                stopped.append(rid)
        for request in self.scheduler.update(step, sampled, stopped):
            served = self.served.get(request.request_id)
            if served is not None and not served.tracker.done:  # the policy's bound met first: say it ended
                self._publish_end(served, FinishReason.LENGTH)
            self._leave(request.request_id)
        for rid in sampled:
            served = self.served.get(rid)
            if served is not None and served.trace is not None:
                served.trace.stepped(served.state.generated, (0,))
        for rid in stopped:
            if rid in self.served:
                self._leave(rid)
        self._end_cancelled(cancels)  # the cancelled requests whose slices did not sample (or not in the pass)
        kind = PassKind.MIXED if any(s.decode for s in slices) and any(not s.decode for s in slices) else (
            PassKind.DECODE if all(s.decode for s in slices) else PassKind.PREFILL)  # fmt: skip
        self.metrics.observe_pass(kind, time.perf_counter() - started, step.tokens)

    def _sample(
        self, step: ScheduledPass, rows: list[int], logits: torch.Tensor, cancels: dict[int, set[int]]
    ) -> list[TokenStep]:
        """The entry of every request whose slice sampled: its token (penalties seeing its prompt and what it
        emitted), its finish, the log probabilities it asked for; a request cancelled meanwhile (``cancels``)
        ends CANCELLED instead, one whose grammar does not compile REFUSED (the gateway answers it 400)."""
        served = [self.served[step.slices[i].request.request_id] for i in rows]
        params = [s.spec.rows[0].sampling for s in served]
        contexts = None
        if not all(p.plain_greedy for p in params):
            contexts = [RowContext(s.spec.rows[0].prompt_ids, s.tracker.outputs[0], s.tracker.stops[0].stop_ids)
                        for s in served]  # fmt: skip
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        tokens = sample_rows(logits[index], params, [s.tracker.generated[0] for s in served], contexts)
        entries = []
        for s, row in zip(served, tokens, strict=True):
            prompts = [self._prompt_logprobs(s)] if s.prompt_logprobs is not None and not s.tracker.outputs[0] else []
            if row.refused is not None:
                log.info("request of microbatch %d refused: its grammar does not compile: %s", s.mb_id, row.refused)
            refused = {0: row.refused} if row.refused is not None else None
            entries.append(s.tracker.step(s.tracker.generated[0], [row.token], cancels.get(s.mb_id, ()), (0,),
                                          [row.logprob], prompts, refused=refused))  # fmt: skip
        return entries

    # -- intake ---------------------------------------------------------------------------------
    def _take_tasks(self, block: bool) -> None:
        for _ in range(CLAIMS_PER_PASS):
            task = self.queue.claim(block)
            if task is None:
                return
            block = False
            try:
                self._take(task)
            except redis.RedisError:
                self.queue.put_back(task)  # claimed (acknowledged) but not taken: the next run takes it
                raise

    def _take(self, task: PromptTask) -> None:
        if len(task.pieces) != 1 or task.pieces[0].dst_rows != (0, 1):
            self._refuse(task)
            return
        try:
            spec = fetch_spec(self.redis, task.pieces[0].mb_id, 0.0)
        except DeadlineExceeded:  # its spec is written before its task is queued: the request ended
            log.info("dropped colocated task %d: microbatch %d is gone", task.task_id, task.pieces[0].mb_id)
            return
        if len(spec.rows) != 1:
            self._refuse(task)
            return
        self._restart(spec)

    def _restart(self, spec: MicrobatchSpec) -> None:
        """Serve ``spec``'s request from what its token stream says (from its prompt when the stream is empty);
        one served already starts over."""
        rid = str(spec.mb_id)
        if rid in self.served:
            self._leave(rid)
        tracker = RowTracker(spec, self.eos_ids)
        tracker.replay(history(self.redis, spec.mb_id, before_step=1 << 30))
        if tracker.done:
            return  # its stream has its end already
        row = spec.rows[0]
        top = row.sampling.prompt_logprobs
        wants_prompt = top is not None and not tracker.outputs[0]
        # A prompt whose every position's log probabilities are reported computes every position: its blocks are
        # salted afresh each time it is served, so it hits nothing cached, its own earlier blocks included.
        salt = f"prompt-logprobs:{uuid.uuid4()}".encode() if wants_prompt else b""
        # Its tokens end at max_tokens or where its cache span ends (the last token's KV is never written).
        longest = min(row.sampling.max_tokens, spec.max_len - len(row.prompt_ids) + 1)
        state = RequestState(rid, [*row.prompt_ids, *tracker.outputs[0]], len(row.prompt_ids), longest, salt)
        served = Served(spec, state, tracker, prompt_logprobs={} if wants_prompt else None)
        try:
            self.scheduler.add(state)
        except RequestTooLong as exc:
            self._publish_failure(spec, tracker.generated[0], exc)
            return
        self.served[rid] = served
        served.trace = MemberTrace.start(spec, tracker.generated[0], (0,), self.queue.epoch)

    def _refuse(self, task: PromptTask) -> None:
        error = ValueError(f"colocated task {task.task_id} is not one request: {list(task.pieces)}")
        log.error("refused %s", error)
        for piece in task.pieces:
            try:
                spec = fetch_spec(self.redis, piece.mb_id, 0.0)
            except DeadlineExceeded:
                continue
            self._publish_failure(spec, 0, error)

    # -- ends -----------------------------------------------------------------------------------
    def _end_cancelled(self, cancels: dict[int, set[int]]) -> None:
        """End the requests not in flight whose clients went away (``cancels``: :meth:`_cancelled`'s reading)."""
        for s in [s for s in self.served.values() if cancels.get(s.mb_id) and not s.state.in_flight]:
            self._publish_end(s, FinishReason.CANCELLED)
            self._leave(str(s.mb_id))

    def _publish_end(self, served: Served, reason: FinishReason) -> None:
        """End ``served``'s stream with ``reason`` at the step it reached, without a token."""
        step = served.tracker.generated[0]
        entry = TokenStep(mb_id=served.mb_id, step=step, tokens=(-1,), finished=(reason,))
        key = keys.tokens(served.mb_id)
        self.redis.xadd(key, token_entry(self.signer, key, entry.encode()))

    def _cancelled(self, served: Iterable[Served]) -> dict[int, set[int]]:
        """Per request, the rows its controller cancelled (``{0}`` or nothing), in one Redis round trip."""
        served = list(served)
        if not served:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for s in served:
            pipe.smembers(keys.microbatch_cancel(s.mb_id))
        return {s.mb_id: {int(x) for x in rows} for s, rows in zip(served, pipe.execute(), strict=True)}

    def _preempted(self, step: ScheduledPass) -> None:
        for request in step.preempted:
            self.metrics.count_preemption(Preemption.RECOMPUTE)
            log.info("KV pool full: request %s preempted (its blocks back, cached ones kept), to be recomputed",
                     request.request_id)  # fmt: skip
            served = self.served.get(request.request_id)
            if served is not None and served.trace is not None:
                served.trace.event("recompute")
            if request.preemptions > self.max_recomputes:
                self._fail(request.request_id, RuntimeError(
                    f"request {request.request_id} was preempted {request.preemptions} times (engine.max_recomputes "
                    f"{self.max_recomputes}): the KV pool is too small for the work admitted"))  # fmt: skip

    def _fail(self, rid: str, error: Exception) -> None:
        served = self.served.get(rid)
        if served is None:
            return
        self._publish_failure(served.spec, served.tracker.generated[0], error)
        if served.trace is not None:
            served.trace.left(served.tracker.generated[0], error)
            served.trace = None
        self._leave(rid)

    def _publish_failure(self, spec: MicrobatchSpec, step: int, error: Exception) -> None:
        log.error("request of microbatch %d failed at step %d: %r", spec.mb_id, step, error)
        n = len(spec.rows)
        entry = TokenStep(mb_id=spec.mb_id, step=step, tokens=(-1,) * n, finished=(FinishReason.ERROR,) * n)
        key = keys.tokens(spec.mb_id)
        self.redis.xadd(key, token_entry(self.signer, key, entry.encode()))

    def _leave(self, rid: str) -> None:
        served = self.served.pop(rid, None)
        self.scheduler.finish(rid)
        if served is not None and served.trace is not None:
            served.trace.left(served.tracker.generated[0])

    # -- prompt log probabilities ---------------------------------------------------------------
    @staticmethod
    def _note_prompt_logprobs(served: Served, start: int, logits: torch.Tensor) -> None:
        """Record the log probabilities of the prompt tokens that the logits after positions ``start..`` predict."""
        assert served.prompt_logprobs is not None
        ids, top = served.spec.rows[0].prompt_ids, served.spec.rows[0].sampling.prompt_logprobs or 0
        log_probs = torch.log_softmax(logits.float(), -1)
        for i in range(logits.shape[0]):
            target = start + i + 1
            if target < len(ids):
                served.prompt_logprobs[target] = logprob(log_probs[i], ids[target], top)

    @staticmethod
    def _prompt_logprobs(served: Served) -> tuple[Logprob | None, ...]:
        assert served.prompt_logprobs is not None
        n = len(served.spec.rows[0].prompt_ids)
        return (None, *(served.prompt_logprobs.get(p) for p in range(1, n)))
