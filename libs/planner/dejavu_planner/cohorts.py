"""The serving runtime's policy in the simulator: iteration-level batching in cohorts.

:class:`CohortSimulator` runs deployments with ``batching = cohort``, next to the paper's
microbatch policies of :mod:`dejavu_planner.simulator`, whose event loop, stages and
microbatch formation it reuses. It mirrors the controller's scheduler
(services/controller/dejavu_controller/scheduler.py) and token stage 0's loop
(services/token_worker/dejavu_token_worker/driver.py):

* **Dispatch.** The controller forms a microbatch of up to ``b`` waiting requests (``b`` wait, or the
  oldest has waited ``batch_wait_s``) while fewer than ``max_running + D_p·b`` dispatched requests
  are unfinished; a request frees its place the moment it finishes (colocated: ``max_running``; with
  swapping ``(D_t + D_p)·b``, one microbatch per cohort as in the paper).
* **Prompts (DejaVu).** The prompt pipeline's stage 0 takes formed microbatches in order whenever it
  is free (stage times × ``m``); the prompt yields the first token, then the microbatch waits for a
  cohort.
* **Cohorts.** The decoding pipeline (DejaVu's token pipeline, or the colocated one) keeps one cohort
  per stage. Its stage 0 runs the cohorts at their step boundary in turn. Before a cohort's pass,
  waiting microbatches join it, oldest first, while it has room: up to ``ceil(max_running / depth)``
  rows (an empty cohort takes one whatever its size), and only while no lighter cohort is at its
  boundary too (balance). A pass batches every member's rows and visits the stages in order (each
  first come first served). When it leaves the last stage, every member advances one step; requests
  whose last token that was finish, and a microbatch whose every row finished leaves its cohort at
  once; the others stop computing their finished rows (the runtime's passes compute only each
  member's unfinished rows).
* **Colocated prefill.** A cohort at its boundary with fewer rows than the cap takes the next formed
  microbatch and its pass prefills that microbatch alone (the other members skip that pass).
* **Costs.** A pass on a stage costs :meth:`CostModel.cohort_step_time` (a token step of all its
  members' unfinished rows), a prefill the stage's prompt time; the last stage adds the head.

Pure Python; deterministic for a given input.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Deployment, Policy
from dejavu_planner.simulator import Role, Simulator, _Microbatch, _Pipeline, _Stage
from dejavu_planner.trace import Trace

_UNLIMITED = 1 << 30


@dataclass
class _Cohort:
    """One of the decoding pipeline's batches in flight; ``in_flight`` while a pass of it runs."""

    index: int
    members: list[_Microbatch] = field(default_factory=list)
    in_flight: bool = False
    passes: int = 0  # decode passes started, for the timeline

    @property
    def rows(self) -> int:
        """Rows its next pass computes: the unfinished rows of every member."""
        return sum(mb.live for mb in self.members)


@dataclass(frozen=True)
class _Pass:
    """One pass of a cohort through the stages: a decode step of ``members``, or a prefill of one."""

    cohort: _Cohort
    members: tuple[_Microbatch, ...]
    prefill: bool
    number: int

    @property
    def batch(self) -> int:
        """Rows the pass computes: a prefill every row of its microbatch, a decode step the unfinished
        rows of every member."""
        return sum(mb.batch if self.prefill else mb.live for mb in self.members)

    @property
    def mid(self) -> int:
        """The timeline's "microbatch" of a pass: its cohort."""
        return self.cohort.index

    @property
    def step(self) -> int:
        """The timeline's step of a pass: 0 for a prefill, else the cohort's decode pass number."""
        return 0 if self.prefill else self.number


