"""Resume points after failures (the paper's Figure 10 example and the edge cases)."""

from __future__ import annotations

from dejavu_controller.recovery import plan_resume, replica_available


def test_paper_example_stage_two_fails() -> None:
    # 4 stages (0-based: stage 1 is the paper's "stage 2"); microbatch 1 ran step C=3 on stages 0 and 1,
    # but stage 1's step-3 update was not replicated yet (watermark 2); stages 2, 3 have not run step 3.
    progress = {0: {1: 3}, 2: {1: 2}, 3: {1: 2}}
    watermarks = {1: {1: 2}}
    plan = plan_resume(7, 4, [1], failed={1}, progress=progress, watermarks=watermarks)
    assert plan.epoch == 7 and plan.resume == {1: 3} and plan.rerun == ()


def test_resume_is_one_past_the_slowest_stage() -> None:
    progress = {0: {5: 10, 6: 4}, 1: {5: 9, 6: 4}, 3: {5: 9, 6: 3}}
    watermarks = {2: {5: 10, 6: 4}}
    plan = plan_resume(2, 4, [5, 6], failed={2}, progress=progress, watermarks=watermarks)
    assert plan.resume == {5: 10, 6: 4}


def test_adjacent_failures_and_missing_replicas_fall_back_to_prompts() -> None:
    progress = {0: {1: 5}, 3: {1: 5}}
    watermarks = {1: {1: 5}, 2: {1: 5}}
    # Stage 1's replica lives on stage 2, which failed too: microbatch 1 re-runs its prompt.
    assert not replica_available(1, 4, {1, 2})
    plan = plan_resume(3, 4, [1], failed={1, 2}, progress=progress, watermarks=watermarks)
    assert plan.resume == {} and plan.rerun == (1,)
    # Replication off, or a one-stage pipeline: no replica at all.
    assert plan_resume(3, 4, [1], {1}, progress, watermarks, replication=False).rerun == (1,)
    assert plan_resume(3, 1, [1], {0}, {}, {0: {1: 5}}).rerun == (1,)


def test_incomplete_prompt_kv_on_a_survivor_reruns_the_prompt() -> None:
    plan = plan_resume(1, 2, [4], failed={0}, progress={1: {4: -1}}, watermarks={0: {4: 0}})
    assert plan.rerun == (4,)


def test_two_non_adjacent_failures_resume_from_replicas() -> None:
    progress = {1: {0: 7}, 3: {0: 6}}
    watermarks = {0: {0: 7}, 2: {0: 6}}
    plan = plan_resume(9, 4, [0], failed={0, 2}, progress=progress, watermarks=watermarks)
    assert plan.resume == {0: 7}
