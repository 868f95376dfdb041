"""Token stage 0's cohorts as pure logic: a scripted runner, endpoint and ready queue stand in for the
engine, the data plane and Redis, so joins, leaves, balance, row caps and failures are checked in
milliseconds."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_token_worker.driver import Driver
from dejavu_token_worker.ready import ReadyMicrobatch
from dejavu_token_worker.runner import Position, PrefillRefused
from dejavu_worker.dataplane import Kind, Returned, StageMessage, TokenReturn
from dejavu_worker.endpoint import Channel
from dejavulib.paged import PoolExhausted


def _spec(mb: int, rows: int) -> MicrobatchSpec:
    row = RowSpec(request_id=f"r{mb}", prompt_ids=(1, 2), sampling=SamplingSpec(max_tokens=50, seed=0))
    return MicrobatchSpec(mb_id=mb, rows=(row,) * rows, prompt_len=2, max_len=52)


@dataclass
class State:
    """A microbatch's state on the stage: its KV is complete unless ``broken`` (it never completes)."""

    spec: MicrobatchSpec
    broken: bool = False
    cells: tuple[()] = ()
    expected_cells: int = 1

    @property
    def mb_id(self) -> int:
        return self.spec.mb_id

    def __post_init__(self) -> None:
        self.complete = threading.Event()
        if not self.broken:
            self.complete.set()

    def wait_complete(self, deadline_s: float) -> None:
        if not self.complete.wait(deadline_s):
            raise DeadlineExceeded(f"prompt KV of microbatch {self.spec.mb_id} incomplete")

    def mark_complete(self, cells: int) -> None:  # a colocated prefill wrote all of it
        self.complete.set()


@dataclass
class Pipeline:
    """The runner, the endpoint and the later stages at once: a pass's tokens come back as the last
    stage would return them; microbatch ``mb`` finishes when its step reaches ``finish[mb]``."""

    depth: int
    finish: dict[int, int]
    specs: dict[int, MicrobatchSpec]
    broken: set[int] = field(default_factory=set)
    row_finish: dict[int, dict[int, int]] = field(default_factory=dict)  # mb -> row -> its last step
    computed: list[dict[int, tuple[int, ...]]] = field(default_factory=list)  # per pass: mb -> rows computed
    swap: None = None
    pool: None = None  # contiguous caches: no paged pool to fit passes into
    mixes: bool = False  # prefills and decode steps in separate passes
    states: dict[int, State] = field(default_factory=dict)
    passes: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    returns: deque[bytes] = field(default_factory=deque)
    lose: set[tuple[int, int]] = field(default_factory=set)  # (mb, step) whose pass never comes back...
    lost: list[bytes] = field(default_factory=list)  # ...until its microbatch failed: then it does, late

    # runner
    def state(self, mb: int) -> State:
        return self.states.setdefault(mb, State(self.specs[mb], mb in self.broken))

    def replicate_prompt(self, state: State) -> None:
        pass

    def run(self, pos, members, kind, io, cohort=-1, next_mb=None):
        assert kind is Kind.DECODE and io.input_ids.shape[0] == sum(len(m.rows) for m in members)
        steps = tuple((m.state.spec.mb_id, m.step) for m in members)
        self.passes.append((cohort, steps))
        self.computed.append({m.state.spec.mb_id: m.rows for m in members})
        returned = []
        for mb, step in steps:
            n = len(self.specs[mb].rows)
            last = self.row_finish.get(mb, {})
            live = tuple(r for r in range(n) if step < last.get(r, self.finish[mb]))
            returned.append(Returned(mb, step, (step,) * n, not live, live))
        ret = TokenReturn(cohort, tuple(returned))
        if pos.depth == 1:
            return ret
        (self.lost if set(steps) & self.lose else self.returns).append(ret.encode())
        return None

    def release(self, mb: int) -> None:
        self.states.pop(mb, None)
        self.released.append(mb)

    def fail(self, mb: int, step: int, error: Exception) -> None:
        self.failed.append(mb)
        self.errors.append(error)
        self.returns.extend(self.lost)
        self.lost.clear()

    # endpoint
    def send(self, peer: str, channel: Channel, payload: bytes) -> None:
        assert channel is Channel.ACTIVATION and StageMessage.decode(payload).kind is Kind.RELEASE

    def recv(self, channel: Channel, timeout_s: float) -> bytes | None:
        if not self.returns:
            time.sleep(timeout_s)  # as a real endpoint waits for a message that does not come
            return None
        return self.returns.popleft()


