"""A token stage's microbatches take blocks of its paged pool as positions are written, and give them back:
a finished row's at the next pass that leaves it out, the rest when the microbatch is released."""

from __future__ import annotations

import pytest
import redis

from dejavu_common import keys
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavulib.layout import KVLayout
from dejavulib.paged import BlockGeometry, BlockPool, PagedKVCache


class Stage:  # what StageRunner.state asks of a stage
    num_layers = 2
    mixes = False

    def kv_layout(self, batch: int, max_len: int) -> KVLayout:
        return KVLayout(2, batch, 1, max_len, 4)


def test_blocks_follow_the_rows_and_microbatches_that_use_them(redis_url: str) -> None:
    from dejavu_token_worker.runner import StageRunner

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=32)
    rows = tuple(
        RowSpec(request_id=f"r{i}", prompt_ids=(1,) * n, sampling=SamplingSpec(max_tokens=8, seed=0))
        for i, n in enumerate((6, 2, 5))
    )
    for mb in (1, 2):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=rows, prompt_len=6, max_len=14).encode())
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    state = runner.state(1)
    assert isinstance(state.cache, PagedKVCache) and pool.used_blocks == 0  # nothing taken before KV comes
    # The prefill pass writes positions [0, 6): rows padded by 0, 4 and 1 take 2, 1 and 2 blocks.
    runner._acquire(state, 5, (0, 1, 2))
    assert pool.used_blocks == 5
    # Decode of step 3 (position 8, block 2) after row 1 finished: row 1's block goes back, rows 0 and 2
    # take one more each.
    runner._acquire(state, 8, (0, 2))
    assert not state.cache.live[1] and pool.used_blocks == 6
    runner._acquire(runner.state(2), 5, (0, 1, 2))
    assert pool.used_blocks == 11
    runner.release(1)
    assert pool.used_blocks == 5
    runner.release(2, finished=False)  # a microbatch whose prompt re-runs after a recovery: freed too
    assert pool.used_blocks == 0
    client.close()


def _two_prompts_in(runner) -> tuple:
    """Microbatches 1 and 2 with their prompts' KV in the pool (2 blocks each), 2 computed last."""
    one, two = runner.state(1), runner.state(2)
    for state in (one, two):
        state.mark_complete()
        runner._passes += 1
        state.last_pass = runner._passes
        runner._acquire(state, 3, (0, 1))
    return one, two


def test_a_full_pool_preempts_the_least_recently_computed_microbatch_to_host_memory(redis_url: str) -> None:
    from dejavu_token_worker.runner import StageRunner

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=6, slab_blocks=2)
    row = RowSpec(request_id="r", prompt_ids=(1,) * 4, sampling=SamplingSpec(max_tokens=8, seed=0))
    for mb in (1, 2):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row, row), prompt_len=4, max_len=12).encode())
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    one, two = _two_prompts_in(runner)
    assert pool.used_blocks == 4
    runner._in_pass = {2}
    runner._acquire(two, 7, (0, 1))  # 2 more blocks: 6 of 6 used
    runner._acquire(two, 11, (0, 1))  # 2 more: microbatch 1 (computed least recently) goes to host memory
    assert one.cache.evicted and not two.cache.evicted and pool.used_blocks == 6
    runner._in_pass = {1}
    runner._acquire(one, 4, (0, 1))  # back: needs 4 blocks, so microbatch 2 goes to host memory in turn
    assert not one.cache.evicted and two.cache.evicted
    client.close()


