"""Token stage 0's loop: iteration-level batching of microbatches in D_t cohorts, round-robin.

The token pipeline keeps up to D_t *cohorts* in flight, one per stage, as the paper keeps D_t
microbatches. A cohort is a set of microbatches whose membership changes at its step boundary:
when a cohort's step returns, finished microbatches leave (their caches are released along the
pipeline at once), finished rows of the others stop being computed, and microbatches whose prompt is
done join (disaggregated: announced on the READY
stream; colocated: claimed from the colocated queue and prefilled in the cohort's next pass). Each
member is at its own step; one pass batches every member's active rows, each attending over its own
cache and length. New members go to the cohort with the fewest rows, up to ``cohort_rows`` rows each
(balanced cohorts keep every stage busy); with swapping a cohort holds one microbatch, whose cache is
prefetched while another cohort computes.

An error that leaves :meth:`Driver.run` (Redis refusing a write, back-pressure past its deadline; the
worker pauses and serves the same epoch again) never forgets a microbatch: the driver keeps its cohorts
and waiting line, and the next :meth:`Driver.run` first settles what the error interrupted (see
:meth:`Driver._settle`): the microbatches of a pass the error broke run again from where their token
streams end (as after a recovery), everything else carries on where it was.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import PromptTask
from dejavu_engine.stage_io import StageIO
from dejavu_token_worker.intake import ColocatedQueue
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.runner import (
    STEP_FAILURES,
    PassMember,
    Position,
    PrefillRefused,
    StageRunner,
    history,
    wants_prompt_logprobs,
)
from dejavu_token_worker.traces import MemberTrace
from dejavu_worker.dataplane import Kind, StageMessage, TokenReturn
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.metrics import Occupancy
from dejavu_worker.microbatch import KVStatus, MicrobatchState, fetch_spec
from dejavulib.paged import PagedKVCache, PoolExhausted

log = logging.getLogger("dejavu.token_worker.driver")

# Transport deadlines after which stage 0 takes a pass that is not back for lost, and fails its microbatches.
PASS_DEADLINES = 6


@dataclass
class Member:
    """A microbatch in a cohort: the step it runs next, the tokens it feeds at that step (one per row of
    the microbatch), and its rows still running (``live``: the rows its passes compute)."""

    step: int
    feed: tuple[int, ...]
    live: tuple[int, ...]
    since: float = field(default_factory=time.monotonic, compare=False)  # when it was admitted
    trace: MemberTrace | None = field(default=None, compare=False)  # its requests' spans here, when traced

    @property
    def rows(self) -> int:
        return len(self.live)


@dataclass
class Cohort:
    """One of the D_t batches in flight. ``pass_members`` are the microbatches of the pass in flight
    (``None``: the cohort is at its step boundary)."""

    index: int
    members: dict[int, Member] = field(default_factory=dict)
    pass_members: tuple[int, ...] | None = None
    pass_since: float = 0.0  # when the pass in flight started
    pass_cost: float = 0.0  # how long this stage took to compute and hand it on
    prefilled: bool = False  # its last pass was a colocated prefill

    def begin(self, members: tuple[int, ...]) -> None:
        """A pass of ``members`` starts."""
        self.pass_members, self.pass_since, self.pass_cost = members, time.monotonic(), 0.0

    def handed_on(self) -> None:
        """This stage's part of the pass is done (the later stages' parts take about as long each)."""
        self.pass_cost = time.monotonic() - self.pass_since

    @property
    def streaming(self) -> bool:
        """Whether some member has run a decode step (its rows stream; a member fresh from its prefill
        is at step 1)."""
        return any(m.step > 1 for m in self.members.values())

    @property
    def rows(self) -> int:
        """Rows the cohort's next pass computes."""
        return sum(m.rows for m in self.members.values())

    @property
    def in_flight(self) -> bool:
        return self.pass_members is not None


