"""The loop of a request-scheduled pipeline's stage 0: plan, execute, update.

Every iteration takes the colocated tasks queued for it (each one request: a one-row token microbatch), lets the
scheduling policy (:class:`dejavu_common.sched.Scheduler`) plan the next pass (the running requests' decodes, then
prompt chunks under the token budget, prefixes found cached skipped) and computes it: on a one-stage pipeline the
executor runs it and the :class:`Emitter` samples the requests whose slice ends at their last known token and
publishes their tokens (one pipelined Redis write per pass) at once; on a pipeline of several stages stage 0 computes
its layers and sends the pass on (:class:`~dejavu_worker.dataplane.SlicePass`), keeping up to one pass per stage in
flight, and the last stage's emitter returns what each request sampled. Either way the results go back to the
policy, which frees the blocks of requests that finished.

The requests themselves (how each starts from its token stream, goes on after a repair and ends) are the
:class:`~dejavu_token_worker.served.ServedRequests`' the loop holds; the intake is
:mod:`dejavu_token_worker.intake`'s, the computing the :class:`SliceExecutor`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import redis
import torch

from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, PromptTask
from dejavu_common.sched import RequestTooLong, ScheduledPass, Scheduler, Slice
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.downstream import Downstream
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import PassLogits, SliceExecutor
from dejavu_token_worker.intake import Announcements, ColocatedIntake, ColocatedQueue
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.recovery import Restored
from dejavu_token_worker.runner import STEP_FAILURES
from dejavu_token_worker.served import ServedRequests
from dejavu_worker.dataplane import Outcome, PassReturn, WireSlice
from dejavu_worker.metrics import PassKind, WorkerMetrics

log = logging.getLogger("dejavu.token_worker.loop")

CLAIMS_PER_PASS = 16  # requests taken before each pass at most (the controller bounds what it dispatches)


class RequestLoop:
    """Stage 0 of a request-scheduled pipeline (its only stage while ``downstream``, set per epoch, is None). Its
    books outlive epochs (the prefix cache does); a new epoch's recovery resumes or drops what it serves
    (:meth:`resume`, :meth:`drop_all`). ``requests``: the requests it serves; ``ready`` and ``arrivals``: a
    disaggregated pipeline's intake; ``depth``: the pipeline's stages."""

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
        self.depth = depth  # the pipeline's stages
        self.downstream: Downstream | None = None  # the stages after this one, at the epoch served
        self.requests = ServedRequests(
            scheduler, executor.pool, client, emitter, metrics, max_recomputes, arrivals, depth
        )
        self.queue = ColocatedQueue(client, worker_id, 0, held)
        self.colocated = ColocatedIntake(self.queue, lambda spec, error: emitter.publish_failure(spec, 0, error))
        self.announced = (
            Announcements(ready, arrivals, kv_deadline_s, self.requests.forget_everywhere)
            if ready and arrivals
            else None
        )
        self._broken: ScheduledPass | None = None  # a pass an error stopped: its requests start over (_settle)

    def serve(self, epoch: int) -> None:
        """Serve ``epoch`` from now on (tasks queued under another epoch are held or dropped)."""
        self.queue.epoch = self.requests.epoch = epoch

    # -- epochs -----------------------------------------------------------------------------------
    def drop_all(self) -> None:
        """Forget every request (a new epoch's recovery re-queues those still wanted): their blocks go back to the
        pool, their cached prefixes stay."""
        self._forget_passes()
        self.requests.drop_all()

    def resume(self, points: Mapping[int, int]) -> None:
        """A repair resumes the requests of ``points`` (request -> positions every stage holds now) and re-queues
        the rest (:meth:`ServedRequests.resume`)."""
        self._forget_passes()
        self.requests.resume(points)

    def adopt(
        self, points: Mapping[int, int], tables: Mapping[int, Sequence[int]], restores: Mapping[int, Restored]
    ) -> None:
        """This stage took stage 0 over: its book takes the requests of ``points`` over in the blocks of ``tables``,
        their KV here from ``restores`` (:meth:`ServedRequests.adopt`)."""
        self._forget_passes()
        self.requests.adopt(points, tables, restores)

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
                self.requests.end_cancelled(self.emitter.cancelled(self._mbs()))
            step = self.scheduler.schedule()
            self.requests.preempted(step)
            idle = not step
            if idle:
                if down is not None and (self.requests.ended or self.requests.released):
                    down.send_ended(self.requests.ended, self.requests.released)
                    self.requests.ended, self.requests.released = [], []
                continue
            self._broken = step
            self._launch(step)
            self._broken = None

    def _mbs(self) -> list[int]:
        return [s.mb_id for s in self.requests.served.values()]

    def _settle(self) -> None:
        if self._broken is None:
            return
        broken, self._broken = self._broken, None
        self._restart_pass(broken, "an error broke it")

    def _restart_pass(self, broken: ScheduledPass, why: str) -> None:
        self.scheduler.abandon(broken)
        served = self.requests.served
        rids = [s.request.request_id for s in broken.slices if s.request.request_id in served]
        log.warning("a pass did not complete (%s): requests %s run again from their token streams", why, rids)
        for rid in rids:
            self.requests.restart(served[rid].spec)

    def _launch(self, step: ScheduledPass) -> None:
        started = time.perf_counter()
        slices = step.slices
        served = self.requests.served
        every = {i for i, s in enumerate(slices) if served[s.request.request_id].wants_prompt_logprobs
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
        self.downstream.send(step, wire, out, self.executor.pool, started, self.requests.ended, self.requests.released)
        self.requests.ended, self.requests.released = [], []  # sent: every stage forgets them with this pass
        for s in slices:
            one = served[s.request.request_id]
            one.fresh = one.streamed = False

    def _wire(self, s: Slice, every: bool) -> WireSlice:
        served = self.requests.served[s.request.request_id]
        spec = served.spec if served.fresh else None
        cached = s.request.cached_tokens if served.streamed else 0
        return WireSlice(mb=served.mb_id, start=s.start, length=s.length, table=s.table, samples=s.samples,
                         every=every, generated=s.request.generated, spec=spec, streamed=served.streamed,
                         cached=cached)  # fmt: skip

    def _emit(self, step: ScheduledPass, out: PassLogits) -> tuple[list[Outcome], dict[int, set[int]]]:
        """A one-stage pipeline's sampling: the emitter's outcome of each sampling slice."""
        slices, served = step.slices, self.requests.served
        records = self.emitter.records
        for i, logits in out.every.items():
            record = records.get(served[slices[i].request.request_id].mb_id)
            if record is not None:
                self.emitter.note_prompt_logprobs(record, slices[i].start, logits)
        cancels = self.emitter.cancelled(self._mbs())  # one read a pass
        sampling = [i for i, s in enumerate(slices) if s.samples]
        if not sampling:
            return [], cancels
        chosen = [records[served[slices[i].request.request_id].mb_id] for i in sampling]
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
                    self.requests.fail(rid, RuntimeError(answer.error))
                elif rid in self.requests.served:
                    self.requests.restart(self.requests.served[rid].spec)
        elif answer.error is not None:
            self._fail_pass(step, RuntimeError(answer.error))
        else:
            cancels = self.emitter.cancelled(self._mbs())
            self._update(step, (list(answer.outcomes), cancels), started)

    def _fail_pass(self, step: ScheduledPass, error: Exception) -> None:
        self.scheduler.abandon(step)
        for s in step.slices:
            self.requests.fail(s.request.request_id, error)

    def _update(self, step: ScheduledPass, results: tuple[list[Outcome], dict[int, set[int]]], started: float) -> None:
        """Hand the policy what ``step`` produced: the outcome of each request whose slice sampled."""
        outcomes, cancels = results
        requests, served = self.requests, self.requests.served
        in_step = {s.request.request_id for s in step.slices}
        by_mb = {one.mb_id: rid for rid, one in served.items() if rid in in_step}
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
            one = served.get(request.request_id)
            if one is not None and request.request_id not in stopped:  # the policy's bound came first
                self.emitter.publish_end(one.mb_id, one.state.generated, FinishReason.LENGTH)
            requests.leave(request.request_id)
        for rid in sampled:
            one = served.get(rid)
            if one is not None and one.trace is not None:
                one.trace.stepped(one.state.generated, (0,))
        for rid in stopped:
            if rid in served:
                requests.leave(rid)
        requests.end_cancelled(cancels)  # the cancelled requests whose slices did not sample (or not in the pass)
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
                self.requests.restart(spec)
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
                if not self.requests.admit_streamed(waiting):
                    return  # no room yet: it and those after it wait for blocks to come back
            except RequestTooLong as exc:
                self.emitter.publish_failure(waiting.spec, 1, exc)
                self.requests.forget_everywhere(waiting.spec.mb_id)
            announced.admitted(waiting)