class Ready:
    """Microbatches whose prompts are done, each becoming ready after ``at`` passes."""

    def __init__(self, pipeline: Pipeline, schedule: list[tuple[int, int]]) -> None:
        self.pipeline = pipeline
        self.schedule = deque(sorted(schedule, key=lambda x: x[1]))
        self.ended: deque[int] = deque()  # none here ends before its announcement

    def pop(self, block_ms=None):
        if self.schedule and self.schedule[0][1] <= len(self.pipeline.passes):
            mb, _ = self.schedule.popleft()
            self.pipeline.state(mb)  # its prompt KV arrived (or, broken, started to and never completes)
            spec = self.pipeline.specs[mb]
            return ReadyMicrobatch(spec, (7,) * len(spec.rows), (None,) * len(spec.rows))
        return None

    def poll(self, block_ms=None) -> None:
        if block_ms:  # as Redis's XREAD BLOCK does when nothing comes
            time.sleep(block_ms / 1000)


def _drive(depth: int, rows: dict[int, int], finish: dict[int, int], ready_at: dict[int, int], **kw) -> Pipeline:
    pipeline = Pipeline(
        depth, finish, {mb: _spec(mb, n) for mb, n in rows.items()}, kw.pop("broken", set()), kw.pop("row_finish", {})
    )
    pipeline.lose = kw.pop("lose", set())
    pos = Position(0, depth, "t1" if depth > 1 else None, "t0", colocated=False)
    ready = Ready(pipeline, list(ready_at.items()))
    deadline_s = kw.pop("deadline_s", 1.0)
    driver = Driver(pipeline, pipeline, None, "t0", pos, ready, deadline_s, **kw)  # type: ignore[arg-type]
    rounds = iter(range(10_000))
    driver.run(lambda: set(pipeline.released) >= set(rows) or next(rounds) >= 9_999)
    assert set(pipeline.released) == set(rows), "every microbatch leaves and is released"
    return pipeline


def test_a_microbatch_joins_a_running_cohort_at_its_next_step_and_leaves_when_done() -> None:
    p = _drive(depth=1, rows={1: 2, 2: 3}, finish={1: 5, 2: 3}, ready_at={1: 0, 2: 2})
    members = [dict(steps) for _, steps in p.passes]
    assert members[:2] == [{1: 1}, {1: 2}]  # alone at first
    assert members[2] == {1: 3, 2: 1}  # microbatch 2 joins at the next boundary, at its own step 1
    assert members[4] == {1: 5, 2: 3}  # both finish in this pass...
    assert len(members) == 5  # ...and nothing runs after they left
    assert p.released == [1, 2]


def test_cohorts_are_balanced_and_capped_in_rows() -> None:
    rows = {mb: 2 for mb in range(1, 7)}
    p = _drive(depth=2, rows=rows, finish=dict.fromkeys(rows, 4), ready_at=dict.fromkeys(rows, 0), max_running=8)
    for _, steps in p.passes:
        assert sum(rows[mb] for mb, _ in steps) <= 4  # ceil(8 / 2) rows per cohort
    first = {c: {mb for mb, _ in steps} for c, steps in p.passes[:2]}
    assert first == {0: {1, 2}, 1: {3, 4}}  # each cohort takes its share of the waiting rows
    later = {mb for _, steps in p.passes for mb, _ in steps}
    assert later == set(rows)  # 5 and 6 join as the first ones leave


