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

import collections
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, MicrobatchSpec, PromptTask, TokenStep
from dejavu_common.sched import RequestState, RequestTooLong, ScheduledPass, Scheduler, Slice
from dejavu_common.signing import token_entry
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import PassLogits, SliceExecutor, request_layout
from dejavu_token_worker.intake import ColocatedQueue
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.replication import ReplicaSender
from dejavu_token_worker.runner import STEP_FAILURES, history
from dejavu_token_worker.traces import MemberTrace
from dejavu_worker.dataplane import Outcome, PassReturn, SlicePass, WireSlice
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.metrics import Occupancy, PassKind, PoolUsage, Preemption, PrefixCacheStats, WorkerMetrics
from dejavu_worker.microbatch import fetch_spec
from dejavu_worker.rows import RowTracker
from dejavulib.paged import PagedKVCache

log = logging.getLogger("dejavu.token_worker.loop")

CLAIMS_PER_PASS = 16  # colocated tasks taken before each pass at most (the controller bounds what it dispatches)


@dataclass
class Served:
    """One request as stage 0 serves it: its spec (one row), its progress through the policy, whether the last
    stage has yet to be given its spec (``fresh``: it was (re)admitted since its last pass was sent)."""

    spec: MicrobatchSpec
    state: RequestState
    trace: MemberTrace | None = None
    fresh: bool = True
    streamed: bool = False  # admitted with its prompt KV from the prompt pipeline; later stages place theirs first
    since: float = field(default_factory=time.monotonic)

    @property
    def mb_id(self) -> int:
        return self.spec.mb_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.spec.rows[0].sampling.prompt_logprobs is not None and self.state.generated == 0


@dataclass
class Downstream:
    """The stages after stage 0: where its passes go (``next_peer``), how many it keeps in flight (``depth``, one per
    stage) and how long one may take before its requests fail (``deadline_s``: the data plane lost it)."""

    endpoint: DataEndpoint
    next_peer: str
    depth: int
    deadline_s: float
    replicas: ReplicaSender | None = None  # to stage 1, which keeps stage 0's replica


@dataclass
class Announced:
    """A request whose prompt the prompt pipeline computed (disaggregated), waiting for its prompt KV on stage 0
    and for the blocks the policy gives it."""

    spec: MicrobatchSpec
    first_token: int
    since: float = field(default_factory=time.monotonic)


@dataclass
class InFlight:
    step: ScheduledPass
    started: float
    sent: float = field(default_factory=time.monotonic)


