"""Per-request passes under a token budget in the simulator: :class:`dejavu_common.sched.Scheduler` itself.

:class:`BudgetSimulator` runs deployments with ``batching = budget`` on the event loop of
:mod:`dejavu_planner.simulator`. The decoding pipeline (the colocated one, or DejaVu's token pipeline) keeps up to
``depth`` passes in flight; whenever its first stage is free it asks the scheduler for the next pass (running
requests' decodes and prompt chunks, then new requests, under the token budget and the KV pool's blocks, with
recompute preemption when the pool runs short) and the pass visits the stages in order. When a pass leaves the last
stage the scheduler takes its results: a slice that sampled gave its request a token (the first one: its time to
first token), and a request at its token count finishes and returns its blocks at once.

With DejaVu's prompt pipeline, a request's blocks are reserved on the token pipeline when its prompt is
dispatched (the prompt pipeline takes waiting requests only while the token pipeline can reserve them, packed by
tokens up to the prompt budget per pass, at most ``D_p`` passes in flight); once the prompt pass leaves the prompt
pipeline's last stage, the request has its first token and decodes on the token pipeline.

Costs per stage: decodes as one token step of that many rows; a chunk of ``n`` positions after ``s`` cached ones as
the profile's prompt time of ``s + n`` positions less that of ``s`` (its attention grows with its context); the
last stage adds the head for every sampling row. Prefix caching is off (a trace has token counts, not token ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dejavu_common.sched import BlockBook, Budget, RequestState, ScheduledPass, Scheduler, Slice
from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Deployment
from dejavu_planner.simulator import Role, Simulator, _Pipeline, _Stage
from dejavu_planner.trace import Request, Trace


@dataclass(frozen=True)
class _Pass:
    """A pass through a pipeline's stages: a scheduled pass of the decoding pipeline, or a prompt pass."""

    number: int
    slices: tuple[Slice, ...] = ()
    prompts: tuple[RequestState, ...] = ()
    scheduled: ScheduledPass | None = None

    @property
    def mid(self) -> int:
        return self.number

    @property
    def step(self) -> int:
        return self.number

    @property
    def batch(self) -> int:
        return len(self.slices) + len(self.prompts)


def pass_stage_time(cost: CostModel, stage_layers: int, slices: Sequence[Slice], last: bool) -> float:
    """One pass of ``slices`` on a stage of ``stage_layers`` layers (``last``: it runs the head too), as
    :meth:`CostModel.pass_stage_time` costs it: a one-position slice past a request's start is a decode."""
    decodes = [s for s in slices if s.length == 1 and s.start > 0]
    chunks = [(s.start, s.length) for s in slices if not (s.length == 1 and s.start > 0)]
    sampling = sum(1 for s in slices if s.samples)
    return cost.pass_stage_time(stage_layers, len(decodes), chunks, sampling, last)