def test_a_member_whose_prompt_kv_never_completes_is_failed_alone_without_holding_up_the_others() -> None:
    """It waits in line without joining a pass (the stage waits for nothing: chaos saw one stale
    announcement hold every microbatch of stage 0 for the 10 s deadline), and fails at its deadline."""
    deadline_s = 0.3
    started = time.monotonic()
    p = _drive(
        depth=1, rows={1: 1, 2: 1}, finish={1: 3, 2: 3}, ready_at={1: 0, 2: 0}, broken={2}, deadline_s=deadline_s
    )
    assert p.failed == [2] and set(p.released) == {1, 2}
    assert all(dict(steps).keys() == {1} for _, steps in p.passes)
    assert [dict(steps)[1] for _, steps in p.passes] == [1, 2, 3]
    assert time.monotonic() - started >= deadline_s  # failed at its deadline, not before


def test_a_pass_that_never_comes_back_fails_its_microbatches_at_its_deadline_and_the_others_go_on() -> None:
    """Every stage is alive but the pass of microbatch 2 at step 2 is lost on the way: past the pass deadline
    its requests get an error instead of waiting for ever, its cohort serves again, microbatch 1 finishes,
    and the lost return, when it does come, changes nothing."""
    started = time.monotonic()
    rows = {1: 1, 2: 1, 3: 1}
    p = _drive(
        depth=2, rows=rows, finish=dict.fromkeys(rows, 4), ready_at={1: 0, 2: 0, 3: 6}, lose={(2, 2)},
        pass_deadline_s=0.3,
    )  # fmt: skip
    assert p.failed == [2] and isinstance(p.errors[0], DeadlineExceeded)
    assert time.monotonic() - started >= 0.3
    steps = [dict(s) for _, s in p.passes]
    assert [s[1] for s in steps if 1 in s] == [1, 2, 3, 4]  # microbatch 1 went on meanwhile
    assert [s[2] for s in steps if 2 in s] == [1, 2]  # 2 ran no step after the lost one
    assert [s[3] for s in steps if 3 in s] == [1, 2, 3, 4]  # and its cohort served 3 after it


def test_a_member_whose_prompt_kv_completes_late_joins_then() -> None:
    p = Pipeline(1, {1: 3, 2: 3}, {1: _spec(1, 1), 2: _spec(2, 1)}, broken={2})
    pos = Position(0, 1, None, "t0", colocated=False)
    driver = Driver(p, p, None, "t0", pos, Ready(p, [(1, 0), (2, 0)]), 30.0)  # type: ignore[arg-type]

    def stop() -> bool:
        if len(p.passes) == 2:
            p.states[2].complete.set()  # the rest of its prompt KV arrives
        return set(p.released) >= {1, 2} or len(p.passes) > 20

    driver.run(stop)
    assert p.failed == [] and p.released == [1, 2]
    members = [dict(steps) for _, steps in p.passes]
    assert members[:2] == [{1: 1}, {1: 2}]  # without it meanwhile
    assert members[2] == {1: 3, 2: 1}  # then it joins, at its step 1


def test_finished_rows_are_no_longer_computed_and_the_microbatch_leaves_with_its_last_row() -> None:
    """Row 0 of microbatch 1 finishes at step 2, row 2 at step 4: from the next step on, the passes feed
    and compute only the rows still running, and the cohort's row count (its balance) follows."""
    p = _drive(depth=1, rows={1: 3}, finish={1: 6}, ready_at={1: 0}, row_finish={1: {0: 2, 2: 4}})
    computed = [c[1] for c in p.computed]
    assert computed[:2] == [(0, 1, 2), (0, 1, 2)]  # steps 1 and 2
    assert computed[2:4] == [(1, 2), (1, 2)]  # steps 3 and 4: row 0 is done
    assert computed[4:] == [(1,), (1,)]  # steps 5 and 6: only row 1
    assert p.released == [1]


