"""Microbatch formation, prompt-task packing and request state transitions (pure logic)."""

from __future__ import annotations

import pytest

from dejavu_common.messages import SamplingSpec
from dejavu_controller.backend import FinishReason, QueueFullError
from dejavu_controller.request import IllegalTransition, Request, RequestStatus
from dejavu_controller.scheduler import Scheduler, SchedulerLimits


def _req(i: int, n_prompt: int = 3, max_tokens: int = 5, arrival: float = 0.0) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_ids=tuple(range(1, n_prompt + 1)),
        sampling=SamplingSpec(max_tokens=max_tokens, seed=i),
        arrival=arrival,
    )


def _sched(tb=4, pb=4, outstanding=2, bound=100, wait=0.05) -> Scheduler:
    return Scheduler(SchedulerLimits(tb, pb, outstanding * tb, bound, wait))  # outstanding: microbatches


def test_full_microbatch_forms_at_once_and_geometry_is_left_padded() -> None:
    s = _sched()
    for i, n in enumerate([3, 7, 5, 2]):
        s.admit(_req(i, n_prompt=n, max_tokens=4 + i))
    (mb,) = s.form(now=0.0)
    assert mb.spec.prompt_len == 7
    assert mb.spec.max_len == 7 + 7
    assert mb.spec.pad_lens == (4, 0, 2, 5)
    assert [r.row for r in mb.requests] == [0, 1, 2, 3]
    assert all(r.status is RequestStatus.SCHEDULED for r in mb.requests)


def test_partial_microbatch_waits_for_batch_wait_while_others_run() -> None:
    s = _sched(wait=0.05)
    for i in range(4):
        s.admit(_req(i, arrival=10.0))
    (running,) = s.form(now=10.0)
    s.admit(_req(4, arrival=10.0))
    assert s.form(now=10.01) == []
    (mb,) = s.form(now=10.06)
    assert len(mb.requests) == 1
    # Once the workers are done with everything dispatched, a partial microbatch goes at once.
    s.admit(_req(5, arrival=11.0))
    running.finished_rows.update(range(4))
    mb.finished_rows.add(0)
    (alone,) = s.form(now=11.0)
    assert [r.request_id for r in alone.requests] == ["r5"]


def test_a_request_arriving_at_an_idle_pipeline_is_dispatched_at_once() -> None:
    """Nothing is running: waiting batch_wait_ms for company would only add to its time to first token."""
    s = _sched(wait=0.05)
    s.admit(_req(0, arrival=10.0))
    (mb,) = s.form(now=10.0)
    assert len(mb.requests) == 1
    s.admit(_req(1, arrival=10.001))
    assert s.form(now=10.001) == []  # r0 is running now: r1 waits for company (or batch_wait)


def test_outstanding_bound_and_replacement() -> None:
    s = _sched(tb=1, outstanding=2)
    for i in range(3):
        s.admit(_req(i))
    formed = s.form(now=1.0)
    assert [m.spec.mb_id for m in formed] == [0, 1]
    assert s.queue_depth == 1
    s.complete(0)
    (mb,) = s.form(now=1.0)
    assert mb.spec.mb_id == 2 and mb.requests[0].request_id == "r2"


def test_queue_bound_raises() -> None:
    s = _sched(bound=2)
    s.admit(_req(0))
    s.admit(_req(1))
    with pytest.raises(QueueFullError):
        s.admit(_req(2))


@pytest.mark.parametrize(
    ("token_b", "prompt_b", "n_mbs", "expected"),
    [
        (8, 4, 1, [[(0, (0, 4))], [(0, (4, 8))]]),  # one token microbatch from two prompt microbatches
        (2, 4, 2, [[(0, (0, 2)), (1, (0, 2))]]),  # one prompt microbatch feeds two token microbatches
        (3, 2, 2, [[(0, (0, 2))], [(0, (2, 3)), (1, (0, 1))], [(1, (1, 3))]]),  # unaligned
    ],
)
def test_prompt_packing_splits_and_merges(token_b, prompt_b, n_mbs, expected) -> None:
    s = _sched(tb=token_b, pb=prompt_b, outstanding=n_mbs)
    for i in range(token_b * n_mbs):
        s.admit(_req(i))
    mbs = s.form(now=1.0)
    tasks = s.pack_prompt_tasks(mbs, epoch=7)
    got = [[(p.mb_id, p.dst_rows) for p in t.pieces] for t in tasks]
    assert got == expected
    assert [t.task_id for t in tasks] == list(range(len(tasks)))
    assert {t.epoch for t in tasks} == {7}  # the epoch they are queued under (a prompt worker waits for it)