def test_past_its_host_budget_stage_0_discards_instead_and_the_driver_recomputes_from_the_stream(
    redis_url: str,
) -> None:
    """With no host memory left for preempted caches, making room forgets a microbatch's KV (its blocks back,
    no host copy, progress -1 so a repair does not count on it); a decode pass refuses it, and the driver's
    recompute pass feeds its prompt and every token its stream holds, one position per step."""
    from dejavu_common.messages import TokenStep
    from dejavu_token_worker.driver import Driver
    from dejavu_token_worker.runner import PassMember, Position, StageRunner
    from dejavu_worker.dataplane import Kind
    from dejavu_worker.microbatch import KVStatus

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=6, slab_blocks=2)
    rows = tuple(
        RowSpec(request_id=f"r{i}", prompt_ids=(5,) * n, sampling=SamplingSpec(max_tokens=8, seed=0))
        for i, n in enumerate((4, 2))
    )
    for mb in (1, 2):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=rows, prompt_len=4, max_len=12).encode())
        client.delete(keys.tokens(mb))
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    runner.host_budget = 1  # stage 0 with no host memory to spare
    one, two = _two_prompts_in(runner)
    one.done_step = 2
    runner._in_pass = {2}
    runner._acquire(two, 7, (0, 1))
    runner._acquire(two, 11, (0, 1))  # needs room: microbatch 1 is forgotten, not moved to host memory
    assert one.status is KVStatus.DISCARDED and not one.cache.evicted and one.cache.blocks_held == 0
    assert runner.host_held() == 0 and pool.used_blocks == 6
    assert runner.progress() == {1: -1, 2: 0}
    with pytest.raises(ValueError, match="recomputed"):
        runner.run(Position(0, 1, None, "t0", True), [PassMember(one, 3, (0, 1))], Kind.DECODE, None)  # type: ignore[arg-type]

    steps = ((0, (11, 21), (None, None)), (1, (12, 22), (None, "stop")), (2, (13, -1), (None, None)))
    for step, tokens, finished in steps:
        entry = TokenStep(mb_id=1, step=step, tokens=tokens, finished=finished)
        client.xadd(keys.tokens(1), {"step": entry.encode()})
    driver = Driver(runner, None, client, "t0", Position(0, 1, None, "t0", True), None, 1.0)  # type: ignore[arg-type]
    ids = driver._recompute_ids(one, 3)
    assert ids.tolist() == [[5, 5, 5, 5, 11, 12, 13], [0, 0, 5, 5, 21, 22, 0]]  # left-padded prompt, then steps 0-2
    with pytest.raises(ValueError, match="lacks"):
        driver._recompute_ids(one, 4)  # step 3's tokens are not on the stream
    client.close()


def test_a_later_stage_defers_a_member_it_discarded_and_runs_the_others(redis_url: str) -> None:
    """A stage after stage 0 that discarded a member's KV takes it out of the pass (its rows of the hidden
    states too) and hands it on as deferred; with no member left, the pass ends at once with its return."""
    import torch

    from dejavu_token_worker.runner import Position, StageRunner
    from dejavu_worker.dataplane import Kind, StageMessage, TokenReturn

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=12, slab_blocks=4)
    row = RowSpec(request_id="r", prompt_ids=(1,) * 4, sampling=SamplingSpec(max_tokens=8, seed=0))
    sent: list[TokenReturn] = []

    class Endpoint:
        def send(self, peer, channel, payload) -> None:
            sent.append(TokenReturn.decode(payload))

    runner = StageRunner(Stage(), client, Endpoint(), 1.0, pool=pool)  # type: ignore[arg-type]
    for mb in (1, 2, 3):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row, row), prompt_len=4, max_len=12).encode())
        runner.state(mb).mark_complete()
        runner._acquire(runner.state(mb), 5, (0, 1))
    runner.state(2).discard()
    ran = []
    runner.run = lambda pos, members, kind, io, cohort, next_mb=None, deferred=(): ran.append(  # type: ignore[method-assign]
        ([m.state.mb_id for m in members], io.hidden.tolist(), deferred)
    )
    pos = Position(1, 3, "t2", "t0", False)
    hidden = torch.arange(6.0).reshape(6, 1, 1)  # rows of microbatches 1, 2 and 3, two each
    members = ((1, 3, (0, 1)), (2, 3, (0, 1)), (3, 3, (0, 1)))
    runner.follow(pos, StageMessage(Kind.DECODE, 0, 0, hidden, members=members, deferred=((7, 2),)))
    assert ran == [([1, 3], [[[0.0]], [[1.0]], [[4.0]], [[5.0]]], ((7, 2), (2, 3)))] and sent == []
    runner.follow(pos, StageMessage(Kind.DECODE, 1, 0, hidden[2:4], members=((2, 4, (0, 1)),)))
    assert len(ran) == 1 and [(r.mb_id, r.step, r.recompute, r.done) for r in sent[0].members] == [(2, 4, True, False)]
    assert sent[0].cohort == 1  # the pass's own return: stage 0 may start the cohort's next pass
    client.close()