def test_a_colocated_task_of_a_newer_epoch_is_held_until_that_epoch_and_runs_first_then() -> None:
    """A repair's re-run claimed before this worker saw the new topology would prefill at the old epoch:
    its pass would be dropped by stages serving the new one, and its requests would wait for nothing."""
    from dejavu_common.messages import PromptPiece, PromptTask

    def task(task_id: int, epoch: int) -> PromptTask:
        return PromptTask(task_id=task_id, pieces=(PromptPiece(mb_id=task_id, dst_rows=(0, 1)),), epoch=epoch)

    queue = [task(1, 3), task(2, 4), task(3, 4)]
    held: list[PromptTask] = []
    pos = Position(0, 1, None, "t0", colocated=True)

    def driver(epoch: int) -> Driver:
        runner = Pipeline(1, {}, {}, set(), {})  # the driver's runner; nothing runs here
        d = Driver(runner, runner, None, "t0", pos, None, 1.0, epoch=epoch, held=held)  # type: ignore[arg-type]
        d.queue._claim_queued = lambda block: queue.pop(0) if queue else None  # type: ignore[method-assign]
        return d

    at3 = driver(3)
    assert at3.queue.claim(block=False).task_id == 1
    assert at3.queue.claim(block=False) is None and [t.task_id for t in held] == [2]
    assert at3.queue.claim(block=False) is None and len(queue) == 1  # nothing else is claimed meanwhile
    at4 = driver(4)  # the worker's next epoch: a new driver, the same held list
    assert [at4.queue.claim(block=False).task_id for _ in range(2)] == [2, 3]


def test_a_colocated_task_of_an_older_epoch_is_dropped_held_or_queued() -> None:
    """Every epoch change re-queues the prompts still to run under the new epoch: a task of the old one,
    held for room across the change or still in the queue, would prefill its microbatch a second time."""
    from dejavu_common.messages import PromptPiece, PromptTask

    def task(task_id: int, epoch: int) -> PromptTask:
        return PromptTask(task_id=task_id, pieces=(PromptPiece(mb_id=task_id, dst_rows=(0, 1)),), epoch=epoch)

    held = [task(1, 3)]  # held for room at epoch 3
    queue = [task(2, 3), task(1, 4), task(2, 4)]  # an old entry left unclaimed, then the repair's re-runs
    runner = Pipeline(1, {}, {}, set(), {})
    pos = Position(0, 1, None, "t0", colocated=True)
    d = Driver(runner, runner, None, "t0", pos, None, 1.0, epoch=4, held=held)  # type: ignore[arg-type]
    d.queue._claim_queued = lambda block: queue.pop(0) if queue else None  # type: ignore[method-assign]
    claimed = [d.queue.claim(block=False) for _ in range(4)]
    assert [(t.task_id, t.epoch) for t in claimed if t is not None] == [(1, 4), (2, 4)]
    assert held == [] and queue == []


def test_a_microbatch_that_cannot_resume_is_freed_and_failed_only_if_still_awaited(redis_url) -> None:
    """The resume point of a repair can name a microbatch whose tokens are not all on its stream. One whose
    newest tokens were lost with the failed last stage (it had replicated their step's KV: a multi-host CI
    run) resumes after the newest token there. One with none that finished while the repair was planned
    (the controller deleted its spec and stream) is only freed; one the controller still waits for is
    failed too. Either way no stage keeps its caches (the recovery kept them for this resume: a CI run
    found three stages holding them after the test)."""
    import redis as redis_lib

    from dejavu_common import keys
    from dejavu_common.messages import TokenStep

    client = redis_lib.Redis.from_url(redis_url)
    for mb in (5, 7, 8):
        client.set(keys.microbatch(mb), _spec(mb, 1).encode())
    for step in range(3):
        client.xadd(keys.tokens(5), {"step": TokenStep(mb_id=5, step=step, tokens=(9,), finished=(None,)).encode()})
    client.xadd(keys.tokens(7), {"step": TokenStep(mb_id=7, step=0, tokens=(4,), finished=(None,)).encode()})
    p = Pipeline(1, {}, {mb: _spec(mb, 1) for mb in (5, 6, 7, 8)})
    driver = Driver(p, p, client, "t0", Position(0, 1, None, "t0", colocated=False), None, 1.0)  # type: ignore[arg-type]
    driver.resume({5: 3, 6: 20, 7: 3, 8: 3})
    assert [(mb, m.step, m.feed) for mb, m in driver._waiting] == [(5, 3, (9,)), (7, 1, (4,))]
    assert sorted(p.released) == [6, 8] and p.failed == [8]