def test_prompt_tasks_pack_prompt_tokens_up_to_their_bound() -> None:
    """Requests of one row each (request scheduling) with prompts of 300, 900, 100, 1,500 and 200 tokens under a
    bound of 1,024 tokens and 4 rows: a task closes before the prompt that would pass the bound, and a prompt
    longer than the bound is a task of its own."""
    s = Scheduler(SchedulerLimits(1, 4, 8, 100, 0.0, prompt_task_tokens=1024))
    for i, n in enumerate([300, 900, 100, 1500, 200]):
        s.admit(_req(i, n_prompt=n))
    mbs = s.form(now=1.0)
    tasks = s.pack_prompt_tasks(mbs, epoch=1)
    got = [[p.mb_id - mbs[0].spec.mb_id for p in t.pieces] for t in tasks]
    assert got == [[0], [1, 2], [3], [4]]
    # Rows of one microbatch split where the bound falls.
    s = Scheduler(SchedulerLimits(4, 4, 8, 100, 0.0, prompt_task_tokens=10))
    for i, n in enumerate([4, 4, 4, 9]):
        s.admit(_req(i, n_prompt=n))
    (mb,) = s.form(now=1.0)
    tasks = s.pack_prompt_tasks([mb], epoch=1)
    assert [[p.dst_rows for p in t.pieces] for t in tasks] == [[(0, 2)], [(2, 3)], [(3, 4)]]


def test_colocated_tasks_are_whole_microbatches_of_any_size() -> None:
    """Colocated, stage 0 prefills each token microbatch in one pass. Microbatches of 1, 2 and 1 rows (an
    idle pipeline's first request goes alone; a repair re-runs them together) are three tasks, not rows
    packed across microbatches as prompt workers take them."""
    s = Scheduler(SchedulerLimits(2, 2, 8, 100, 0.05, split_prompts=False))
    s.admit(_req(0))
    (first,) = s.form(now=0.0)  # idle: at once, alone
    for i in (1, 2, 3):
        s.admit(_req(i))
    rest = s.form(now=1.0)
    assert [len(m.requests) for m in (first, *rest)] == [1, 2, 1]
    tasks = s.pack_prompt_tasks([first, *rest], epoch=3)
    got = [[(p.mb_id, p.dst_rows) for p in t.pieces] for t in tasks]
    assert got == [[(first.spec.mb_id, (0, 1))], [(rest[0].spec.mb_id, (0, 2))], [(rest[1].spec.mb_id, (0, 1))]]


def test_cancelled_waiting_requests_are_dropped() -> None:
    s = _sched(tb=2)
    a, b, c = _req(0), _req(1), _req(2)
    for r in (a, b, c):
        s.admit(r)
    a.transition(RequestStatus.CANCELLED)
    (mb,) = s.form(now=1.0)
    assert [r.request_id for r in mb.requests] == ["r1", "r2"]


def test_request_delivers_each_step_once_and_rejects_illegal_transitions() -> None:
    r = _req(0)
    r.transition(RequestStatus.SCHEDULED)
    assert r.deliver(0, 42, None)
    assert not r.deliver(0, 42, None)  # a re-executed step after recovery is a duplicate
    assert not r.deliver(1, -1, None)  # nothing for this row
    assert r.deliver(1, 7, FinishReason.LENGTH)
    assert r.output_ids == [42, 7]
    assert r.status is RequestStatus.FINISHED
    with pytest.raises(IllegalTransition):
        r.transition(RequestStatus.DECODING)


def test_a_re_run_that_does_not_reproduce_the_delivered_tokens_fails_the_request_instead_of_splicing() -> None:
    r = _req(0)
    r.transition(RequestStatus.SCHEDULED)
    for step, token in enumerate((5, 6, 7)):
        assert r.deliver(step, token, None)
    assert not r.deliver(0, 5, None) and not r.deliver(1, 6, None)  # a re-run reproducing them: duplicates
    assert r.status is RequestStatus.DECODING and r.diverged_at is None
    assert r.deliver(2, 9, None)  # the re-run's step 2 differs from the token the client has
    assert r.status is RequestStatus.FAILED and r.diverged_at == 2 and r.output_ids == [5, 6, 7]
    events = [r.events.get_nowait() for _ in range(r.events.qsize())]
    assert [e.token_ids for e in events] == [(5,), (6,), (7,), ()]
    assert events[-1].finish_reason is FinishReason.ERROR
    assert not r.deliver(3, 10, None)  # nothing after it


def test_microbatch_span_stays_within_the_context() -> None:
    s = Scheduler(SchedulerLimits(4, 4, 2, 100, 0.0, max_len=20))
    s.admit(_req(0, n_prompt=15, max_tokens=2))
    s.admit(_req(1, n_prompt=2, max_tokens=15))  # alone it fits; with request 0 the span would be 30
    s.admit(_req(2, n_prompt=3, max_tokens=3))
    a, b = s.form(now=1.0)
    assert [r.request_id for r in a.requests] == ["r0"]
    assert [r.request_id for r in b.requests] == ["r1", "r2"]
    assert b.spec.max_len <= 20