def pool_blocks(cost: CostModel, depth: int, block_size: int, share: float = 0.6) -> int:
    """Blocks of ``block_size`` positions the fullest stage of a ``depth``-stage pipeline holds: ``share`` of the
    memory its weights leave (the runtime's ``engine.kv_pool_bytes`` default)."""
    fullest = -(-cost.layers // depth)
    free = cost.profile.machine_memory_bytes - fullest * cost.weights_per_layer()
    per_block = fullest * block_size * cost.profile.kv_bytes_per_token_per_layer
    return max(int(free * share) // per_block, 1)


class BudgetSimulator(Simulator):
    """Runs one deployment with per-request passes under a token budget over one trace; call :meth:`run` once."""

    def __init__(
        self,
        deployment: Deployment,
        trace: Trace,
        cost: CostModel,
        record_timeline: bool = False,
        batch_wait_s: float = 0.0,
    ) -> None:
        super().__init__(deployment, trace, cost, record_timeline, batch_wait_s)
        d = self.deployment
        if not d.budgeted:
            raise ValueError(f"{d.label()} does not batch under a token budget: use simulate()")
        self._decoder = self.pipelines[-1]
        blocks = d.kv_blocks or pool_blocks(cost, len(self._decoder.stages), d.block_size)
        self.scheduler = Scheduler(
            BlockBook(blocks, d.block_size, caching=False),
            Budget(tokens=d.token_budget, max_running=d.max_running, depth=len(self._decoder.stages)),
        )
        self._requests: dict[str, Request] = {}
        self._numbers = iter(range(1 << 62))

    # -- intake ---------------------------------------------------------------------------------
    def _state(self, r: Request) -> RequestState:
        key = str(r.rid)
        self._requests[key] = r
        return RequestState(key, [0] * r.prompt_len, r.prompt_len, r.new_tokens)

    def _admit_all(self) -> None:
        if self._decoder.role is Role.TOKEN:
            self._dispatch_prompts(self.pipelines[0])
        else:
            while self._waiting:
                self.scheduler.add(self._state(self._waiting.popleft()))
        self._try_start(self._decoder, self._decoder.stages[0])

    def _dispatch_prompts(self, prompt: _Pipeline) -> None:
        """DejaVu: prompt passes of waiting requests whose blocks the token pipeline reserves, by tokens."""
        while prompt.in_flight < prompt.slots and self._waiting:
            taken: list[RequestState] = []
            tokens = 0
            while self._waiting and (not taken or tokens + self._waiting[0].prompt_len <= self.deployment.token_budget):
                state = self._state(self._waiting[0])
                if not self.scheduler.reserve(state):
                    break
                self._waiting.popleft()
                taken.append(state)
                tokens += state.prompt_len
            if not taken:
                return
            prompt.in_flight += 1
            self._enqueue(prompt, prompt.stages[0], _Pass(next(self._numbers), prompts=tuple(taken)))

    # -- the decoding pipeline's first stage ----------------------------------------------------
    def _try_start(self, pipeline: _Pipeline, stage: _Stage) -> None:
        idle = not stage.busy and not stage.queue and pipeline.in_flight < pipeline.slots
        if pipeline is self._decoder and stage.index == 0 and idle:
            scheduled = self.scheduler.schedule()
            if scheduled:
                pipeline.in_flight += 1
                stage.queue.append(_Pass(next(self._numbers), scheduled.slices, scheduled=scheduled))
        super()._try_start(pipeline, stage)

    def _duration(self, pipeline: _Pipeline, stage: _Stage, mb) -> float:
        last = stage.index == len(pipeline.stages) - 1
        if mb.prompts:
            lens = [r.prompt_len for r in mb.prompts]
            compute = sum(self.cost.prompt_stage_time(stage.layers, 1, n, False) for n in lens)
            head = self.cost.profile.head_step_time(len(lens)) if last else 0.0
            return self.cost.profile.stream_overhead * compute + head
        return pass_stage_time(self.cost, stage.layers, mb.slices, last)

    def _step_done(self, pipeline: _Pipeline, mb) -> None:
        pipeline.in_flight -= 1
        if mb.prompts:
            for state in mb.prompts:
                self._first_token[int(state.request_id)] = self.now
                if state.max_tokens <= 1:
                    self.scheduler.finish(state.request_id)
                    self._finish_requests([self._requests.pop(state.request_id)])
                else:
                    self.scheduler.arrived(state, 0)
        else:
            sampled = {s.request.request_id: 0 for s in mb.slices if s.samples}
            for s in mb.slices:
                if s.samples and s.request.generated == 0:
                    self._first_token[int(s.request.request_id)] = self.now
            finished = self.scheduler.update(mb.scheduled, sampled)
            self._finish_requests(self._requests.pop(r.request_id) for r in finished)
        self._admit_all()
        if pipeline is not self._decoder:
            self._try_start(self._decoder, self._decoder.stages[0])