class Colocated(Pipeline):
    """:class:`Pipeline` for a colocated stage: a pass is a decode step of its members or a prefill of
    one microbatch claimed from the queue; ``kinds`` records which, in order."""

    def __init__(self, finish: dict[int, int], rows: dict[int, int], mixes: bool = False) -> None:
        super().__init__(1, finish, {mb: _spec(mb, n) for mb, n in rows.items()})
        self.mixes = mixes
        self.refuse: set[int] = set()  # prompts whose mixed pass cannot have their blocks
        self.kinds: list[tuple[str, tuple[int, ...]]] = []

    def run_mixed(self, pos, members, io, prefill, prompts, cohort):
        mb = prefill.state.spec.mb_id
        if mb in self.refuse:
            raise PrefillRefused(mb, PoolExhausted("no blocks"))
        decoded = self.run(pos, members, Kind.DECODE, io, cohort)
        self.kinds[-1] = ("MIXED", (*self.kinds[-1][1], mb))
        n = len(prefill.state.spec.rows)
        assert prompts.input_ids.shape[0] == n
        return TokenReturn(cohort, (*decoded.members, Returned(mb, 0, (0,) * n, False, tuple(range(n)))))

    def release(self, mb: int, finished: bool = True) -> None:
        if mb in self.states and finished:
            super().release(mb)

    def run(self, pos, members, kind, io, cohort=-1, next_mb=None):
        self.kinds.append((kind.name, tuple(m.state.spec.mb_id for m in members)))
        if kind is Kind.PREFILL:
            (m,) = members
            n = len(m.state.spec.rows)
            return TokenReturn(cohort, (Returned(m.state.spec.mb_id, 0, (0,) * n, False, tuple(range(n))),))
        return super().run(pos, members, kind, io, cohort, next_mb)


def _colocated(
    arrivals: dict[int, int],
    mixes: bool = False,
    refuse: frozenset[int] = frozenset(),
    scored: frozenset[int] = frozenset(),
) -> Colocated:
    """A colocated stage whose prompt ``mb`` (one row, four steps) can be claimed once ``arrivals[mb]``
    passes have run; driven for nine passes or until all is done. The rows of ``scored`` ask for their
    prompt's log probabilities."""
    from dejavu_common.messages import PromptPiece, PromptTask

    p = Colocated(dict.fromkeys(arrivals, 4), dict.fromkeys(arrivals, 1), mixes)
    p.refuse = set(refuse)
    for mb in scored:
        row = p.specs[mb].rows[0]
        wants = row.model_copy(update={"sampling": row.sampling.model_copy(update={"prompt_logprobs": 1})})
        p.specs[mb] = p.specs[mb].model_copy(update={"rows": (wants,)})
    queue = [PromptTask(task_id=mb, pieces=(PromptPiece(mb_id=mb, dst_rows=(0, 1)),)) for mb in sorted(arrivals)]

    def claim(block: bool) -> PromptTask | None:
        if queue and arrivals[queue[0].task_id] <= len(p.kinds):
            return queue.pop(0)
        return None

    driver = Driver(p, p, None, "t0", Position(0, 1, None, "t0", colocated=True), None, 1.0)  # type: ignore[arg-type]
    driver.queue._claim_queued = claim  # type: ignore[method-assign]
    driver.run(lambda: len(p.kinds) >= 9 or (bool(p.kinds) and not queue and not driver.cohorts[0].members))
    return p


def test_colocated_arrivals_delay_streaming_rows_one_prefill_at_a_time() -> None:
    """Two prompts arrive while microbatch 1 streams: each is prefilled after a decode step of the
    cohort, so the streaming row waits one prefill at a time, never the whole queue."""
    p = _colocated({1: 0, 2: 3, 3: 3})
    assert p.kinds == [
        ("PREFILL", (1,)),
        ("DECODE", (1,)),
        ("DECODE", (1,)),
        ("PREFILL", (2,)),  # both arrived; the next waits for a decode step
        ("DECODE", (1, 2)),
        ("PREFILL", (3,)),
        ("DECODE", (1, 2, 3)),  # microbatch 1's fourth step, its last
        ("DECODE", (2, 3)),
        ("DECODE", (2, 3)),
    ]