class Driver:
    def __init__(
        self,
        runner: StageRunner,
        endpoint: DataEndpoint,
        client: redis.Redis,
        worker_id: str,
        pos: Position,
        ready: ReadyPrompts | None,
        deadline_s: float,
        max_running: int = 64,
        release: Callable[[int], None] | None = None,
        epoch: int = 0,
        held: list[PromptTask] | None = None,
        pass_deadline_s: float | None = None,
        max_recomputes: int = 8,
    ) -> None:
        self.runner = runner
        self.max_recomputes = max_recomputes
        self._recomputes: dict[int, int] = {}  # microbatch -> recompute passes so far
        self.epoch = epoch  # the topology epoch this driver serves
        # Colocated tasks queued under a newer epoch than this driver's (a repair's re-runs, claimed in the
        # moment before this worker saw that epoch): kept by the worker across epochs, run at theirs.
        self.queue = ColocatedQueue(client, worker_id, epoch, held if held is not None else [])
        self.release = release or runner.release  # frees a microbatch's cache (and replica) on this stage
        self.endpoint = endpoint
        self.redis = client
        self.worker_id = worker_id
        self.pos = pos
        self.ready = ready
        self.deadline_s = deadline_s
        # A pass not back this long after it started was lost on the way (see :meth:`_expire_passes`).
        self.pass_deadline_s = pass_deadline_s if pass_deadline_s is not None else PASS_DEADLINES * deadline_s
        self._expiry_checked = time.monotonic()
        self.cohorts = [Cohort(i) for i in range(pos.depth)]
        self.cohort_rows = max(1, math.ceil(max_running / pos.depth))
        # With swapping only one microbatch's cache is resident per computing cohort.
        self.max_members = 1 if runner.swap is not None else 1 << 30
        self.runnable: deque[int] = deque(c.index for c in self.cohorts)  # cohorts at their boundary, in turn
        self._waiting: deque[tuple[int, Member]] = deque()  # microbatches not yet in a cohort, in order
        # What an error leaving run() interrupted, settled when run() is called again (_settle):
        self._resuming: dict[int, int] = {}  # resume points not yet re-admitted
        self._unreleased: set[int] = set()  # microbatches freed here whose release is not on its way yet
        self._interrupted: tuple[Cohort, Exception] | None = None  # a cohort whose pass an error broke
        self._returning: TokenReturn | None = None  # a return being applied when an error came

    def occupancy(self) -> Occupancy:
        """Rows and microbatches in the cohorts (running) and in the waiting line. Safe from another thread
        (the metrics scrape): it reads snapshots of the books, taken atomically, and no lock."""
        running = [m for c in self.cohorts for m in list(c.members.values())]
        waiting = [m for _, m in list(self._waiting)]
        return Occupancy(sum(m.rows for m in running), len(running), sum(m.rows for m in waiting), len(waiting))

    # -- membership -----------------------------------------------------------------------------
    def resume(self, points: dict[int, int]) -> None:
        """Re-admit microbatches after recovery, each at the step it resumes from, or earlier: where the
        newest tokens did not reach its stream (the last stage sampled them, replicated that step's KV, and
        died before stage 0 published them), at the step after the newest one there. Every stage holds the
        KV of those steps, and re-executed steps rewrite it identically (the controller drops their
        duplicate tokens). One with no tokens on its stream cannot resume: it is failed if the controller
        still waits for it, and freed along the pipeline, which kept it for this resume. (Seen when it
        finished while the repair was planned: the controller deleted its spec and stream, and every stage
        kept its caches.) A point whose re-admission an error interrupted stays pending until :meth:`run`."""
        self._resuming.update(points)
        self._resume_pending()
        log.info("resumed microbatches %s", {mb: m.step for mb, m in self._waiting})

    def _resume_pending(self) -> None:
        """Re-admit each pending resume point (:meth:`resume`), in order; one stays pending until its
        history is read and, if it cannot resume, its failure published."""
        for mb in sorted(self._resuming):
            member = self._resumed(mb, self._resuming[mb])
            del self._resuming[mb]
            if member is None:
                self._release_everywhere(mb)
            else:
                self._waiting.append((mb, member))

    def _resumed(self, mb: int, step: int) -> Member | None:
        """``mb`` as it resumes at ``step`` (or earlier: see :meth:`resume`); None when it cannot resume
        (failed to its clients here, if the controller still waits for it) or has no row left to run."""
        entries = history(self.redis, mb, before_step=step)
        if entries and entries[-1].step < step - 1:
            log.warning("microbatch %d: tokens of steps %d..%d are not on its stream: resuming at step %d",
                        mb, entries[-1].step + 1, step - 1, entries[-1].step + 1)  # fmt: skip
            step = entries[-1].step + 1
        if not entries or entries[-1].step != step - 1:
            if self.redis.exists(keys.microbatch(mb)):  # the controller still waits for it: fail it
                error = RuntimeError(f"no tokens of step {step - 1} for microbatch {mb}: cannot resume it")
                self.runner.fail(mb, step, error)
            else:  # ended (its spec and stream are gone): nothing to fail, only caches to free
                log.info("microbatch %d ended while its resume was planned: freeing it", mb)
            return None
        n_rows = len(entries[-1].tokens)
        live = tuple(r for r in range(n_rows) if all(e.finished[r] is None for e in entries))
        return Member(step, tuple(self._latest_tokens(entries)), live) if live else None

    @staticmethod
    def _latest_tokens(entries) -> list[int]:
        """Per row, the token to feed next: its newest emitted token (finished rows: any)."""
        out = [0] * len(entries[-1].tokens)
        for e in entries:
            for r, t in enumerate(e.tokens):
                if t >= 0:
                    out[r] = t
        return out

    def _place(self, cohort: Cohort) -> None:
        """Let waiting and newly ready microbatches join ``cohort`` (at its boundary), in order, up to its
        fair share of every row in the pipeline (balanced cohorts keep every stage equally busy) and at
        most ``cohort_rows``. An empty cohort always takes the next one.

        Only a microbatch whose KV is all here joins; one still receiving it keeps its place in the line
        without holding up the others, since nothing waits for it here (this loop runs every cohort of
        the stage). One whose KV is still incomplete ``deadline_s`` after it was admitted fails."""
        while self._poll_ready():
            pass
        self._expire_incomplete()
        total = sum(c.rows for c in self.cohorts) + sum(m.rows for _, m in self._waiting)
        share = min(self.cohort_rows, math.ceil(total / len(self.cohorts)))
        while len(cohort.members) < self.max_members:
            index = next((i for i, (mb, _) in enumerate(self._waiting) if self._arrived(mb)), None)
            if index is None:
                return
            mb, member = self._waiting[index]
            if cohort.members and cohort.rows + member.rows > share:
                return
            if not self._room_for(mb, member):
                return  # a paged pool without room for it yet: it waits in its place in the line
            del self._waiting[index]
            self._join(cohort, mb, member)

    def _arrived(self, mb: int) -> bool:
        """Whether ``mb``'s KV is complete on this stage (prompt KV, a prefill or a restore)."""
        state = self.runner.states.get(mb)
        return state is not None and state.complete.is_set()

    def _expire_incomplete(self) -> None:
        """Fail waiting microbatches whose KV is still incomplete ``deadline_s`` after their admission."""
        now = time.monotonic()
        for mb, member in [(mb, m) for mb, m in self._waiting if now - m.since > self.deadline_s]:
            if self._arrived(mb):
                continue
            state = self.runner.states.get(mb)
            got = f"{len(state.cells)}/{state.expected_cells} cells" if state is not None else "none of it"
            error = DeadlineExceeded(f"prompt KV of microbatch {mb} incomplete after {self.deadline_s} s ({got})")
            self.runner.fail(mb, member.step, error)  # first: an error here leaves it waiting, to fail again
            self._waiting.remove((mb, member))
            self._release_everywhere(mb)

    def _room_for(self, mb: int, member: Member) -> bool:
        """Whether this stage's paged pool can take ``mb``'s next step (always without a pool, and for a
        microbatch whose KV is still arriving: its blocks are taken as it arrives)."""
        pool = self.runner.pool
        state = self.runner.states.get(mb)
        if pool is None or state is None or not state.complete.is_set():
            return True
        running, need = self._running_need()
        need += self.runner.blocks_to_run(state, member.step)
        return need <= pool.free_blocks + self.runner.evictable_blocks(set(running) | {mb})

    def _running_need(self) -> tuple[dict[int, Member], int]:
        """The members of every cohort, and the blocks their next steps take (they come first)."""
        running = {mb: member for c in self.cohorts for mb, member in c.members.items()}
        need = 0
        for mb, member in running.items():
            state = self.runner.states.get(mb)
            if state is not None and state.complete.is_set():
                need += self.runner.blocks_to_run(state, member.step)
        return running, need

    def _fit_pool(self, cohort: Cohort, states: dict[int, MicrobatchState]) -> None:
        """Preemption at stage 0 of a paged pool: when the pass's members cannot all take the blocks their
        step writes (free blocks plus those of microbatches outside the pass, which stages move to host
        memory), the latest to join leave the cohort for the head of the waiting line until they can. Their
        caches stay until room is needed; they rejoin (first in line) once the pool has room for them."""
        pool = self.runner.pool
        if pool is None or len(states) < 2:
            return
        order = list(states)
        need = {mb: self.runner.blocks_to_run(states[mb], cohort.members[mb].step) for mb in order}
        room = pool.free_blocks + self.runner.evictable_blocks(set(order))
        while len(order) > 1 and sum(need[mb] for mb in order) > room:
            mb = order.pop()
            held = states.pop(mb).cache
            room += held.blocks_held if isinstance(held, PagedKVCache) else 0
            self._waiting.appendleft((mb, cohort.members.pop(mb)))
            log.info("KV pool short: microbatch %d leaves cohort %d until there is room", mb, cohort.index)

    def _poll_ready(self) -> bool:
        """Move one newly ready microbatch to the waiting line; False when there is none. Microbatches
        announced after they ended are freed along the pipeline (their prompt KV may be here already)."""
        if self.pos.colocated or self.ready is None:
            return False
        ready = self.ready.pop()
        while self.ready.ended:
            self._release_everywhere(self.ready.ended.popleft())
        if ready is None:
            return False
        if ready.all_finished:
            self._release_everywhere(ready.spec.mb_id)
            return True
        live = tuple(r for r, finished in enumerate(ready.finished) if finished is None)
        self._waiting.append((ready.spec.mb_id, Member(1, ready.first_tokens, live)))
        return True

    # -- the loop ------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()``. An error it does not handle (see the module docstring) leaves with the
        driver's books in order for the next call, which settles what the error interrupted first."""
        self._settle()
        while not stop():
            started = False
            for _ in range(len(self.runnable)):  # each cohort at its boundary, in turn
                cohort = self.cohorts[self.runnable.popleft()]
                with self._interrupting(cohort):
                    if self._start_pass(cohort):
                        started = True
                    else:
                        self.runnable.append(cohort.index)
            if self.pos.depth == 1:
                if not started and not self.pos.colocated and self.ready is not None:
                    self.ready.poll(block_ms=5)  # nothing to run: wait briefly for a prompt to be done
                continue
            payload = self.endpoint.recv(Channel.TOKENS, timeout_s=0.0 if started else 0.005)
            if payload is not None:
                try:
                    returned = TokenReturn.decode(payload)
                except ValueError as exc:  # authenticated, yet not a token return of this version
                    log.error("dropped a malformed token return: %s", exc)
                else:
                    self._returning = returned  # applied again by _settle if an error interrupts it
                    self._returned(returned)
                    self._returning = None
            if time.monotonic() - self._expiry_checked > 1.0:
                self._expiry_checked = time.monotonic()
                self._expire_passes()

    @contextlib.contextmanager
    def _interrupting(self, cohort: Cohort, failing: Exception | None = None) -> Iterator[None]:
        """Work on ``cohort``; an error leaving it marks the cohort for :meth:`_settle`, which fails a pass
        still in flight with ``failing`` (the pass's own error, when failing it was interrupted) or the error."""
        try:
            yield
        except Exception as exc:
            self._interrupted = (cohort, failing or exc)
            raise

    def _settle(self) -> None:
        """Put right what an error leaving :meth:`run` interrupted, before serving on (nothing to do on
        the first call): microbatches waiting to resume (after a recovery, or from a pass the runner broke:
        :meth:`_run_again`) join the waiting line; releases not yet sent to the later stages are sent; a
        token return half applied is applied (applying one is idempotent); a cohort whose failing an error
        interrupted (its pass lost: :meth:`_expire_passes`) fails the rest of its pass; and every cohort at
        its boundary is runnable again. What raises again here leaves the rest for the next call: no
        microbatch is forgotten."""
        self._resume_pending()
        for mb in sorted(self._unreleased):
            self._release_everywhere(mb)
        if self._returning is not None:
            self._returned(self._returning)
            self._returning = None
        if self._interrupted is not None:
            cohort, error = self._interrupted
            if cohort.in_flight:
                log.error("failing the rest of the pass of cohort %d (microbatches %s): %r",
                          cohort.index, list(cohort.pass_members or ()), error)  # fmt: skip
                self._fail_pass(cohort, error)
            self._interrupted = None
        for cohort in self.cohorts:
            if not cohort.in_flight and cohort.index not in self.runnable:
                self.runnable.append(cohort.index)

    def _expire_passes(self) -> None:
        """Fail the microbatches of a pass still not back long after it started: ``pass_deadline_s``, or
        4 times what the whole pipeline should take at this stage's pace, whichever is longer (a large
        model's long prefill is not lost). Every stage is alive (a dead one changes the epoch, and the
        repair takes over), so the data plane lost the pass on the way: its requests get an error instead
        of waiting for ever, and the cohort serves others again. A return that still comes is ignored
        (its microbatches left the cohort)."""
        now = time.monotonic()
        for cohort in self.cohorts:
            limit = max(self.pass_deadline_s, 4 * self.pos.depth * cohort.pass_cost)
            if cohort.pass_members is None or now - cohort.pass_since <= limit:
                continue
            log.error("the pass of cohort %d (microbatches %s) is not back after %.0f s: failing its microbatches",
                      cohort.index, list(cohort.pass_members), now - cohort.pass_since)  # fmt: skip
            lost = DeadlineExceeded(f"no tokens back from the token pipeline within {limit:.0f} s")
            with self._interrupting(cohort, failing=lost):
                self._fail_pass(cohort, lost)

    @property
    def mixes(self) -> bool:
        """Whether colocated prefills run in the same pass as the cohort's decode step (a one-stage pipeline
        whose runner mixes: :meth:`StageRunner.run_mixed`)."""
        return self.pos.colocated and self.pos.depth == 1 and self.runner.mixes

    def _start_pass(self, cohort: Cohort) -> bool:
        """Start ``cohort``'s next pass (a colocated prefill, one decode step of every member, or both at
        once). Returns False when it has nothing to run.

        Colocated, a prompt waiting is prefilled next. Where passes mix (:attr:`mixes`), the members decode
        in the same pass, so streaming rows get a token from every pass. Otherwise, while some member's rows
        stream, never twice in a row: arrivals delay streaming rows one prefill at a time, not a whole
        queue's worth; prompts that arrive together when nothing streams yet are prefilled back to back,
        then decode together."""
        self._place(cohort)
        task = None
        if (
            self.pos.colocated
            and len(cohort.members) < self.max_members
            and cohort.rows < self.cohort_rows
            and (self.mixes or not (cohort.prefilled and cohort.streaming))
        ):
            task = self.queue.claim(block=not any(c.members or c.in_flight for c in self.cohorts))
        try:
            return self._run_pass(cohort, task)
        except Exception:
            if cohort.in_flight:
                self._run_again(cohort, task)
            joined = task is not None and any(p.mb_id in c.members for p in task.pieces for c in self.cohorts)
            if task is not None and not joined:
                self.queue.put_back(task)  # claimed, not begun (or begun and broken): prefilled again
            raise

    def _run_again(self, cohort: Cohort, task: PromptTask | None) -> None:
        """The pass of ``cohort`` broke on this stage: the runner raised (Redis refused its tokens, a send
        found no room), so the pass did not leave this stage, or its tokens were not all published. Its
        members leave the cohort and run again where their token streams end, as after a recovery
        (:meth:`resume`): each at the step after the newest one on its stream, fed the tokens there (a step
        published before the error runs no second time; one that was not runs again, and rewrites the same
        KV), sampling from trackers rebuilt from the stream. A colocated prefill's microbatch (``task``'s,
        at step 0) leaves too; its task is prefilled again."""
        prefilling = {p.mb_id for p in task.pieces} if task is not None else set()
        for mb in cohort.pass_members or ():
            member = cohort.members.pop(mb, None)
            if member is None:
                continue
            state = self.runner.states.get(mb)
            if state is not None:
                state.tracker = None
            if not (member.step == 0 and mb in prefilling):
                self._resuming[mb] = member.step + 1
        log.warning("the pass of cohort %d broke here: microbatches %s run again from their token streams",
                    cohort.index, list(cohort.pass_members or ()))  # fmt: skip
        cohort.pass_members = None

    def _run_pass(self, cohort: Cohort, task: PromptTask | None) -> bool:
        """The rest of :meth:`_start_pass`, with ``task`` the colocated task claimed for this pass, if any."""
        if task is not None:
            if not self._room_for_prompt(task):
                task = None  # held until running requests return blocks (or failed: it can never fit)
            if task is not None and not (self.mixes and cohort.members):
                cohort.prefilled = True
                self._prefill(cohort, task)
                return True
        cohort.prefilled = False
        if not cohort.members:
            return False
        states = self._runnable_states(cohort)
        if not states:  # every member failed and left
            if task is not None:
                self._prefill(cohort, task)
            else:
                self.runnable.append(cohort.index)
            return True
        self._fit_pool(cohort, states)
        discarded = None  # only a paged pool's caches are ever discarded
        if self.runner.pool is not None:
            discarded = next((st for st in states.values() if st.status is KVStatus.DISCARDED), None)
        if discarded is not None:  # forgotten to make room: it is recomputed before it decodes again
            if task is not None:
                self.queue.put_back(task)  # claimed for a mixed pass: the next pass takes it
            self._recompute(cohort, discarded)
            return True
        members = [PassMember(states[mb], cohort.members[mb].step, cohort.members[mb].live) for mb in states]
        ids = torch.tensor([[cohort.members[mb].feed[r]] for mb in states for r in cohort.members[mb].live])
        if task is not None and self._mixed(cohort, members, ids, task):
            return True
        cohort.begin(tuple(states))
        try:
            ret = self.runner.run(
                self.pos, members, Kind.DECODE, StageIO(input_ids=ids), cohort.index, self._guess_next(cohort)
            )
        except STEP_FAILURES as exc:
            self._fail_pass(cohort, exc)
            return True
        cohort.handed_on()
        if ret is not None:  # a one-stage pipeline: the tokens are here already
            self._returned(ret)
        return True

    def _runnable_states(self, cohort: Cohort) -> dict[int, MicrobatchState]:
        """Members whose caches are ready (prompt KV complete); a member whose KV never completes, or
        whose spec is gone, is failed here and leaves."""
        states: dict[int, MicrobatchState] = {}
        for mb in list(cohort.members):
            try:
                state = self.runner.state(mb)
                state.wait_complete(self.deadline_s)
                self.runner.replicate_prompt(state)
            except STEP_FAILURES as exc:
                self._fail(cohort, mb, exc)
                continue
            states[mb] = state
        return states

    def _guess_next(self, current: Cohort) -> int | None:
        """The microbatch likely to run after this pass: the next cohort's first member. Stages use it
        to prefetch swapped-out caches."""
        for index in self.runnable:
            cohort = self.cohorts[index]
            if cohort is not current and cohort.members:
                return next(iter(cohort.members))
        return None

    # -- colocated prefill -----------------------------------------------------------------------
    def _prompt_state(self, task: PromptTask) -> MicrobatchState | None:
        """The clean state of ``task``'s microbatch, about to be prefilled (None: it is gone, a stale entry,
        or the task is not one whole microbatch, whose requests then fail)."""
        if len(task.pieces) != 1:  # a colocated task carries one whole token microbatch
            self._refuse(task)
            return None
        (piece,) = task.pieces
        self.runner.release(piece.mb_id, finished=False)  # a re-run prompt starts from a clean cache
        try:
            state = self.runner.state(piece.mb_id)
        except DeadlineExceeded as exc:
            log.error("dropped a colocated task: %s", exc)
            return None
        if piece.dst_rows != (0, len(state.spec.rows)):
            self._refuse(task)
            return None
        state.mark_complete(0)
        return state

    def _room_for_prompt(self, task: PromptTask) -> bool:
        """Admission by free blocks, colocated: whether the pool can take ``task``'s prompt now, after the
        next step of every running member (a prompt waits for blocks; it never preempts a running request).
        One that does not fit is held, and claimed again at a later pass; one that cannot fit even with
        nothing else running (every other cache moved out) fails, since nothing would ever make room."""
        pool = self.runner.pool
        if pool is None or len(task.pieces) != 1:
            return True  # no blocks to count; a task that is not one whole microbatch is refused later
        mb_id = task.pieces[0].mb_id
        try:
            spec = fetch_spec(self.redis, mb_id, 0.0)
        except DeadlineExceeded:  # the spec is written before the task is queued: the microbatch ended
            log.info("dropped colocated task %d: microbatch %d is gone", task.task_id, mb_id)
            return False
        g = pool.geometry
        running, need = self._running_need()
        need += sum(max(0, g.blocks(spec.prompt_len) - g.first_block(pad)) for pad in spec.pad_lens)
        if need <= pool.free_blocks + self.runner.evictable_blocks(set(running)):
            return True
        if running:
            self.queue.put_back(task)
            return False
        error = PoolExhausted(
            f"the prompt of microbatch {mb_id} needs {need} KV blocks; the pool holds {pool.max_blocks}"
        )
        self.runner.fail(mb_id, 0, error)
        self._release_everywhere(mb_id)
        return False

    def _refuse(self, task: PromptTask) -> None:
        """Fail the microbatches of a colocated task that is not one whole token microbatch: none of them
        can be prefilled from it (and the process must not die of it, or every replacement would too)."""
        error = ValueError(f"colocated task {task.task_id} is not one whole microbatch: {list(task.pieces)}")
        log.error("refused %s", error)
        for mb_id in dict.fromkeys(p.mb_id for p in task.pieces):
            self.runner.fail(mb_id, 0, error)
            self._release_everywhere(mb_id)

    @staticmethod
    def _prompt_ids(state: MicrobatchState) -> torch.Tensor:
        """The microbatch's prompts, left padded to its prompt length."""
        spec = state.spec
        ids = torch.zeros((len(spec.rows), spec.prompt_len), dtype=torch.long)
        for r, row in enumerate(spec.rows):
            ids[r, spec.prompt_len - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
        return ids

    def _mixed(self, cohort: Cohort, members: list[PassMember], ids: torch.Tensor, task: PromptTask) -> bool:
        """The cohort's next pass decodes ``members`` and prefills ``task``'s microbatch, which then joins the
        cohort. False when nothing ran (the task was stale, or its prompt could not have its blocks and
        failed alone): the caller runs the decode step by itself. A microbatch with a row that asks for its
        prompt's log probabilities is prefilled in a pass of its own instead (the members skip that pass)."""
        state = self._prompt_state(task)
        if state is None:
            return False
        every_row = tuple(range(len(state.spec.rows)))
        self._join(cohort, state.mb_id, Member(0, (), every_row))
        if wants_prompt_logprobs(state.spec):  # its prompt's logits at every position: a prefill pass of its own
            self._prefill_pass(cohort, PassMember(state, 0, every_row), lambda: self._prompt_ids(state))
            return True
        cohort.begin((*(m.state.mb_id for m in members), state.mb_id))
        try:
            ret = self.runner.run_mixed(
                self.pos,
                members,
                StageIO(input_ids=ids),
                PassMember(state, 0, every_row),
                StageIO(input_ids=self._prompt_ids(state)),
                cohort.index,
            )
        except PrefillRefused as exc:
            cohort.pass_members = None
            self._fail(cohort, exc.mb_id, exc.error)
            return False
        except STEP_FAILURES as exc:
            self._fail_pass(cohort, exc)
            return True
        cohort.handed_on()
        self._returned(ret)
        return True

    def _prefill(self, cohort: Cohort, task: PromptTask) -> None:
        """The cohort's next pass prefills ``task``'s microbatch (its other members skip this pass)."""
        state = self._prompt_state(task)
        if state is None:
            self.runnable.append(cohort.index)
            return
        every_row = tuple(range(len(state.spec.rows)))
        self._join(cohort, state.mb_id, Member(0, (), every_row))
        self._prefill_pass(cohort, PassMember(state, 0, every_row), lambda: self._prompt_ids(state))

    def _prefill_pass(self, cohort: Cohort, member: PassMember, ids: Callable[[], torch.Tensor]) -> None:
        """Run ``member`` alone in a PREFILL pass of ``cohort`` over the tokens ``ids()`` gives; a failure
        (there, or in the pass) fails that microbatch only."""
        cohort.begin((member.state.mb_id,))
        try:
            ret = self.runner.run(self.pos, [member], Kind.PREFILL, StageIO(input_ids=ids()), cohort.index)
        except STEP_FAILURES as exc:
            self._fail_pass(cohort, exc)
            return
        cohort.handed_on()
        if ret is not None:
            self._returned(ret)

    # -- recompute -------------------------------------------------------------------------------
    def _recompute(self, cohort: Cohort, state: MicrobatchState) -> None:
        """The cohort's next pass recomputes ``state``'s microbatch, whose KV this stage discarded to make
        room (its other members skip this pass): one PREFILL pass, through every stage, of its prompt and
        the tokens of every step before the one it is at, which produces that step's tokens."""
        member = cohort.members[state.mb_id]
        count = self._recomputes.get(state.mb_id, 0) + 1
        if count > self.max_recomputes:
            self._fail(
                cohort,
                state.mb_id,
                RuntimeError(
                    f"microbatch {state.mb_id} had its KV discarded for room {count} times (engine.max_recomputes "
                    f"{self.max_recomputes}): the KV pool is too small for the work admitted"
                ),
            )
            self.runnable.append(cohort.index)
            return
        self._recomputes[state.mb_id] = count
        log.info("recomputing microbatch %d: its prompt and %d steps in one pass", state.mb_id, member.step)
        if member.trace is not None:
            member.trace.event("recompute")
        self._prefill_pass(
            cohort, PassMember(state, member.step, member.live), lambda: self._recompute_ids(state, member.step)
        )

    def _recompute_later(self, cohort: Cohort, mb_id: int) -> None:
        """A later stage discarded ``mb_id``'s KV to make room and left it out of the step: this stage
        forgets its own too, so the member's next pass recomputes it at the same step (:meth:`_recompute`)."""
        state = self.runner.states.get(mb_id)
        if state is not None:
            state.discard()
        if state is None or state.status is not KVStatus.DISCARDED:  # nothing here can recompute it
            self._fail(cohort, mb_id, RuntimeError(f"microbatch {mb_id} was discarded by a later stage"))
            return
        log.info("microbatch %d was discarded by a later stage: recomputing it", mb_id)

    def _recompute_ids(self, state: MicrobatchState, step: int) -> torch.Tensor:
        """Positions ``[0, prompt_len + step)`` of every row: the left-padded prompt, then the token each
        step before ``step`` emitted (from its token stream; a finished row's later positions are 0: it is
        not sampled, and its blocks are gone). Raises ValueError when the stream lacks a step."""
        entries = history(self.redis, state.mb_id, before_step=step)
        if [e.step for e in entries] != list(range(step)):
            raise ValueError(f"microbatch {state.mb_id}: its stream lacks tokens before step {step}: cannot recompute")
        prompt = self._prompt_ids(state)
        generated = torch.tensor([[max(t, 0) for t in e.tokens] for e in entries], dtype=torch.long).T
        return torch.cat((prompt, generated.reshape(prompt.shape[0], step)), dim=1)

    # -- returns ---------------------------------------------------------------------------------
    def _returned(self, ret: TokenReturn) -> None:
        if ret.cohort < 0:  # members a later stage failed on their own
            for r in ret.members:
                for cohort in self.cohorts:
                    if r.mb_id in cohort.members and cohort.members[r.mb_id].step == r.step:
                        self._leave(cohort, r.mb_id)
            return
        if not 0 <= ret.cohort < len(self.cohorts):
            return
        cohort = self.cohorts[ret.cohort]
        if not cohort.in_flight:
            return  # a stale return (a re-executed step after recovery)
        if {r.mb_id for r in ret.members} - set(cohort.pass_members or ()):
            return  # not this pass's return
        for r in ret.members:
            member = cohort.members.get(r.mb_id)
            if member is None or member.step != r.step:
                continue
            if r.recompute:  # a later stage had discarded its KV: the step did not run
                self._recompute_later(cohort, r.mb_id)
            elif r.done:
                self._leave(cohort, r.mb_id)
            else:
                member.step, member.feed = r.step + 1, r.tokens
                if r.live:  # finished rows are no longer computed
                    member.live = r.live
                if member.trace is not None:
                    member.trace.stepped(member.step, member.live)
        cohort.pass_members = None
        self.runnable.append(cohort.index)

    def _fail_pass(self, cohort: Cohort, error: Exception) -> None:
        """``cohort``'s pass failed as a whole: each of its microbatches still in the cohort fails (one a
        later stage failed meanwhile is gone already), and the cohort is at its boundary again."""
        for mb in cohort.pass_members or ():
            if mb in cohort.members:
                self._fail(cohort, mb, error)  # an error here leaves the rest in flight, failed by _settle
        cohort.pass_members = None
        self.runnable.append(cohort.index)

    def _fail(self, cohort: Cohort, mb_id: int, error: Exception) -> None:
        """One microbatch failed: fail its requests, free it everywhere, serve the others."""
        member = cohort.members.get(mb_id)
        self.runner.fail(mb_id, member.step if member is not None else 0, error)
        if member is not None and member.trace is not None:
            member.trace.left(member.step, error)
        self._leave(cohort, mb_id)

    def _join(self, cohort: Cohort, mb_id: int, member: Member) -> None:
        """``mb_id`` joins ``cohort`` (its spans start, when its requests are traced)."""
        cohort.members[mb_id] = member
        state = self.runner.states.get(mb_id)
        if member.trace is None and state is not None:
            member.trace = MemberTrace.start(state.spec, member.step, member.live, self.epoch)

    def end_traces(self) -> None:
        """This driver's epoch is over: the spans of its members end (a resumed member opens new ones)."""
        members = [m for c in self.cohorts for m in c.members.values()] + [m for _, m in self._waiting]
        for member in members:  # a member back in line (preempted) keeps its spans too
            if member.trace is not None:
                member.trace.left(member.step)
                member.trace = None

    def _leave(self, cohort: Cohort, mb_id: int) -> None:
        member = cohort.members.pop(mb_id, None)
        if member is not None and member.trace is not None:
            member.trace.left(member.step)
        self._recomputes.pop(mb_id, None)
        self._release_everywhere(mb_id)

    def _release_everywhere(self, mb_id: int) -> None:
        self.release(mb_id)
        if self.pos.next_peer is not None:
            self._unreleased.add(mb_id)  # until the release is on its way (sent again by _settle)
            self.endpoint.send(self.pos.next_peer, Channel.ACTIVATION, StageMessage(Kind.RELEASE, mb_id, 0).encode())
            self._unreleased.discard(mb_id)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) unless it exists."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