def test_a_microbatch_is_counted_out_only_after_repairs_without_progress() -> None:
    s = _sched(tb=2)
    s.admit(_req(0))
    s.admit(_req(1))
    (mb,) = s.form(now=1.0)
    # In flight for three repairs in a row with nothing delivered: still within a limit of 3.
    assert [mb.note_repair(limit=3) for _ in range(3)] == [False, False, False]
    # A token delivered between repairs starts the count over: failures that interrupt a progressing
    # microbatch (random crashes) never count it out.
    mb.requests[0].deliver(0, 42, None)
    mb.started_rows.add(0)
    assert mb.note_repair(limit=3) is False and mb.stalled_repairs == 1
    assert [mb.note_repair(limit=3) for _ in range(3)] == [False, False, True]


def test_an_error_finish_fails_the_request() -> None:
    r = _req(0)
    r.transition(RequestStatus.SCHEDULED)
    assert r.deliver(0, -1, FinishReason.ERROR)
    assert r.status is RequestStatus.FAILED and r.done
    assert r.events.get_nowait().finish_reason is FinishReason.ERROR
    assert not r.deliver(1, 5, None)  # nothing after the failure reaches the client


def test_an_error_finish_behind_the_delivered_steps_still_fails_the_request() -> None:
    """A re-run microbatch fails at its prompt (step 0) after earlier steps were delivered: the error is
    not a duplicate step, or the request would wait for tokens that never come."""
    r = _req(0)
    r.transition(RequestStatus.SCHEDULED)
    assert r.deliver(0, 7, None) and r.deliver(1, 8, None)
    assert not r.deliver(0, 7, None)  # a re-executed step's token is a duplicate
    assert r.deliver(0, -1, FinishReason.ERROR)
    assert r.status is RequestStatus.FAILED and r.output_ids == [7, 8]
    assert [e.finish_reason for e in (r.events.get_nowait() for _ in range(3))] == [None, None, FinishReason.ERROR]
    assert not r.deliver(2, 9, None)


def test_chat_requests_without_max_tokens_share_a_microbatch() -> None:
    s = Scheduler(SchedulerLimits(4, 4, 64, 100, 0.0, max_len=100))
    for i, n in enumerate([10, 3, 40, 25]):  # no max_tokens: each asked for the rest of the context
        s.admit(_req(i, n_prompt=n, max_tokens=100 - n))
    (mb,) = s.form(now=1.0)
    assert len(mb.requests) == 4 and mb.spec.prompt_len == 40 and mb.spec.max_len == 100
    # A request with an explicit budget that would not fit beside a longer prompt still waits apart.
    s.admit(_req(4, n_prompt=40, max_tokens=10))
    s.admit(_req(5, n_prompt=5, max_tokens=90))
    a, b = s.form(now=1.0)
    assert [len(a.requests), len(b.requests)] == [1, 1]


def test_outstanding_requests_bound_dispatch_and_finished_rows_free_room() -> None:
    s = Scheduler(SchedulerLimits(2, 2, 4, 100, 0.0))
    for i in range(8):
        s.admit(_req(i))
    assert [len(m.requests) for m in s.form(now=1.0)] == [2, 2]
    assert s.form(now=1.0) == [] and s.outstanding_rows == 4
    first = s.active[min(s.active)]
    first.finished_rows.update({0, 1})  # the workers finished both rows: room for one more microbatch
    assert s.outstanding_rows == 2
    assert [len(m.requests) for m in s.form(now=1.0)] == [2]


def test_unformed_microbatches_give_back_their_slots_and_requeue_live_requests_first() -> None:
    s = _sched(tb=2, outstanding=2)
    for i in range(5):
        s.admit(_req(i))
    a, b = s.form(now=1.0)
    assert s.outstanding_rows == 4 and [r.request_id for r in s.waiting] == ["r4"]
    a.requests[1].transition(RequestStatus.CANCELLED)  # its client left while the write was under way
    s.unform([a, b])
    assert not s.active and s.outstanding_rows == 0
    assert [r.request_id for r in s.waiting] == ["r0", "r2", "r3", "r4"]
    assert all(r.status is RequestStatus.QUEUED and r.mb_id is None and r.row is None for r in s.waiting)
    again = s.form(now=1.0)
    assert [[r.request_id for r in mb.requests] for mb in again] == [["r0", "r2"], ["r3", "r4"]]
    assert {mb.spec.mb_id for mb in again}.isdisjoint({a.spec.mb_id, b.spec.mb_id})  # ids are never reused