def test_a_step_a_later_stage_deferred_is_recomputed_at_that_step_and_a_failed_one_leaves(redis_url: str) -> None:
    """A later stage that discarded a member's KV leaves it out of the step and the last stage returns it
    as ``recompute``: stage 0 forgets its own KV of it, keeps it at that step, and its next pass is the
    recompute; the other members of the return advance as usual."""
    from dejavu_token_worker.driver import Driver, Member
    from dejavu_token_worker.runner import Position, StageRunner
    from dejavu_worker.dataplane import Returned, StageMessage, TokenReturn
    from dejavu_worker.microbatch import KVStatus

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=12, slab_blocks=4)
    row = RowSpec(request_id="r", prompt_ids=(1,) * 4, sampling=SamplingSpec(max_tokens=8, seed=0))
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    for mb in (1, 2):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row, row), prompt_len=4, max_len=12).encode())
        runner.state(mb).mark_complete()
        runner._acquire(runner.state(mb), 5, (0, 1))
    released: list[int] = []

    class Endpoint:
        def send(self, peer, channel, payload) -> None:
            released.append(StageMessage.decode(payload).mb_id)

    driver = Driver(runner, Endpoint(), client, "t0", Position(0, 2, "t1", "t0", False), None, 1.0, 64, runner.release)  # type: ignore[arg-type]
    cohort = driver.cohorts[0]
    cohort.members.update({mb: Member(2, (7, 7), (0, 1)) for mb in (1, 2)})
    cohort.pass_members = (1, 2)
    driver.runnable.clear()
    ret = TokenReturn(0, (Returned(1, 2, (8, 9), False), Returned(2, 2, (), False, None, recompute=True)))
    driver._returned(ret)
    assert cohort.members[1].step == 3 and cohort.members[2].step == 2  # 2 stays at the step it missed
    assert runner.states[2].status is KVStatus.DISCARDED and runner.states[2].cache.blocks_held == 0
    assert runner.states[1].status is KVStatus.READY and list(driver.runnable) == [0]
    # A member stage 0 cannot recompute (its state is gone) fails instead of looping.
    runner.release(1, finished=False)
    cohort.pass_members = (1,)
    driver._returned(TokenReturn(0, (Returned(1, 3, (), False, None, recompute=True),)))
    assert 1 not in cohort.members and released == [1]
    client.close()


def test_colocated_a_prompt_waits_for_blocks_and_one_larger_than_the_pool_fails_alone(redis_url: str) -> None:
    """Admission by free blocks where stage 0 prefills (colocated): a prompt whose blocks the pool cannot give
    after the running members' next step is held and claimed again later (the running requests are never
    preempted for it); one that could not fit even with nothing else running fails on its own."""
    from dejavu_common.messages import PromptPiece, PromptTask, TokenStep
    from dejavu_token_worker.driver import Driver, Member
    from dejavu_token_worker.runner import Position, StageRunner

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=12, slab_blocks=4)
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    for mb, prompt in ((1, 8), (2, 16), (3, 52)):
        row = RowSpec(request_id=f"r{mb}", prompt_ids=(1,) * prompt, sampling=SamplingSpec(max_tokens=8, seed=0))
        spec = MicrobatchSpec(mb_id=mb, rows=(row, row), prompt_len=prompt, max_len=prompt + 8)
        client.set(keys.microbatch(mb), spec.encode())
        client.delete(keys.tokens(mb))
    running = runner.state(1)
    running.mark_complete()
    runner._acquire(running, 7, (0, 1))  # the running microbatch: 2 blocks a row
    driver = Driver(runner, None, client, "t0", Position(0, 1, None, "t0", True), None, 1.0, 64, runner.release)  # type: ignore[arg-type]
    driver.cohorts[0].members[1] = Member(1, (7, 7), (0, 1))  # its next step writes position 8: 1 block a row
    task = PromptTask(task_id=2, pieces=(PromptPiece(mb_id=2, dst_rows=(0, 2)),))
    assert not driver._room_for_prompt(task)  # 8 blocks for the prompt + 2 for the step > 8 free
    assert driver.queue.held == [task] and pool.used_blocks == 4  # held, and nothing was preempted for it
    driver.queue.held.clear()
    runner.release(1)
    driver.cohorts[0].members.clear()
    assert driver._room_for_prompt(task)  # the running request ended: it fits now
    huge = PromptTask(task_id=3, pieces=(PromptPiece(mb_id=3, dst_rows=(0, 2)),))
    assert not driver._room_for_prompt(huge) and driver.queue.held == []  # 26 blocks > 12: it never could
    [(_, fields)] = client.xrange(keys.tokens(3))
    assert TokenStep.decode(fields[b"step"]).finished == ("error", "error")
    client.delete(keys.microbatch(9))
    gone = PromptTask(task_id=9, pieces=(PromptPiece(mb_id=9, dst_rows=(0, 2)),))
    assert not driver._room_for_prompt(gone) and driver.queue.held == []  # its microbatch ended: dropped at once
    client.close()