def test_colocated_prompts_arriving_together_are_prefilled_back_to_back() -> None:
    """Nothing streams yet: a burst's prompts are prefilled one after the other, then decode together."""
    p = _colocated({1: 0, 2: 0, 3: 0})
    assert p.kinds[:5] == [
        ("PREFILL", (1,)),
        ("PREFILL", (2,)),
        ("PREFILL", (3,)),
        ("DECODE", (1, 2, 3)),
        ("DECODE", (1, 2, 3)),
    ]


def test_where_passes_mix_arrivals_are_prefilled_in_the_streaming_rows_decode_steps() -> None:
    """A prompt that arrives while others stream is prefilled in the pass that also runs their next step:
    they get a token from every pass, and the new microbatch decodes with them from the next one."""
    p = _colocated({1: 0, 2: 3, 3: 3}, mixes=True)
    assert p.kinds == [
        ("PREFILL", (1,)),  # nothing to decode yet
        ("DECODE", (1,)),
        ("DECODE", (1,)),
        ("MIXED", (1, 2)),  # microbatch 1's step 3 and microbatch 2's prompt
        ("MIXED", (1, 2, 3)),  # microbatch 1's last step, 2's first, 3's prompt
        ("DECODE", (2, 3)),
        ("DECODE", (2, 3)),
        ("DECODE", (2, 3)),  # microbatch 2's last step
        ("DECODE", (3,)),
    ]
    assert not p.failed


def test_where_passes_mix_a_prompt_scored_at_every_position_is_prefilled_in_a_pass_of_its_own() -> None:
    """Its prompt's log probabilities need logits at every position, which a mixed pass does not compute."""
    p = _colocated({1: 0, 2: 3, 3: 3}, mixes=True, scored=frozenset({2}))
    assert p.kinds[:5] == [
        ("PREFILL", (1,)),
        ("DECODE", (1,)),
        ("DECODE", (1,)),
        ("PREFILL", (2,)),  # not mixed with microbatch 1's step
        ("MIXED", (1, 2, 3)),  # the next arrival mixes again
    ]
    assert not p.failed


def test_where_passes_mix_a_burst_decodes_from_the_second_prefill_on() -> None:
    p = _colocated({1: 0, 2: 0, 3: 0}, mixes=True)
    assert p.kinds[:4] == [("PREFILL", (1,)), ("MIXED", (1, 2)), ("MIXED", (1, 2, 3)), ("DECODE", (1, 2, 3))]


def test_a_prompt_refused_its_blocks_in_a_mixed_pass_fails_alone_and_the_others_decode_at_once() -> None:
    p = _colocated({1: 0, 2: 1, 3: 2}, mixes=True, refuse=frozenset({2}))
    assert p.failed == [2]
    assert 2 in p.released  # freed along the pipeline
    # In 2's pass, refused before anything ran, microbatch 1 decodes alone; 3 is prefilled in the next one.
    assert p.kinds[:3] == [("PREFILL", (1,)), ("DECODE", (1,)), ("MIXED", (1, 3))]


