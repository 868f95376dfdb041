"""A discrete-event simulator of pipeline-parallel LLM serving under the paper's three policies.

The serving runtime's own policy (iteration-level batching in cohorts) builds on this event loop
in :mod:`dejavu_planner.cohorts`; :func:`simulate` runs either, by the deployment's ``batching``.

Model (see docs/planner.md for the assumptions):

* A pipeline is a chain of stages. A microbatch step (its prompt, or one token step) visits
  the stages in order; each stage serves waiting steps first-come first-served, one at a time,
  for the cost model's time of its layers.
* A pipeline holds at most ``depth`` microbatches in flight (the KV caches it preallocates).
  A microbatch takes up to ``microbatch`` waiting requests, first come first served. As the
  serving controller's scheduler does, a microbatch forms when ``microbatch`` requests wait or
  when the oldest has waited ``batch_wait_s`` (0 by default: at once).
* A microbatch runs until its longest request ends; shorter ones finish early (their latency
  ends at their own last token) but keep their rows: an early stop frees no capacity.
* Baseline: a finished microbatch is replaced at once by a new one whose prompt then shares
  the stages with the others' token steps. Baseline-DP: several such pipelines share one queue.
* FasterTransformer: a batch of ``depth`` microbatches runs to the batch's longest request and
  every request returns when the whole batch has left the last stage.
* DejaVu: a prompt pipeline (stage times × ``m``, the streaming overhead) feeds a queue of
  prompt-done microbatches that a token pipeline admits as its slots free up. As the serving
  controller does, at most ``D_p + D_t`` microbatches exist at once (the prompt pipeline runs
  ahead of the token pipeline by at most its own depth), so prompts wait for token slots.
* The last stage of a pipeline also runs the head when the profile times it apart.
* Swapping: a token step on a stage lasts ``max(compute, swap-in of the microbatch's KV)``.

Pure Python (heapq); deterministic for a given input.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from dejavu_planner.costmodel import CostModel, split_layers
from dejavu_planner.deployment import Deployment, Policy
from dejavu_planner.result import RequestRecord, Segment, SimResult
from dejavu_planner.trace import Request, Trace


class Role(enum.StrEnum):
    COMBINED = "combined"  # baseline / FasterTransformer: prompts and tokens
    PROMPT = "prompt"
    TOKEN = "token"


@dataclass
class _Microbatch:
    """A microbatch in flight; ``step`` is 0 before its prompt is done, then token steps done + 1."""

    mid: int
    requests: tuple[Request, ...]
    token_steps: int
    step: int = 0

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def live(self) -> int:
        """Rows still running: requests that want more tokens than the steps done so far gave them."""
        return sum(1 for r in self.requests if r.new_tokens > self.step)

    @property
    def prompt_len(self) -> int:
        return max(r.prompt_len for r in self.requests)


@dataclass
class _Stage:
    index: int
    layers: int
    queue: deque[_Microbatch] = field(default_factory=deque)
    busy: bool = False


@dataclass
class _Pipeline:
    name: str
    role: Role
    stages: list[_Stage]
    slots: int
    in_flight: int = 0
    batch_members: list[_Microbatch] = field(default_factory=list)  # FasterTransformer only


@dataclass(frozen=True)
class _StageDone:
    """Event: ``stage`` of ``pipeline`` finished its current step of ``mb``."""

    pipeline: _Pipeline
    stage: _Stage
    mb: _Microbatch


@dataclass(frozen=True)
class _Wake:
    """Event: the oldest waiting request has waited ``batch_wait_s``; a partial microbatch may form."""


Event = Request | _StageDone | _Wake


class Simulator:
    """Runs one deployment over one trace; call :meth:`run` once."""

    def __init__(
        self,
        deployment: Deployment,
        trace: Trace,
        cost: CostModel,
        record_timeline: bool = False,
        batch_wait_s: float = 0.0,
    ) -> None:
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self.deployment = deployment
        self.batch_wait_s = batch_wait_s
        self.trace = trace
        self.cost = cost
        self.record_timeline = record_timeline
        self.now = 0.0
        self._events: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self._mids = itertools.count()
        self._waiting: deque[Request] = deque()
        self._prompted: deque[_Microbatch] = deque()  # DejaVu: prompts done, awaiting a token slot
        self._first_token: dict[int, float] = {}
        self._records: list[RequestRecord] = []
        self._timeline: list[Segment] = []
        self._wakes: set[float] = set()  # times of pending _Wake events
        self.pipelines = self._build_pipelines()

    def _build_pipelines(self) -> list[_Pipeline]:
        d = self.deployment

        def pipeline(name: str, role: Role, depth: int) -> _Pipeline:
            stages = [_Stage(i, n) for i, n in enumerate(split_layers(self.cost.layers, depth))]
            return _Pipeline(name, role, stages, slots=depth)

        if d.policy is Policy.DEJAVU:
            return [pipeline("prompt", Role.PROMPT, d.depth), pipeline("token", Role.TOKEN, d.token_depth)]
        return [pipeline(f"pipeline{r}", Role.COMBINED, d.depth) for r in range(d.replicas)]

    def run(self) -> SimResult:
        """Simulate until every request has finished; returns the result."""
        for request in self.trace.requests:
            self._push(request.arrival_s, request)
        while self._events:
            self.now, _, payload = heapq.heappop(self._events)
            if isinstance(payload, _StageDone):
                self._stage_done(payload.pipeline, payload.stage, payload.mb)
                continue
            if isinstance(payload, _Wake):
                self._wakes.discard(self.now)
                self._admit_all()
                continue
            self._waiting.append(payload)
            # Requests arriving at the same instant form microbatches together.
            while self._events and self._events[0][0] == self.now:
                same_time = self._events[0][2]
                if not isinstance(same_time, Request):
                    break
                heapq.heappop(self._events)
                self._waiting.append(same_time)
            self._admit_all()
        records = tuple(sorted(self._records, key=lambda r: r.rid))
        assert len(records) == len(self.trace), "every request must finish"
        makespan = max(r.finish_s for r in records)
        return SimResult(self.deployment, makespan, records, tuple(self._timeline))

    # -- events ---------------------------------------------------------------------------------

    def _push(self, time: float, payload: Event) -> None:
        heapq.heappush(self._events, (time, next(self._seq), payload))

    def _enqueue(self, pipeline: _Pipeline, stage: _Stage, mb: _Microbatch) -> None:
        stage.queue.append(mb)
        self._try_start(pipeline, stage)

    def _try_start(self, pipeline: _Pipeline, stage: _Stage) -> None:
        if stage.busy or not stage.queue:
            return
        mb = stage.queue.popleft()
        stage.busy = True
        end = self.now + self._duration(pipeline, stage, mb)
        if self.record_timeline:
            self._timeline.append(Segment(pipeline.name, stage.index, self.now, end, mb.mid, mb.step, mb.batch))
        self._push(end, _StageDone(pipeline, stage, mb))

    def _duration(self, pipeline: _Pipeline, stage: _Stage, mb: _Microbatch) -> float:
        last = stage.index == len(pipeline.stages) - 1
        if mb.step == 0:
            compute = self.cost.prompt_stage_time(stage.layers, mb.batch, mb.prompt_len, last)
            m = self.cost.profile.stream_overhead if pipeline.role is Role.PROMPT else 1.0
            return m * compute
        compute = self.cost.token_stage_time(stage.layers, mb.batch, last)
        if not self.deployment.swap:
            return compute
        context = mb.prompt_len + mb.step
        return max(compute, self.cost.swap_in_time(stage.layers, mb.batch, context))

    def _stage_done(self, pipeline: _Pipeline, stage: _Stage, mb: _Microbatch) -> None:
        stage.busy = False
        if stage.index + 1 < len(pipeline.stages):
            self._enqueue(pipeline, pipeline.stages[stage.index + 1], mb)
        else:
            self._step_done(pipeline, mb)
        self._try_start(pipeline, stage)

    # -- microbatch lifecycle -------------------------------------------------------------------

    def _step_done(self, pipeline: _Pipeline, mb: _Microbatch) -> None:
        """A microbatch left the last stage: record tokens, then continue, hand over or retire it."""
        mb.step += 1
        if mb.step == 1:
            for r in mb.requests:
                self._first_token[r.rid] = self.now
        if self.deployment.policy is not Policy.FASTER_TRANSFORMER:  # FT returns whole batches
            self._finish_requests(r for r in mb.requests if r.new_tokens == mb.step)
        if pipeline.role is Role.PROMPT:
            pipeline.in_flight -= 1
            if mb.token_steps > 0:
                self._prompted.append(mb)
            self._admit_all()
        elif mb.step <= mb.token_steps:
            self._enqueue(pipeline, pipeline.stages[0], mb)
        else:
            self._retire(pipeline, mb)

    def _retire(self, pipeline: _Pipeline, mb: _Microbatch) -> None:
        pipeline.in_flight -= 1
        if self.deployment.policy is Policy.FASTER_TRANSFORMER and pipeline.in_flight == 0:
            self._finish_requests(r for member in pipeline.batch_members for r in member.requests)
            pipeline.batch_members.clear()
        self._admit_all()

    def _finish_requests(self, requests: Iterable[Request]) -> None:
        for r in requests:
            first = self._first_token[r.rid]
            self._records.append(RequestRecord(r.rid, r.arrival_s, first, self.now, r.new_tokens))

    def _admit_all(self) -> None:
        for pipeline in self.pipelines:
            if pipeline.role is Role.TOKEN:
                self._admit_prompted(pipeline)
            elif self.deployment.policy is Policy.FASTER_TRANSFORMER:
                self._admit_batch(pipeline)
            else:
                self._admit_new(pipeline)

    def _may_form(self) -> bool:
        """Whether a microbatch may form now: enough requests wait, or the oldest has waited long enough.

        When it may not, a wake-up is scheduled for the moment the oldest request's wait runs out.
        """
        if not self._waiting:
            return False
        if len(self._waiting) >= self.deployment.microbatch:
            return True
        due = self._waiting[0].arrival_s + self.batch_wait_s
        if self.now >= due - 1e-9:  # the tolerance absorbs the rounding of arrival + wait
            return True
        if due not in self._wakes:
            self._wakes.add(due)
            self._push(due, _Wake())
        return False

    def _take_microbatch(self) -> tuple[Request, ...]:
        size = min(self.deployment.microbatch, len(self._waiting))
        return tuple(self._waiting.popleft() for _ in range(size))

    def _outstanding_room(self, pipeline: _Pipeline) -> bool:
        """DejaVu: whether another microbatch may be formed (the controller's ``D_p + D_t`` bound on
        microbatches in the prompt pipeline, awaiting a token slot, or in the token pipeline)."""
        if pipeline.role is not Role.PROMPT:
            return True
        outstanding = sum(p.in_flight for p in self.pipelines) + len(self._prompted)
        return outstanding < sum(p.slots for p in self.pipelines)

    def _admit_new(self, pipeline: _Pipeline) -> None:
        """Fill free slots with new microbatches from the waiting requests (their prompt first)."""
        while pipeline.in_flight < pipeline.slots and self._outstanding_room(pipeline) and self._may_form():
            requests = self._take_microbatch()
            mb = _Microbatch(next(self._mids), requests, max(r.new_tokens for r in requests) - 1)
            pipeline.in_flight += 1
            self._enqueue(pipeline, pipeline.stages[0], mb)

    def _admit_prompted(self, pipeline: _Pipeline) -> None:
        """DejaVu token pipeline: admit prompt-done microbatches, oldest first."""
        while pipeline.in_flight < pipeline.slots and self._prompted:
            pipeline.in_flight += 1
            self._enqueue(pipeline, pipeline.stages[0], self._prompted.popleft())

    def _admit_batch(self, pipeline: _Pipeline) -> None:
        """FasterTransformer: only an empty pipeline takes a new batch of up to ``depth`` microbatches."""
        if pipeline.in_flight > 0 or not self._may_form():
            return
        groups = [self._take_microbatch() for _ in range(pipeline.slots) if self._waiting]
        steps = max(r.new_tokens for group in groups for r in group) - 1
        for requests in groups:
            mb = _Microbatch(next(self._mids), requests, steps)
            pipeline.in_flight += 1
            pipeline.batch_members.append(mb)
            self._enqueue(pipeline, pipeline.stages[0], mb)


def simulate(
    deployment: Deployment,
    trace: Trace,
    cost: CostModel,
    record_timeline: bool = False,
    batch_wait_s: float = 0.0,
) -> SimResult:
    """Simulate ``deployment`` serving ``trace`` with stage times from ``cost``; a partial microbatch
    forms once its oldest request has waited ``batch_wait_s`` (the controller's ``batch_wait_ms``).
    Cohort batching (the serving runtime) runs in :class:`dejavu_planner.cohorts.CohortSimulator`, per-request passes
    under a token budget in :class:`dejavu_planner.budget.BudgetSimulator`."""
    if deployment.cohorts:
        from dejavu_planner.cohorts import CohortSimulator  # it builds on this module's Simulator

        return CohortSimulator(deployment, trace, cost, record_timeline, batch_wait_s).run()
    if deployment.budgeted:
        from dejavu_planner.budget import BudgetSimulator  # it builds on this module's Simulator

        return BudgetSimulator(deployment, trace, cost, record_timeline, batch_wait_s).run()
    return Simulator(deployment, trace, cost, record_timeline, batch_wait_s).run()