def test_a_pass_that_cannot_fit_the_pool_sets_its_latest_members_aside_first_in_line(redis_url: str) -> None:
    from dejavu_token_worker.driver import Driver, Member
    from dejavu_token_worker.runner import Position, StageRunner

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=12, slab_blocks=4)
    row = RowSpec(request_id="r", prompt_ids=(1,) * 4, sampling=SamplingSpec(max_tokens=8, seed=0))
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    states = {}
    for mb in (1, 2, 3):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row, row), prompt_len=4, max_len=12).encode())
        states[mb] = runner.state(mb)
        states[mb].mark_complete()
        runner._acquire(states[mb], 3, (0, 1))  # the prompt: one block a row
    assert pool.free_blocks == 6
    driver = Driver(runner, None, client, "t0", Position(0, 1, None, "t0", False), None, 1.0)  # type: ignore[arg-type]
    cohort = driver.cohorts[0]
    cohort.members.update({mb: Member(5, (7, 7), (0, 1)) for mb in (1, 2, 3)})  # step 5 writes position 8: block 2
    driver._fit_pool(cohort, states)
    # Each member needs 4 more blocks (two rows x blocks 1 and 2): 12 > 6 free. Microbatch 3 (the latest)
    # leaves, which makes its 2 blocks movable to host memory: 8 needed, 8 within reach.
    assert list(cohort.members) == [1, 2] and list(states) == [1, 2]
    assert [mb for mb, _ in driver._waiting] == [3] and driver._waiting[0][1].step == 5
    # It rejoins only when the pool has room for its step: not while 1 and 2 run ...
    assert not driver._room_for(3, driver._waiting[0][1])
    runner.release(1)
    cohort.members.pop(1)
    assert driver._room_for(3, driver._waiting[0][1])  # ... and once microbatch 1 is gone, it does
    client.close()


def test_a_microbatch_recomputed_past_the_cap_fails_instead_of_thrashing(redis_url: str) -> None:
    """Memory pressure that never eases would discard and recompute the same microbatch for ever: past
    ``engine.max_recomputes`` recomputes it fails with an error to its requests, and the cohort serves on."""
    from dejavu_common.messages import FinishReason, TokenStep
    from dejavu_token_worker.driver import Driver, Member
    from dejavu_token_worker.runner import Position, StageRunner

    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=12, slab_blocks=4)
    row = RowSpec(request_id="r", prompt_ids=(1,) * 4, sampling=SamplingSpec(max_tokens=8, seed=0))
    client.set(keys.microbatch(1), MicrobatchSpec(mb_id=1, rows=(row, row), prompt_len=4, max_len=12).encode())
    client.delete(keys.tokens(1))
    runner = StageRunner(Stage(), client, None, 1.0, pool=pool)  # type: ignore[arg-type]
    state = runner.state(1)
    state.mark_complete()
    driver = Driver(runner, None, client, "t0", Position(0, 1, None, "t0", True), None, 1.0, max_recomputes=2)  # type: ignore[arg-type]
    cohort = driver.cohorts[0]
    cohort.members[1] = Member(2, (7, 7), (0, 1))
    recomputed: list[int] = []
    driver._prefill_pass = lambda cohort, member, ids: recomputed.append(member.state.mb_id)  # type: ignore[method-assign]
    driver.runnable.clear()
    for _ in range(2):
        driver._recompute(cohort, state)
    assert recomputed == [1, 1] and 1 in cohort.members
    driver._recompute(cohort, state)  # the third time: past the cap
    assert recomputed == [1, 1] and 1 not in cohort.members and list(driver.runnable) == [0]
    (entry,) = [TokenStep.decode(fields[b"step"]) for _, fields in client.xrange(keys.tokens(1))]
    assert entry.finished == (FinishReason.ERROR, FinishReason.ERROR)
    client.close()