def test_a_colocated_task_that_is_not_one_whole_microbatch_fails_its_microbatches_and_the_stage_serves_on() -> None:
    """Stage 0 prefills a colocated task as one microbatch. A task naming parts of several (as the
    controller once packed a repair's re-runs) used to end the process, and so every replacement in
    turn; its microbatches fail instead, and the next task is served."""
    from dejavu_common.messages import PromptPiece, PromptTask

    p = Colocated({1: 2, 2: 2, 3: 2, 4: 2}, {1: 1, 2: 2, 3: 1, 4: 2})
    queue = [
        PromptTask(task_id=10, pieces=(PromptPiece(mb_id=1, dst_rows=(0, 1)), PromptPiece(mb_id=2, dst_rows=(0, 1)))),
        PromptTask(task_id=11, pieces=(PromptPiece(mb_id=2, dst_rows=(1, 2)), PromptPiece(mb_id=3, dst_rows=(0, 1)))),
        PromptTask(task_id=12, pieces=(PromptPiece(mb_id=4, dst_rows=(0, 1)),)),  # half of microbatch 4
        PromptTask(task_id=13, pieces=(PromptPiece(mb_id=3, dst_rows=(0, 1)),)),  # whole: served
    ]
    driver = Driver(p, p, None, "t0", Position(0, 1, None, "t0", colocated=True), None, 1.0)  # type: ignore[arg-type]
    driver.queue._claim_queued = lambda block: queue.pop(0) if queue else None  # type: ignore[method-assign]
    driver.run(lambda: len(p.kinds) >= 3 or (bool(p.kinds) and not queue and not driver.cohorts[0].members))
    assert p.failed == [1, 2, 2, 3, 4]
    assert p.kinds == [("PREFILL", (3,)), ("DECODE", (3,)), ("DECODE", (3,))]


OOM = "OOM command not allowed when used memory > 'maxmemory'."


class Publishing(Pipeline):
    """:class:`Pipeline` whose last stage publishes each step's tokens on the microbatch's stream in Redis
    (token ``step`` for every row, finishes where rows end), and checks that each decode step is fed the
    tokens of the step before (step 1: the prompt's first tokens, 7). ``breaks`` maps a pass number to
    how many of its members' entries Redis takes before it refuses the rest (a write at ``maxmemory``):
    that pass raises, and does not leave stage 0."""

    def __init__(self, client, depth: int, finish: dict[int, int], rows: dict[int, int]) -> None:
        super().__init__(depth, finish, {mb: _spec(mb, n) for mb, n in rows.items()})
        self.client = client
        self.breaks: dict[int, int] = {}
        self.broken: list[tuple[int, ...]] = []  # the members of each pass that broke

    def run(self, pos, members, kind, io, cohort=-1, next_mb=None):
        import redis as redis_lib

        from dejavu_common import keys
        from dejavu_common.messages import FinishReason, TokenStep

        row = 0
        for m in members:
            fed = io.input_ids[row : row + len(m.rows), 0].tolist()
            assert fed == [m.step - 1 if m.step > 1 else 7] * len(m.rows), (m.state.mb_id, m.step, fed)
            row += len(m.rows)
        published = self.breaks.pop(len(self.passes) + len(self.broken), None)
        for i, m in enumerate(members):
            if published is not None and i >= published:
                self.broken.append(tuple(x.state.spec.mb_id for x in members))
                raise redis_lib.ResponseError(OOM)
            n = len(self.specs[m.state.spec.mb_id].rows)
            ends = [m.step >= self.finish[m.state.spec.mb_id]] * n
            fin = tuple(FinishReason.LENGTH if end else None for end in ends)
            step = TokenStep(mb_id=m.state.spec.mb_id, step=m.step, tokens=(m.step,) * n, finished=fin)
            self.client.xadd(keys.tokens(m.state.spec.mb_id), {"step": step.encode()})
        return super().run(pos, members, kind, io, cohort, next_mb)

    def release(self, mb: int, finished: bool = True) -> None:  # as the worker's release calls it
        super().release(mb)


def _published(client, mb: int) -> list[int]:
    from dejavu_common import keys
    from dejavu_common.messages import TokenStep

    return [TokenStep.decode(f[b"step"]).step for _id, f in client.xrange(keys.tokens(mb))]


def _serve_through_errors(driver: Driver, p: Pipeline, rows: dict[int, int]) -> int:
    """Run the driver as the token worker does: after an error, it serves the same epoch again and runs
    the same driver again. Returns how many errors left the driver."""
    import redis as redis_lib

    errors, rounds = 0, iter(range(10_000))
    while True:
        try:
            driver.run(lambda: set(p.released) >= set(rows) or next(rounds) >= 9_999)
            return errors
        except redis_lib.ResponseError:
            errors += 1


