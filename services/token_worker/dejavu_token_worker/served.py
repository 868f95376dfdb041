"""The requests token stage 0 of a request-scheduled pipeline serves: how each one starts, goes on after a repair,
and ends.

A request's state here is a function of its spec and its token stream: a request taken again (after a repair, or
after an error broke its pass) starts over from what its stream says, its prompt and the tokens it delivered
computed in one go (mostly found in the prefix cache) and its next token sampled at the step it had reached, so
its stream goes on exactly where it was and no step is emitted twice. A request that ends leaves the policy at once
(its blocks go back) and, on a pipeline of several stages, is named to the later stages with the next pass, so
every stage forgets it (its replicas, records and arrived prompt KV).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import redis

from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, MicrobatchSpec
from dejavu_common.sched import FREED, OutOfBlocks, RequestState, RequestTooLong, ScheduledPass, Scheduler, Status
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import request_layout
from dejavu_token_worker.intake import Announced
from dejavu_token_worker.recovery import Restored
from dejavu_token_worker.runner import history
from dejavu_token_worker.traces import MemberTrace
from dejavu_worker.metrics import Preemption, WorkerMetrics
from dejavu_worker.microbatch import fetch_spec
from dejavu_worker.rows import RowTracker
from dejavulib.errors import DejaVuLibError
from dejavulib.paged import BlockPool, PagedKVCache
from dejavulib.streaming import stream_in

log = logging.getLogger("dejavu.token_worker.loop")


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


class ServedRequests:
    """The requests stage 0 serves (``served``, by request id) in the policy ``scheduler`` over ``pool``, and those
    that ended since the last pass went on (``ended``: every stage forgets them; only with ``depth`` > 1). On a
    one-stage pipeline (``depth`` 1) stage 0 samples, so its ``emitter`` keeps a record of each request served.
    ``on_ended(requests)`` runs for the requests that end for good (the stage forgets their replicas)."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: BlockPool,
        client: redis.Redis,
        emitter: Emitter,
        metrics: WorkerMetrics,
        max_recomputes: int = 8,
        arrivals: PromptArrivals | None = None,
        depth: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.redis = client
        self.emitter = emitter
        self.metrics = metrics
        self.max_recomputes = max_recomputes
        self.arrivals = arrivals
        self.depth = depth
        self.epoch = 0  # the epoch served (traces name it)
        self.served: dict[str, Served] = {}
        self.ended: list[int] = []  # since the last pass went on (the loop empties it as it tells the other stages)
        self.released: list[int] = []  # preempted since the last pass went on: the other stages forget their tables
        self.on_ended: Callable[[Iterable[int]], None] = lambda mbs: None

    # -- what a repair reads ------------------------------------------------------------------------
    def progress(self) -> dict[int, int]:
        """Per running request, the last position whose KV every stage holds (what a repair resumes from)."""
        return {s.mb_id: s.state.computed - 1 for s in list(self.served.values()) if s.state.computed > 0}

    def caches(self, mbs: Iterable[int]) -> Iterator[tuple[int, PagedKVCache, int]]:
        """(request, its KV on this stage as a cache, its last position) of each of ``mbs`` this stage holds:
        what a replaced successor gets back as its replica."""
        pool = self.pool
        wanted = {str(mb) for mb in mbs}
        for rid, served in sorted(self.served.items()):
            state = served.state
            if rid in wanted and state.computed > 0:
                view = PagedKVCache.view(pool, request_layout(pool, len(state.table)), state.table, state.computed)
                yield served.mb_id, view, state.computed - 1

    # -- starting -------------------------------------------------------------------------------------
    def restart(self, spec: MicrobatchSpec) -> None:
        """Serve ``spec``'s request from what its token stream says (from its prompt when the stream is empty);
        one served already starts over."""
        rid = str(spec.mb_id)
        if rid in self.served:
            self.leave(rid, finished=False)
        tracker = self._tracker(spec)
        if tracker.done:  # its stream has its end already
            self.forget_everywhere(spec.mb_id)
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
            self.forget_everywhere(spec.mb_id)
            return
        self._serve(Served(spec, state), tracker)

    def admit_streamed(self, waiting: Announced) -> bool:
        """Admit a request whose prompt KV came from the prompt pipeline, going on from its token stream (a prompt
        run again after a repair: the tokens it delivered follow its prompt, computed before its next token is
        sampled); False when the policy has no room for it yet. Raises :class:`RequestTooLong` for one the pool
        can never hold."""
        assert self.arrivals is not None
        spec, mb = waiting.spec, waiting.spec.mb_id
        tracker = self._tracker(spec)
        if tracker.done:
            self.forget_everywhere(mb)
            return True
        row = spec.rows[0]
        longest = min(row.sampling.max_tokens, spec.max_len - len(row.prompt_ids) + 1)
        state = RequestState(str(mb), list(row.prompt_ids), len(row.prompt_ids), longest)
        if not self.scheduler.reserve(state):
            return False
        try:
            self.arrivals.place(mb, self.pool, state.table, state.cached_tokens)
        except (ValueError, RuntimeError, DejaVuLibError) as exc:  # its KV does not fit it: it fails alone
            self.scheduler.finish(state.request_id)
            self.emitter.publish_failure(spec, tracker.generated[0], exc)
            self.forget_everywhere(mb)
            return True
        outputs = tracker.outputs[0] or [waiting.first_token]
        self.scheduler.arrived(state, outputs[0])
        state.token_ids.extend(outputs[1:])
        self._serve(Served(spec, state, streamed=True), tracker)
        return True

    def _tracker(self, spec: MicrobatchSpec) -> RowTracker:
        """``spec``'s request as its token stream says now."""
        tracker = RowTracker(spec, self.emitter.eos_ids)
        tracker.replay(history(self.redis, spec.mb_id, before_step=1 << 30))
        return tracker

    def _serve(self, served: Served, tracker: RowTracker) -> None:
        self.served[served.state.request_id] = served
        if self.depth == 1:  # the last stage is this one: its emitter's record starts now
            self.emitter.begin(served.spec, tracker)
        served.trace = MemberTrace.start(served.spec, tracker.generated[0], (0,), self.epoch)

    # -- epochs -----------------------------------------------------------------------------------------
    def drop_all(self) -> None:
        """Forget every request (a new epoch's recovery re-queues those still wanted): their blocks go back to the
        pool, their cached prefixes stay."""
        for rid in list(self.served):
            self.leave(rid)
        if self.arrivals is not None:
            self.arrivals.keep(())

    def resume(self, points: Mapping[int, int]) -> None:
        """A repair resumes the requests of ``points`` (request -> positions every stage holds now, restored from
        replicas where a stage was replaced) and re-queues the rest, which are forgotten here. Each resumed request
        goes on from those positions (its later ones computed again), with the tokens its stream has that no pass
        returned here (their last stage published them before the failure). Cached prefixes are forgotten: a stage
        that took over holds none of their KV."""
        if self.arrivals is not None:
            self.arrivals.keep(points)
        book = self.scheduler.book
        book.forget_cached()
        for rid in [rid for rid, s in self.served.items() if s.mb_id not in points]:
            self.leave(rid, finished=False)
        window = self.scheduler.window
        for served in list(self.served.values()):  # rolled back into blocks its window gave back: from its stream
            state = served.state
            if window is not None and points[served.mb_id] < state.freed * book.block_size + window:
                self.restart(served.spec)
        kept = [s for s in self.served.values() if s.state.status is not Status.WAITING]
        for served in kept:
            state = served.state
            state.computed = min(state.computed, points[served.mb_id])
            state.committed = max(state.freed, min(state.committed, state.computed // book.block_size))
            tracker = self._tracker(served.spec)
            state.token_ids.extend(tracker.outputs[0][state.generated :])
            served.fresh = True
            if tracker.done:  # its last token's pass reached the stream: it ended there
                self.leave(str(served.mb_id))
        log.info("resumed requests %s from positions %s", [s.mb_id for s in kept],
                 [s.state.computed for s in kept])  # fmt: skip

    def adopt(
        self, points: Mapping[int, int], tables: Mapping[int, Sequence[int]], restores: Mapping[int, Restored]
    ) -> None:
        """This stage took stage 0 over in a repair, its book empty: each request of ``points`` (request ->
        positions every stage holds) is taken over in the blocks of its table in ``tables`` (as stage 1 holds it, so
        every stage keeps the ids its KV is in), its KV here written from ``restores`` (stage 1's replica of this
        stage), and goes on from those positions with the tokens its stream has. One without a table or a restore,
        or still owing its prompt's log probabilities, runs again from its token stream instead."""
        if self.arrivals is not None:
            self.arrivals.keep(points)
        adopted: list[Served] = []
        for mb, point in sorted(points.items()):
            try:
                spec = fetch_spec(self.redis, mb, 0.0)
            except DeadlineExceeded:  # it ended meanwhile
                self.forget_everywhere(mb)
                continue
            tracker = self._tracker(spec)
            if tracker.done:
                self.forget_everywhere(mb)
                continue
            table, part, row = tables.get(mb), restores.get(mb), spec.rows[0]
            owes_prompt = row.sampling.prompt_logprobs is not None and not tracker.outputs[0]
            # Under a sliding window stage 1 may name blocks stage 0 gave back (it learns so with the request's next
            # pass) and another request took: such a request runs again.
            windowed = self.scheduler.window is not None or FREED in (table or ())
            if table is None or part is None or part.region.positions[0] != 0 or owes_prompt or windowed:
                self.restart(spec)
                continue
            longest = min(row.sampling.max_tokens, spec.max_len - len(row.prompt_ids) + 1)
            state = RequestState(str(mb), [*row.prompt_ids, *tracker.outputs[0]], len(row.prompt_ids), longest)
            # Its next pass computes at least its last token (whose successor the stream does not have yet).
            computed = min(point, part.region.positions[1], len(state.token_ids) - 1)
            more = max(self.scheduler.book.blocks_for(part.region.positions[1]) - len(table), 0)
            try:
                self.scheduler.adopt(state, table, computed, more)
            except RequestTooLong as exc:
                self.emitter.publish_failure(spec, tracker.generated[0], exc)
                self.forget_everywhere(mb)
                continue
            except (ValueError, OutOfBlocks) as exc:
                log.warning("request %d cannot be taken over in its blocks (%s): it runs again", mb, exc)
                self.restart(spec)
                continue
            try:
                self.pool.ensure(b for b in state.table if b >= 0)
                view = PagedKVCache.view(self.pool, request_layout(self.pool, len(state.table)), state.table,
                                         part.region.positions[1])  # fmt: skip
                stream_in(view, part.message, part.region)
            except (ValueError, RuntimeError, DejaVuLibError) as exc:
                log.warning("request %d's restored KV does not fit its blocks (%s): it runs again", mb, exc)
                self.scheduler.finish(state.request_id)
                self.restart(spec)
                continue
            served = Served(spec, state)
            self._serve(served, tracker)
            adopted.append(served)
        log.info("took stage 0 over: resumed requests %s from positions %s", [s.mb_id for s in adopted],
                 [s.state.computed for s in adopted])  # fmt: skip

    # -- ends -------------------------------------------------------------------------------------------
    def end_cancelled(self, cancels: dict[int, set[int]]) -> None:
        """End the requests not in flight whose clients went away (``cancels``: :meth:`Emitter.cancelled`'s)."""
        for s in [s for s in self.served.values() if cancels.get(s.mb_id) and not s.state.in_flight]:
            self.emitter.publish_end(s.mb_id, s.state.generated, FinishReason.CANCELLED)
            self.leave(str(s.mb_id))

    def preempted(self, step: ScheduledPass) -> None:
        """Count the requests the policy preempted to plan ``step``; one preempted more than ``max_recomputes``
        times fails."""
        for request in step.preempted:
            self.metrics.count_preemption(Preemption.RECOMPUTE)
            log.info("KV pool full: request %s preempted (its blocks back, cached ones kept), to be recomputed",
                     request.request_id)  # fmt: skip
            served = self.served.get(request.request_id)
            if served is not None and served.trace is not None:
                served.trace.event("recompute")
            if served is not None and self.depth > 1:  # its blocks may go to others from this pass on
                self.released.append(served.mb_id)
            if request.preemptions > self.max_recomputes:
                self.fail(request.request_id, RuntimeError(
                    f"request {request.request_id} was preempted {request.preemptions} times (engine.max_recomputes "
                    f"{self.max_recomputes}): the KV pool is too small for the work admitted"))  # fmt: skip

    def fail(self, rid: str, error: Exception) -> None:
        """Publish ``error`` on request ``rid``'s stream; it ends."""
        served = self.served.get(rid)
        if served is None:
            return
        self.emitter.publish_failure(served.spec, served.state.generated, error)
        if served.trace is not None:
            served.trace.left(served.state.generated, error)
            served.trace = None
        self.leave(rid)

    def forget_everywhere(self, mb: int) -> None:
        """Request ``mb`` ended: every stage forgets it (its prompt KV arrived, its replicas, its record)."""
        if self.arrivals is not None:
            self.arrivals.drop([mb])
        if self.depth > 1:
            self.ended.append(mb)

    def leave(self, rid: str, finished: bool = True) -> None:
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
            self.forget_everywhere(served.mb_id)
            self.on_ended([served.mb_id])
