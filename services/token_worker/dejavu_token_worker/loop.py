"""The loop of a request-scheduled pipeline's stage 0: plan, execute, update.

Every iteration takes the colocated tasks queued for it (each one request: a one-row token microbatch), lets the
scheduling policy (:class:`dejavu_common.sched.Scheduler`) plan the next pass (the running requests' decodes, then
prompt chunks under the token budget, prefixes found cached skipped) and computes it: on a one-stage pipeline the
executor runs it and the :class:`Emitter` samples the requests whose slice ends at their last known token and
publishes their tokens (one pipelined Redis write per pass) at once; on a pipeline of several stages stage 0 computes
its layers and sends the pass on (:class:`~dejavu_worker.dataplane.SlicePass`), keeping up to one pass per stage in
flight, and the last stage's emitter returns what each request sampled. Either way the results go back to the
policy, which frees the blocks of requests that finished.

A request's state here is a function of its spec and its token stream: a request taken again (after a repair, or
after an error broke its pass) starts over from what its stream says, its prompt and the tokens it delivered
computed in one go (mostly found in the prefix cache) and its next token sampled at the step it had reached, so
its stream goes on exactly where it was and no step is emitted twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import redis
import torch

from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, MicrobatchSpec, PromptTask
from dejavu_common.sched import RequestState, RequestTooLong, ScheduledPass, Scheduler, Slice, Status
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.downstream import Downstream
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import PassLogits, SliceExecutor, request_layout
from dejavu_token_worker.intake import Announced, Announcements, ColocatedIntake, ColocatedQueue
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.runner import STEP_FAILURES, history
from dejavu_token_worker.traces import MemberTrace
from dejavu_worker.dataplane import Outcome, PassReturn, WireSlice
from dejavu_worker.metrics import Occupancy, PassKind, PoolUsage, Preemption, PrefixCacheStats, WorkerMetrics
from dejavu_worker.rows import RowTracker
from dejavulib.errors import DejaVuLibError
from dejavulib.paged import PagedKVCache

log = logging.getLogger("dejavu.token_worker.loop")

CLAIMS_PER_PASS = 16  # requests taken before each pass at most (the controller bounds what it dispatches)


@dataclass
class Served:
    """One request as stage 0 serves it: its spec (one row), its progress through the policy, whether the last
    stage has yet to be given its spec (``fresh``: it was (re)admitted since its last pass was sent) and whether
    the later stages have yet to place its prompt KV (``streamed``: it came from a prompt pipeline)."""

    spec: MicrobatchSpec
    state: RequestState
    trace: MemberTrace | None = None
    fresh: bool = True
    streamed: bool = False
    since: float = field(default_factory=time.monotonic)

    @property
    def mb_id(self) -> int:
        return self.spec.mb_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.spec.rows[0].sampling.prompt_logprobs is not None and self.state.generated == 0


class RequestLoop:
    """Stage 0 of a request-scheduled pipeline (its only stage while ``downstream``, set per epoch, is None). Its
    books outlive epochs (the prefix cache does); a new epoch's recovery resumes or drops what it serves
    (:meth:`resume`, :meth:`drop_all`). ``ready`` and ``arrivals``: a disaggregated pipeline's intake; ``depth``:
    the pipeline's stages."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: SliceExecutor,
        client: redis.Redis,
        worker_id: str,
        metrics: WorkerMetrics,
        emitter: Emitter,
        held: list[PromptTask],
        max_recomputes: int = 8,
        ready: ReadyPrompts | None = None,
        arrivals: PromptArrivals | None = None,
        kv_deadline_s: float = 60.0,
        depth: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.redis = client
        self.metrics = metrics
        self.emitter = emitter
        self.max_recomputes = max_recomputes
        self.depth = depth  # the pipeline's stages
        self.downstream: Downstream | None = None  # the stages after this one, at the epoch served
        self._ended: list[int] = []  # requests that ended since the last pass went on: every stage forgets them
        self.queue = ColocatedQueue(client, worker_id, 0, held)
        self.colocated = ColocatedIntake(self.queue, lambda spec, error: emitter.publish_failure(spec, 0, error))
        self.arrivals = arrivals
        self.announced = (
            Announcements(ready, arrivals, kv_deadline_s, self._forget_everywhere) if ready and arrivals else None
        )
        self.served: dict[str, Served] = {}
        self._broken: ScheduledPass | None = None  # a pass an error stopped: its requests start over (_settle)
        self.on_ended: Callable[[Iterable[int]], None] = lambda mbs: None  # the stage forgets their replicas

    def serve(self, epoch: int) -> None:
        """Serve ``epoch`` from now on (tasks queued under another epoch are held or dropped)."""
        self.queue.epoch = epoch

    # -- what the worker reads ------------------------------------------------------------------
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

    def progress(self) -> dict[int, int]:
        """Per running request, the last position whose KV every stage holds (what a repair resumes from)."""
        return {s.mb_id: s.state.computed - 1 for s in list(self.served.values()) if s.state.computed > 0}

    def caches(self, mbs: Iterable[int]) -> Iterator[tuple[int, PagedKVCache, int]]:
        """(request, its KV on this stage as a cache, its last position) of each of ``mbs`` this stage holds:
        what a replaced successor gets back as its replica."""
        pool = self.executor.pool
        wanted = {str(mb) for mb in mbs}
        for rid, served in sorted(self.served.items()):
            state = served.state
            if rid in wanted and state.computed > 0:
                view = PagedKVCache.view(pool, request_layout(pool, len(state.table)), state.table, state.computed)
                yield served.mb_id, view, state.computed - 1

    # -- epochs -----------------------------------------------------------------------------------
    def drop_all(self) -> None:
        """Forget every request (a new epoch's recovery re-queues those still wanted): their blocks go back to the
        pool, their cached prefixes stay."""
        self._forget_passes()
        for rid in list(self.served):
            self._leave(rid)
        if self.arrivals is not None:
            self.arrivals.keep(())

    def resume(self, points: Mapping[int, int]) -> None:
        """A repair resumes the requests of ``points`` (request -> positions every stage holds now, restored from
        replicas where a stage was replaced) and re-queues the rest, which are forgotten here. Each resumed request
        goes on from those positions (its later ones computed again), with the tokens its stream has that no pass
        returned here (their last stage published them before the failure). Cached prefixes are forgotten: a stage
        that took over holds none of their KV."""
        self._forget_passes()
        if self.arrivals is not None:
            self.arrivals.keep(points)
        self.scheduler.book.forget_cached()
        for rid in [rid for rid, s in self.served.items() if s.mb_id not in points]:
            self._leave(rid, finished=False)
        window = self.scheduler.window
        for served in list(self.served.values()):  # rolled back into blocks its window gave back: from its stream
            state = served.state
            if window is not None and points[served.mb_id] < state.freed * self.scheduler.book.block_size + window:
                self._restart(served.spec)
        kept = [s for s in self.served.values() if s.state.status is not Status.WAITING]
        for served in kept:
            state = served.state
            state.computed = min(state.computed, points[served.mb_id])
            state.committed = max(state.freed, min(state.committed, state.computed // self.scheduler.book.block_size))
            tracker = RowTracker(served.spec, self.emitter.eos_ids)
            tracker.replay(history(self.redis, served.mb_id, before_step=1 << 30))
            state.token_ids.extend(tracker.outputs[0][state.generated :])
            served.fresh = True
            if tracker.done:  # its last token's pass reached the stream: it ended there
                self._leave(str(served.mb_id))
        log.info("resumed requests %s from positions %s", [s.mb_id for s in kept],
                 [s.state.computed for s in kept])  # fmt: skip

    def _forget_passes(self) -> None:
        """A new epoch: no pass in flight comes back, the last stage starts its records over."""
        self._settle()
        for step in self.downstream.abandon() if self.downstream is not None else ():
            self.scheduler.abandon(step)
        self.emitter.clear()
        if self.announced is not None:
            self.announced.clear()  # not admitted: re-run by the repair, announced again

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()``. An error leaving it (Redis refusing a write) leaves the books in order: the
        next call first restarts the requests of the pass it broke from their token streams."""
        self._settle()
        idle = True
        while not stop():
            down = self.downstream
            self._take(block=idle and not (down and down.inflight))  # a moment's wait for work instead of spinning
            if down is not None:
                self._collect(down, wait=bool(down.inflight) and (idle or down.full))
                if down.full:
                    continue
            if idle and not (down and down.inflight):  # a pass reads the cancellations as it returns
                self._end_cancelled(self.emitter.cancelled([s.mb_id for s in self.served.values()]))
            step = self.scheduler.schedule()
            self._preempted(step)
            idle = not step
            if idle:
                if down is not None and self._ended:
                    down.send_ended(self._ended)
                    self._ended = []
                continue
            self._broken = step
            self._launch(step)
            self._broken = None

    def _settle(self) -> None:
        if self._broken is None:
            return
        broken, self._broken = self._broken, None
        self._restart_pass(broken, "an error broke it")

    def _restart_pass(self, broken: ScheduledPass, why: str) -> None:
        self.scheduler.abandon(broken)
        rids = [s.request.request_id for s in broken.slices if s.request.request_id in self.served]
        log.warning("a pass did not complete (%s): requests %s run again from their token streams", why, rids)
        for rid in rids:
            self._restart(self.served[rid].spec)

    def _launch(self, step: ScheduledPass) -> None:
        started = time.perf_counter()
        slices = step.slices
        every = {i for i, s in enumerate(slices) if self.served[s.request.request_id].wants_prompt_logprobs
                 and s.start < s.request.prompt_len}  # fmt: skip
        try:
            out = self.executor.run(step, every)
        except STEP_FAILURES as exc:  # the pass's own values broke it: its requests fail, the stage serves on
            self._fail_pass(step, exc)
            return
        if isinstance(out, PassLogits):
            self._update(step, self._emit(step, out), started)
            return
        assert self.downstream is not None
        wire = [self._wire(s, i in every) for i, s in enumerate(slices)]
        self.downstream.send(step, wire, out, self.executor.pool, started, self._ended)
        self._ended = []
        for s in slices:
            served = self.served[s.request.request_id]
            served.fresh = served.streamed = False

    def _wire(self, s: Slice, every: bool) -> WireSlice:
        served = self.served[s.request.request_id]
        spec = served.spec if served.fresh else None
        cached = s.request.cached_tokens if served.streamed else 0
        return WireSlice(mb=served.mb_id, start=s.start, length=s.length, table=s.table, samples=s.samples,
                         every=every, generated=s.request.generated, spec=spec, streamed=served.streamed,
                         cached=cached)  # fmt: skip

    def _emit(self, step: ScheduledPass, out: PassLogits) -> tuple[list[Outcome], dict[int, set[int]]]:
        """A one-stage pipeline's sampling: the emitter's outcome of each sampling slice."""
        slices = step.slices
        records = self.emitter.records
        for i, logits in out.every.items():
            record = records.get(self.served[slices[i].request.request_id].mb_id)
            if record is not None:
                self.emitter.note_prompt_logprobs(record, slices[i].start, logits)
        cancels = self.emitter.cancelled([s.mb_id for s in self.served.values()])  # one read a pass
        sampling = [i for i, s in enumerate(slices) if s.samples]
        if not sampling:
            return [], cancels
        chosen = [records[self.served[slices[i].request.request_id].mb_id] for i in sampling]
        index = torch.tensor(sampling, dtype=torch.long, device=out.last.device)
        return self.emitter.sample(chosen, out.last[index], cancels), cancels

    def _collect(self, down: Downstream, wait: bool) -> None:
        """Take the returns of passes in flight (waiting a moment for one when ``wait``); fail the passes lost."""
        for flight, answer in down.returns(wait):
            self._broken = flight.step
            self._returned(flight.step, answer, flight.started)
            self._broken = None
        while (gone := down.pop_expired()) is not None:
            pass_id, flight = gone
            self._broken = flight.step
            self._fail_pass(flight.step, DeadlineExceeded(
                f"pass {pass_id} did not come back within {down.deadline_s:.0f} s"))  # fmt: skip
            self._broken = None

    def _returned(self, step: ScheduledPass, answer: PassReturn, started: float) -> None:
        if answer.broken:
            self._restart_pass(step, "the last stage could not publish its tokens")
        elif answer.error is not None and answer.failed:  # some requests could not be computed: they fail alone
            self.scheduler.abandon(step)
            failed = {str(mb) for mb in answer.failed}
            for rid in [s.request.request_id for s in step.slices]:
                if rid in failed:
                    self._fail(rid, RuntimeError(answer.error))
                elif rid in self.served:
                    self._restart(self.served[rid].spec)
        elif answer.error is not None:
            self._fail_pass(step, RuntimeError(answer.error))
        else:
            cancels = self.emitter.cancelled([s.mb_id for s in self.served.values()])
            self._update(step, (list(answer.outcomes), cancels), started)

    def _fail_pass(self, step: ScheduledPass, error: Exception) -> None:
        self.scheduler.abandon(step)
        for s in step.slices:
            self._fail(s.request.request_id, error)

    def _update(self, step: ScheduledPass, results: tuple[list[Outcome], dict[int, set[int]]], started: float) -> None:
        """Hand the policy what ``step`` produced: the outcome of each request whose slice sampled."""
        outcomes, cancels = results
        in_step = {s.request.request_id for s in step.slices}
        by_mb = {served.mb_id: rid for rid, served in self.served.items() if rid in in_step}
        sampled, stopped = {}, []
        for outcome in outcomes:
            rid = by_mb.get(outcome.mb)
            if rid is None:
                continue
            if outcome.token >= 0:
                sampled[rid] = outcome.token
            else:  # cancelled or refused: nothing to append
                self.scheduler.finish(rid)
            if outcome.ended:
                stopped.append(rid)
        sampling = {s.request.request_id for s in step.slices if s.samples}
        for rid in sampling - set(sampled) - set(stopped):  # ended meanwhile here: nothing came back for it
            self.scheduler.finish(rid)
        for request in self.scheduler.update(step, sampled, stopped):
            served = self.served.get(request.request_id)
            if served is not None and request.request_id not in stopped:  # the policy's bound came first
                self.emitter.publish_end(served.mb_id, served.state.generated, FinishReason.LENGTH)
            self._leave(request.request_id)
        for rid in sampled:
            served = self.served.get(rid)
            if served is not None and served.trace is not None:
                served.trace.stepped(served.state.generated, (0,))
        for rid in stopped:
            if rid in self.served:
                self._leave(rid)
        self._end_cancelled(cancels)  # the cancelled requests whose slices did not sample (or not in the pass)
        slices = step.slices
        kind = PassKind.MIXED if any(s.decode for s in slices) and any(not s.decode for s in slices) else (
            PassKind.DECODE if all(s.decode for s in slices) else PassKind.PREFILL)  # fmt: skip
        self.metrics.observe_pass(kind, time.perf_counter() - started, step.tokens)

    # -- intake ---------------------------------------------------------------------------------
    def _take(self, block: bool) -> None:
        if self.announced is not None:
            self.announced.take(block, CLAIMS_PER_PASS)
            self._admit_announced(self.announced)
            return
        for task, spec in self.colocated.specs(block, CLAIMS_PER_PASS):
            try:
                self._restart(spec)
            except redis.RedisError:
                self.colocated.put_back(task)
                raise

    def _admit_announced(self, announced: Announcements) -> None:
        """Admit the announced requests whose prompt KV is all here while the policy gives them blocks."""
        for late in announced.late():
            self.emitter.publish_failure(late.spec, 1, DeadlineExceeded(
                f"its prompt KV did not reach token stage 0 within {announced.kv_deadline_s:.0f} s"))  # fmt: skip
        for waiting in announced.complete():
            try:
                if not self._admit_streamed(waiting):
                    return  # no room yet: it and those after it wait for blocks to come back
            except RequestTooLong as exc:
                self.emitter.publish_failure(waiting.spec, 1, exc)
                self._forget_everywhere(waiting.spec.mb_id)
            announced.admitted(waiting)

    def _admit_streamed(self, waiting: Announced) -> bool:
        """Admit a request whose prompt KV came from the prompt pipeline, going on from its token stream (a prompt
        run again after a repair: the tokens it delivered follow its prompt, computed before its next token is
        sampled); False when the policy has no room for it yet."""
        assert self.arrivals is not None
        spec, mb = waiting.spec, waiting.spec.mb_id
        tracker = RowTracker(spec, self.emitter.eos_ids)
        tracker.replay(history(self.redis, mb, before_step=1 << 30))
        if tracker.done:
            self._forget_everywhere(mb)
            return True
        row = spec.rows[0]
        longest = min(row.sampling.max_tokens, spec.max_len - len(row.prompt_ids) + 1)
        state = RequestState(str(mb), list(row.prompt_ids), len(row.prompt_ids), longest)
        if not self.scheduler.reserve(state):
            return False
        try:
            self.arrivals.place(mb, self.executor.pool, state.table, state.cached_tokens)
        except (ValueError, RuntimeError, DejaVuLibError) as exc:  # its KV does not fit it: it fails alone
            self.scheduler.finish(state.request_id)
            self.emitter.publish_failure(spec, tracker.generated[0], exc)
            self._forget_everywhere(mb)
            return True
        outputs = tracker.outputs[0] or [waiting.first_token]
        self.scheduler.arrived(state, outputs[0])
        state.token_ids.extend(outputs[1:])
        self._serve(Served(spec, state, streamed=True), tracker)
        return True

    def _restart(self, spec: MicrobatchSpec) -> None:
        """Serve ``spec``'s request from what its token stream says (from its prompt when the stream is empty);
        one served already starts over."""
        rid = str(spec.mb_id)
        if rid in self.served:
            self._leave(rid, finished=False)
        tracker = RowTracker(spec, self.emitter.eos_ids)
        tracker.replay(history(self.redis, spec.mb_id, before_step=1 << 30))
        if tracker.done:  # its stream has its end already
            self._forget_everywhere(spec.mb_id)
            return
        row = spec.rows[0]
        wants_prompt = row.sampling.prompt_logprobs is not None and not tracker.outputs[0]
        # A prompt whose every position's log probabilities are reported computes every position: its blocks are
        # salted afresh each time it is served, so it hits nothing cached, its own earlier blocks included.
        salt = f"prompt-logprobs:{uuid.uuid4()}".encode() if wants_prompt else b""
        # Its tokens end at max_tokens or where its cache span ends (the last token's KV is never written).
        longest = min(row.sampling.max_tokens, spec.max_len - len(row.prompt_ids) + 1)
        state = RequestState(rid, [*row.prompt_ids, *tracker.outputs[0]], len(row.prompt_ids), longest, salt)
        try:
            self.scheduler.add(state)
        except RequestTooLong as exc:
            self.emitter.publish_failure(spec, tracker.generated[0], exc)
            self._forget_everywhere(spec.mb_id)
            return
        self._serve(Served(spec, state), tracker)

    def _serve(self, served: Served, tracker: RowTracker) -> None:
        self.served[served.state.request_id] = served
        if self.downstream is None:  # the last stage is this one: its emitter's record starts now
            self.emitter.begin(served.spec, tracker)
        served.trace = MemberTrace.start(served.spec, tracker.generated[0], (0,), self.queue.epoch)

    # -- ends -----------------------------------------------------------------------------------
    def _end_cancelled(self, cancels: dict[int, set[int]]) -> None:
        """End the requests not in flight whose clients went away (``cancels``: :meth:`Emitter.cancelled`'s)."""
        for s in [s for s in self.served.values() if cancels.get(s.mb_id) and not s.state.in_flight]:
            self.emitter.publish_end(s.mb_id, s.state.generated, FinishReason.CANCELLED)
            self._leave(str(s.mb_id))

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
        self.emitter.publish_failure(served.spec, served.state.generated, error)
        if served.trace is not None:
            served.trace.left(served.state.generated, error)
            served.trace = None
        self._leave(rid)

    def _forget_everywhere(self, mb: int) -> None:
        """Request ``mb`` ended: every stage forgets it (its prompt KV arrived, its replicas, its record)."""
        if self.arrivals is not None:
            self.arrivals.drop([mb])
        if self.depth > 1:
            self._ended.append(mb)

    def _leave(self, rid: str, finished: bool = True) -> None:
        """Forget request ``rid`` here; ``finished``: it never comes back (the other stages forget it with the next
        pass), unlike one served again from its stream."""
        served = self.served.pop(rid, None)
        self.scheduler.finish(rid)
        if served is None:
            return
        if served.trace is not None:
            served.trace.left(served.state.generated)
        self.emitter.forget([served.mb_id])
        if finished:
            self._forget_everywhere(served.mb_id)
            self.on_ended([served.mb_id])