def test_a_pass_broken_by_a_redis_error_runs_again_from_the_token_streams_and_nothing_is_forgotten(
    redis_url,
) -> None:
    """Depth 1 (stage 0 samples and publishes): Redis takes microbatch 1's tokens of the pass, then refuses
    2's (OOM at ``maxmemory``). The error leaves the driver (the worker pauses and serves the epoch again);
    run again, the driver resumes both from their streams: 1 after the step it published, 2 at the step
    that was lost. Every step of every microbatch is published exactly once, each fed the token before it,
    and no microbatch fails or is left behind."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    rows = {1: 1, 2: 2, 3: 1}
    p = Publishing(client, 1, dict.fromkeys(rows, 6), rows)
    p.breaks = {3: 1}  # the 4th pass: microbatches 1 and 2 at step 4
    pos = Position(0, 1, None, "t0", colocated=False)
    ready = Ready(p, [(1, 0), (2, 0), (3, 5)])
    driver = Driver(p, p, client, "t0", pos, ready, 1.0)  # type: ignore[arg-type]
    assert _serve_through_errors(driver, p, rows) == 1
    assert p.broken == [(1, 2)] and p.failed == []
    assert sorted(p.released) == [1, 2, 3]
    for mb in rows:
        assert _published(client, mb) == [1, 2, 3, 4, 5, 6], mb
    steps = [dict(s) for _, s in p.passes]
    assert [s[1] for s in steps if 1 in s] == [1, 2, 3, 5, 6]  # its step 4 was published before the error
    assert [s[2] for s in steps if 2 in s] == [1, 2, 3, 4, 5, 6]  # 2's step 4 runs again


def test_a_pass_that_cannot_leave_stage_0_runs_again_and_the_other_cohort_goes_on(redis_url) -> None:
    """Depth 2: the send of cohort 0's pass fails (back-pressure, or Redis refusing a write on the way):
    the pass never left stage 0. Its microbatches run that step again; cohort 1's never stopped being
    served; nothing fails."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    rows = {1: 1, 2: 1, 3: 1, 4: 1}
    p = Publishing(client, 2, dict.fromkeys(rows, 5), rows)
    p.breaks = {4: 0}
    pos = Position(0, 2, "t1", "t0", colocated=False)
    driver = Driver(p, p, client, "t0", pos, Ready(p, [(mb, 0) for mb in rows]), 1.0, max_running=4)  # type: ignore[arg-type]
    assert _serve_through_errors(driver, p, rows) == 1
    assert len(p.broken) == 1 and p.failed == [] and sorted(p.released) == [1, 2, 3, 4]
    for mb in rows:
        assert _published(client, mb) == [1, 2, 3, 4, 5], mb


def test_failing_a_lost_pass_that_redis_interrupts_is_finished_when_the_driver_runs_again() -> None:
    """A pass is lost on the way; when its deadline fails its microbatches, Redis refuses the first error
    entry. The error leaves the driver; run again, the driver fails that pass's microbatches (none is left
    waiting for a return that never comes) and serves the others to their end."""
    import redis as redis_lib

    class RefusingOnce(Pipeline):
        def fail(self, mb: int, step: int, error: Exception) -> None:
            if not self.errors:
                self.errors.append(redis_lib.ResponseError(OOM))
                raise self.errors[-1]
            super().fail(mb, step, error)

    rows = {1: 1, 2: 1, 3: 1}
    p = RefusingOnce(2, dict.fromkeys(rows, 4), {mb: _spec(mb, 1) for mb in rows})
    p.lose = {(2, 2)}
    pos = Position(0, 2, "t1", "t0", colocated=False)
    ready = Ready(p, [(1, 0), (2, 0), (3, 6)])
    driver = Driver(p, p, None, "t0", pos, ready, 1.0, pass_deadline_s=1.0)  # type: ignore[arg-type]
    assert _serve_through_errors(driver, p, rows) == 1
    assert p.failed == [2] and sorted(p.released) == [1, 2, 3]
    assert isinstance(p.errors[1], DeadlineExceeded)