class CohortSimulator(Simulator):
    """Runs one deployment with cohort batching over one trace; call :meth:`run` once."""

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
        if not d.cohorts:
            raise ValueError(f"{d.label()} does not batch in cohorts: use simulate()")
        self._decoder = self.pipelines[-1]  # the token pipeline, or the colocated one
        self._cohorts = [_Cohort(i) for i in range(d.cohort_depth)]
        self._runnable: deque[int] = deque(range(d.cohort_depth))  # cohorts at their boundary, in turn
        self._formed: deque[_Microbatch] = deque()  # colocated: awaiting a cohort's prefill
        self._active: list[_Microbatch] = []  # dispatched, not every row finished (the controller's view)
        self._max_members = 1 if d.swap else _UNLIMITED
        ahead = d.depth if d.policy is Policy.DEJAVU else 0  # prompt microbatches the prompt pipeline may run
        if d.swap:
            self._max_outstanding = (d.cohort_depth + ahead) * d.microbatch
        else:
            self._max_outstanding = d.max_running + ahead * d.microbatch

    # -- dispatch (the controller) ---------------------------------------------------------------

    def _outstanding_rows(self) -> int:
        return sum(1 for mb in self._active for r in mb.requests if r.new_tokens > mb.step)

    def _admit_all(self) -> None:
        while self._waiting and self._outstanding_rows() < self._max_outstanding and self._may_form():
            requests = self._take_microbatch()
            mb = _Microbatch(next(self._mids), requests, max(r.new_tokens for r in requests) - 1)
            self._active.append(mb)
            if self._decoder.role is Role.TOKEN:
                prompt = self.pipelines[0]
                self._enqueue(prompt, prompt.stages[0], mb)
            else:
                self._formed.append(mb)
        self._try_start(self._decoder, self._decoder.stages[0])

    # -- the decoding pipeline's stage 0 (the driver) --------------------------------------------

    def _try_start(self, pipeline: _Pipeline, stage: _Stage) -> None:
        if pipeline is not self._decoder or stage.index > 0:
            super()._try_start(pipeline, stage)
            return
        if stage.busy:
            return
        for _ in range(len(self._runnable)):
            cohort = self._cohorts[self._runnable.popleft()]
            work = self._next_pass(cohort)
            if work is None:
                self._runnable.append(cohort.index)
                continue
            cohort.in_flight = True
            stage.queue.append(work)
            super()._try_start(pipeline, stage)
            return

    def _next_pass(self, cohort: _Cohort) -> _Pass | None:
        """``cohort``'s next pass (a colocated prefill, or a decode step of its members); None: nothing."""
        if self._formed and len(cohort.members) < self._max_members and cohort.rows < self.deployment.cohort_rows:
            mb = self._formed.popleft()
            cohort.members.append(mb)
            return _Pass(cohort, (mb,), prefill=True, number=cohort.passes)
        self._place(cohort)
        if not cohort.members:
            return None
        cohort.passes += 1
        return _Pass(cohort, tuple(cohort.members), prefill=False, number=cohort.passes)

    def _place(self, cohort: _Cohort) -> None:
        """Let prompt-done microbatches join ``cohort`` (at its boundary) while it has room."""
        cap = self.deployment.cohort_rows
        while len(cohort.members) < self._max_members and self._prompted:
            if cohort.members and cohort.rows + self._prompted[0].live > cap:
                return
            lightest = min(c.rows for c in self._cohorts)
            if cohort.rows > lightest and any(not c.in_flight and c is not cohort for c in self._cohorts):
                return  # a lighter cohort at its boundary takes it
            cohort.members.append(self._prompted.popleft())

    # -- stage times and step boundaries ----------------------------------------------------------

    def _duration(self, pipeline: _Pipeline, stage: _Stage, mb) -> float:
        if not isinstance(mb, _Pass):
            return super()._duration(pipeline, stage, mb)  # a prompt on the prompt pipeline
        last = stage.index == len(pipeline.stages) - 1
        if mb.prefill:
            (member,) = mb.members
            return self.cost.prompt_stage_time(stage.layers, member.batch, member.prompt_len, last)
        members = [(m.live, m.prompt_len + m.step) for m in mb.members]
        return self.cost.cohort_step_time(stage.layers, members, last, self.deployment.swap)

    def _step_done(self, pipeline: _Pipeline, mb) -> None:
        if isinstance(mb, _Pass):
            self._returned(mb)
        elif not self._advance(mb):  # a prompt is done: the microbatch waits for a cohort
            self._prompted.append(mb)
        self._admit_all()

    def _returned(self, work: _Pass) -> None:
        """A pass left the last stage: its members advance; finished microbatches leave the cohort."""
        cohort = work.cohort
        cohort.in_flight = False
        for mb in work.members:
            if self._advance(mb):
                cohort.members.remove(mb)
        self._runnable.append(cohort.index)

    def _advance(self, mb: _Microbatch) -> bool:
        """``mb`` did one more step: record first tokens and finishes; True when every row finished."""
        mb.step += 1
        if mb.step == 1:
            for r in mb.requests:
                self._first_token[r.rid] = self.now
        self._finish_requests(r for r in mb.requests if r.new_tokens == mb.step)
        if mb.step <= mb.token_steps:
            return False
        self._active.remove(mb)
        return True