class RequestLoop:
    """Stage 0 of a request-scheduled pipeline (and its only stage, with ``emitter``, when ``downstream`` is None).
    Its books outlive epochs (the prefix cache does); what it serves is dropped when a new epoch begins with a
    recovery (:meth:`drop_all`)."""

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
        downstream: Downstream | None = None,
        ready: ReadyPrompts | None = None,
        arrivals: PromptArrivals | None = None,
        kv_deadline_s: float = 60.0,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.redis = client
        self.metrics = metrics
        self.emitter = emitter
        self.max_recomputes = max_recomputes
        self.downstream = downstream
        self.queue = ColocatedQueue(client, worker_id, 0, held)
        # Disaggregated: prompts the prompt pipeline announces done, and their KV on this stage.
        self.ready, self.arrivals, self.kv_deadline_s = ready, arrivals, kv_deadline_s
        self.announced: collections.deque[Announced] = collections.deque()
        self.served: dict[str, Served] = {}
        self.inflight: dict[int, InFlight] = {}
        self._pass_ids = itertools.count()
        self._ended: list[int] = []  # requests ended since the last pass was sent (the last stage forgets them)
        self._broken: ScheduledPass | None = None  # a pass an error stopped: its requests start over (_settle)
        self.on_ended: Callable[[Iterable[int]], None] = lambda mbs: None  # the stage forgets their replicas

    @property
    def depth(self) -> int:
        return 1 if self.downstream is None else self.downstream.depth

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

    def drop_all(self, forget_cache: bool = False) -> None:
        """Forget every request (a new epoch's recovery re-queues those still wanted) and every pass in flight;
        their blocks go back to the pool. The cached prefixes stay, unless ``forget_cache`` (a stage that took
        over part of the pipeline holds none of their KV)."""
        self._settle()
        for flight in self.inflight.values():
            self.scheduler.abandon(flight.step)
        self.inflight.clear()
        for rid in list(self.served):
            self._leave(rid)
        self._ended.clear()
        self.emitter.clear()
        self.announced.clear()
        if self.arrivals is not None:
            self.arrivals.keep(())
        if forget_cache:
            self.scheduler.book.forget_cached()

    def progress(self) -> dict[int, int]:
        """Per running request, the last position whose KV every stage holds (what a repair resumes from)."""
        return {s.mb_id: s.state.computed - 1 for s in self.served.values() if s.state.computed > 0}

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

    def resume(self, points: Mapping[int, int]) -> None:
        """A repair resumes the requests of ``points`` (request -> positions every stage holds now, restored from
        replicas where a stage was replaced) and re-queues the rest, which are forgotten here. Each resumed request
        goes on from those positions (its later ones computed again), with the tokens its stream has that no pass
        returned here (their last stage published them before the failure). Cached prefixes are forgotten: a stage
        that took over holds none of their KV."""
        self._settle()
        for flight in self.inflight.values():
            self.scheduler.abandon(flight.step)
        self.inflight.clear()
        self._ended.clear()
        self.emitter.clear()
        self.announced.clear()  # not admitted: re-run by the repair, announced again
        if self.arrivals is not None:
            self.arrivals.keep(points)
        self.scheduler.book.forget_cached()
        for rid in [rid for rid, s in self.served.items() if s.mb_id not in points]:
            self._leave(rid, finished=False)
        kept = list(self.served.values())
        pipe = self.redis.pipeline(transaction=False)
        for served in kept:
            pipe.xrange(keys.tokens(served.mb_id))
        pipe.execute()  # one round trip: the histories below read streams already in Redis's reply order
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

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()``. An error leaving it (Redis refusing a write) leaves the books in order: the
        next call first restarts the requests of the pass it broke from their token streams."""
        self._settle()
        idle = True
        while not stop():
            if self.ready is not None:
                self._take_announced(block=idle and not self.inflight)
            else:
                self._take_tasks(block=idle and not self.inflight)  # wait a moment for a task instead of spinning
            if self.downstream is not None:
                full = len(self.inflight) >= self.depth
                self._collect(wait=bool(self.inflight) and (idle or full))
                self._expire()
                if len(self.inflight) >= self.depth:
                    continue
            if idle and not self.inflight:  # a pass reads the cancellations once it returns; without one, here
                self._end_cancelled(self._cancelled(self.served.values()))
            step = self.scheduler.schedule()
            self._preempted(step)
            idle = not step
            if idle:
                self._send_ended()
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
        pass_id = next(self._pass_ids)
        wire = tuple(self._wire(s, i in every) for i, s in enumerate(slices))
        if self.downstream.replicas is not None:  # before the pass: stage 1 has it first (FIFO per peer)
            written = [(w.mb, w.table, 0 if w.spec is not None else w.start, w.start + w.length) for w in wire]
            self.downstream.replicas.send_slices(self.executor.pool, written)
        message = SlicePass(pass_id, wire, out, tuple(self._ended))
        self.downstream.endpoint.send(self.downstream.next_peer, Channel.ACTIVATION, message.encode())
        self._ended.clear()
        for s in slices:
            served = self.served[s.request.request_id]
            served.fresh = served.streamed = False
        self.inflight[pass_id] = InFlight(step, started)

    def _send_ended(self) -> None:
        """Tell the later stages which requests ended, when no pass goes to carry it."""
        if self.downstream is None or not self._ended:
            return
        message = SlicePass(next(self._pass_ids), (), None, tuple(self._ended))
        self.downstream.endpoint.send(self.downstream.next_peer, Channel.ACTIVATION, message.encode())
        self._ended.clear()

    def _wire(self, s: Slice, every: bool) -> WireSlice:
        served = self.served[s.request.request_id]
        spec = served.spec if served.fresh else None
        return WireSlice(mb=served.mb_id, start=s.start, length=s.length, table=s.table, samples=s.samples,
                         every=every, generated=s.request.generated, spec=spec, streamed=served.streamed)  # fmt: skip

    def _emit(self, step: ScheduledPass, out: PassLogits) -> tuple[list[Outcome], dict[int, set[int]]]:
        """A one-stage pipeline's sampling: the emitter's outcome of each sampling slice."""
        slices = step.slices
        for i, logits in out.every.items():
            record = self.emitter.records.get(self.served[slices[i].request.request_id].mb_id)
            if record is not None:
                self.emitter.note_prompt_logprobs(record, slices[i].start, logits)
        cancels = self._cancelled(self.served.values())  # one read a pass, every request's
        sampling = [i for i, s in enumerate(slices) if s.samples]
        records = [self.emitter.records[self.served[slices[i].request.request_id].mb_id] for i in sampling]
        if not sampling:
            return [], cancels
        index = torch.tensor(sampling, dtype=torch.long, device=out.last.device)
        return self.emitter.sample(records, out.last[index], cancels), cancels

    def _collect(self, wait: bool) -> None:
        """Take the returns of passes in flight (waiting a moment for one when ``wait``)."""
        assert self.downstream is not None
        timeout = 0.05 if wait else 0.0
        while self.inflight:
            payload = self.downstream.endpoint.recv(Channel.TOKENS, timeout_s=timeout)
            if payload is None:
                return
            timeout = 0.0
            try:
                answer = PassReturn.decode(bytes(payload))
            except ValueError as exc:
                log.error("dropped a malformed pass return: %s", exc)
                continue
            flight = self.inflight.pop(answer.pass_id, None)
            if flight is None:
                log.info("dropped the return of pass %d: it is no longer in flight", answer.pass_id)
                continue
            self._broken = flight.step
            if answer.broken:
                self._restart_pass(flight.step, "the last stage could not publish its tokens")
            elif answer.error is not None:
                self._fail_pass(flight.step, RuntimeError(answer.error))
            else:
                self._update(flight.step, (list(answer.outcomes), self._cancelled(self.served.values())),
                             flight.started)  # fmt: skip
            self._broken = None

    def _expire(self) -> None:
        """Fail the passes in flight for longer than the downstream deadline: the data plane lost them (a dead
        stage would have changed the epoch)."""
        assert self.downstream is not None
        now = time.monotonic()
        for pass_id, flight in list(self.inflight.items()):
            if now - flight.sent > self.downstream.deadline_s:
                del self.inflight[pass_id]
                self._fail_pass(flight.step, DeadlineExceeded(
                    f"pass {pass_id} did not come back within {self.downstream.deadline_s:.0f} s"))  # fmt: skip

    def _fail_pass(self, step: ScheduledPass, error: Exception) -> None:
        self.scheduler.abandon(step)
        for s in step.slices:
            self._fail(s.request.request_id, error)

    def _update(self, step: ScheduledPass, results: tuple[list[Outcome], dict[int, set[int]]], started: float) -> None:
        """Hand the policy what ``step`` produced: the outcome of each request whose slice sampled."""
        outcomes, cancels = results
        by_mb = {served.mb_id: rid for rid, served in self.served.items()}
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
        slices = step.slices
        kind = PassKind.MIXED if any(s.decode for s in slices) and any(not s.decode for s in slices) else (
            PassKind.DECODE if all(s.decode for s in slices) else PassKind.PREFILL)  # fmt: skip
        self.metrics.observe_pass(kind, time.perf_counter() - started, step.tokens)

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

    def _take_announced(self, block: bool) -> None:
        """Disaggregated intake: the prompts announced done since the last pass, then admit those whose prompt KV
        is all on this stage, first come first served, while the policy gives them blocks."""
        assert self.ready is not None
        for _ in range(CLAIMS_PER_PASS):
            ready = self.ready.pop(block_ms=5 if block else None)
            if ready is None:
                break
            block = False
            if ready.all_finished:  # it ended at its first token: its prompt KV is freed everywhere
                self._forget_everywhere(ready.spec.mb_id)
            else:
                self.announced.append(Announced(ready.spec, ready.first_tokens[0]))
        while self.ready.ended:
            self._forget_everywhere(self.ready.ended.popleft())
        self._admit_announced()

    def _admit_announced(self) -> None:
        assert self.arrivals is not None
        now = time.monotonic()
        for waiting in list(self.announced):
            mb = waiting.spec.mb_id
            if not self.arrivals.complete(mb):
                if now - waiting.since > self.kv_deadline_s:
                    self.announced.remove(waiting)
                    self._publish_failure(waiting.spec, 1, DeadlineExceeded(
                        f"its prompt KV did not reach token stage 0 within {self.kv_deadline_s:.0f} s"))  # fmt: skip
                    self._forget_everywhere(mb)
                continue
            spec, row = waiting.spec, waiting.spec.rows[0]
            # A prompt run again (after a repair) goes on from its token stream: the tokens it delivered follow
            # its prompt, computed before its next token is sampled.
            tracker = RowTracker(spec, self.emitter.eos_ids)
            tracker.replay(history(self.redis, mb, before_step=1 << 30))
            if tracker.done:
                self.announced.remove(waiting)
                self._forget_everywhere(mb)
                continue
            outputs = tracker.outputs[0] or [waiting.first_token]
            longest = min(row.sampling.max_tokens, spec.max_len - len(row.prompt_ids) + 1)
            state = RequestState(str(mb), list(row.prompt_ids), len(row.prompt_ids), longest)
            try:
                if not self.scheduler.reserve(state):
                    return  # no room yet: it and those after it wait for blocks to come back
            except RequestTooLong as exc:
                self.announced.remove(waiting)
                self._publish_failure(spec, 1, exc)
                self._forget_everywhere(mb)
                continue
            self.announced.remove(waiting)
            self.arrivals.place(mb, self.executor.pool, state.table)
            self.scheduler.arrived(state, outputs[0])
            state.token_ids.extend(outputs[1:])
            served = Served(spec, state, streamed=True)
            self.served[str(mb)] = served
            if self.downstream is None:
                self.emitter.begin(spec, tracker)
            served.trace = MemberTrace.start(spec, state.generated, (0,), self.queue.epoch)

    def _forget_everywhere(self, mb: int) -> None:
        """A request whose prompt KV may have reached the stages and that ended before it was admitted."""
        if self.arrivals is not None:
            self.arrivals.drop([mb])
        if self.downstream is not None:
            self._ended.append(mb)

    def _restart(self, spec: MicrobatchSpec) -> None:
        """Serve ``spec``'s request from what its token stream says (from its prompt when the stream is empty);
        one served already starts over."""
        rid = str(spec.mb_id)
        if rid in self.served:
            self._leave(rid, finished=False)
        tracker = RowTracker(spec, self.emitter.eos_ids)
        tracker.replay(history(self.redis, spec.mb_id, before_step=1 << 30))
        if tracker.done:
            return  # its stream has its end already
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
            self._publish_failure(spec, tracker.generated[0], exc)
            return
        served = Served(spec, state)
        self.served[rid] = served
        if self.downstream is None:
            self.emitter.begin(spec, tracker)
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
        step = served.state.generated
        entry = TokenStep(mb_id=served.mb_id, step=step, tokens=(-1,), finished=(reason,))
        key = keys.tokens(served.mb_id)
        self.redis.xadd(key, token_entry(self.emitter.signer, key, entry.encode()))

    def _cancelled(self, served: Iterable[Served]) -> dict[int, set[int]]:
        """Per request, the rows its controller cancelled (``{0}`` or nothing), in one Redis round trip."""
        return self.emitter.cancelled([s.mb_id for s in served])

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
        self._publish_failure(served.spec, served.state.generated, error)
        if served.trace is not None:
            served.trace.left(served.state.generated, error)
            served.trace = None
        self._leave(rid)

    def _publish_failure(self, spec: MicrobatchSpec, step: int, error: Exception) -> None:
        log.error("request of microbatch %d failed at step %d: %r", spec.mb_id, step, error)
        n = len(spec.rows)
        entry = TokenStep(mb_id=spec.mb_id, step=step, tokens=(-1,) * n, finished=(FinishReason.ERROR,) * n)
        key = keys.tokens(spec.mb_id)
        self.redis.xadd(key, token_entry(self.emitter.signer, key, entry.encode()))

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
        if finished and self.arrivals is not None:
            self.arrivals.drop([served.mb_id])
        if finished and self.downstream is not None:
            self._ended.append(served.mb_id)
        if finished:
            self.on_ended([served.mb_id])
