"""The simulator on traces small enough to work out by hand, and against the formulas in steady state."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dejavu_planner import formulas
from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Deployment, Policy
from dejavu_planner.profile import Profile
from dejavu_planner.simulator import simulate
from dejavu_planner.trace import Trace, lmsys_like_trace, uniform_trace

ProfileFactory = Callable[..., Profile]

# The toy profile has 2 layers; with 2 stages a stage holds 1 layer: prompt y = 1.5 s, token step 0.5 s.
# With 1 stage (2 layers): prompt 3 s, token step 1 s. All microbatches below have 1 request (b=1).


def baseline(depth: int, b: int = 1, replicas: int = 1, swap: bool = False) -> Deployment:
    return Deployment(Policy.BASELINE, depth, b, replicas=replicas, swap=swap)


def test_one_microbatch_two_stages(make_profile: ProfileFactory) -> None:
    # Prompt: stage 0 [0, 1.5], stage 1 [1.5, 3] -> first token at 3.
    # Token steps 1 and 2: [3, 4] and [4, 5] across both stages -> done at 5 = 2*1.5 + 2*2*0.5.
    cost = CostModel(make_profile())
    result = simulate(baseline(2), Trace.of([(0, 10, 3)]), cost, record_timeline=True)
    assert result.makespan_s == pytest.approx(5.0)
    (record,) = result.requests
    assert (record.first_token_s, record.finish_s) == (pytest.approx(3.0), pytest.approx(5.0))
    stage0 = [(s.start_s, s.end_s, s.step) for s in result.timeline if s.stage == 0]
    assert stage0 == [(0, 1.5, 0), (3, 3.5, 1), (4, 4.5, 2)]


def test_two_microbatches_two_stages_wait_for_prompts(make_profile: ProfileFactory) -> None:
    # Stage prompt 3 s, token 1 s (layer times doubled). Two requests of 3 tokens (2 token steps).
    # s0: P0 [0,3] P1 [3,6] | s1: P0 [3,6] P1 [6,9]. mb0 tok1: s0 [6,7], waits for s1 until 9: [9,10].
    # mb1 tok1: s0 [9,10], s1 [10,11]. mb0 tok2: s0 [10,11], s1 [11,12]. mb1 tok2: s0 [11,12], s1 [12,13].
    cost = CostModel(make_profile(prompt_layer_s=3.0, token_layer_s=1.0))
    result = simulate(baseline(2), Trace.of([(0, 10, 3), (0, 10, 3)]), cost)
    assert result.makespan_s == pytest.approx(13.0)
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == [(6.0, 12.0), (9.0, 13.0)]


def test_early_stop_replacement_beats_fastertransformer(make_profile: ProfileFactory) -> None:
    # Stage prompt 3 s, token 1 s; requests of 2, 3 and 2 tokens, b=1, depth 2 (so 2 slots).
    cost = CostModel(make_profile(prompt_layer_s=3.0, token_layer_s=1.0))
    trace = Trace.of([(0, 10, 2), (0, 10, 3), (0, 10, 2)])
    # FasterTransformer: batch {r0, r1} runs 2 token steps for both (as the case above) and returns
    # both at 13; then r2 alone: P [13,16] [16,19], tok1 [19,20] [20,21].
    ft = simulate(Deployment(Policy.FASTER_TRANSFORMER, 2, 1), trace, cost)
    assert [r.finish_s for r in ft.requests] == [13.0, 13.0, 21.0]
    # Baseline: r0 ends after tok1 at s1 [9,10] and r2's prompt replaces it at 10: s0 [10,13], s1 [13,16].
    # r1: tok1 s0 [9,10] s1 [10,11]; tok2 waits behind P2 on s0: [13,14], then s1 [16,17].
    # r2: tok1 s0 [16,17], s1 [17,18].
    replaced = simulate(baseline(2), trace, cost)
    assert [r.finish_s for r in replaced.requests] == [10.0, 17.0, 18.0]
    assert replaced.makespan_s < ft.makespan_s


def test_dejavu_two_single_stage_pipelines(make_profile: ProfileFactory) -> None:
    # m = 2 doubles the prompt stage (2 layers * 1.5 s * 2 = 6 s); a token step is 2 * 0.5 = 1 s.
    # Prompt pipeline (1 slot): P0 [0,6], P1 [6,12]. Token pipeline: mb0 [6,7] [7,8]; mb1 [12,13] [13,14].
    cost = CostModel(make_profile(m=2.0))
    deployment = Deployment(Policy.DEJAVU, 1, 1, token_depth=1)
    result = simulate(deployment, Trace.of([(0, 10, 3), (0, 10, 3)]), cost)
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == [(6.0, 8.0), (12.0, 14.0)]
    assert result.makespan_s == pytest.approx(14.0)
    assert result.cost(price_per_machine_hour=3600.0) == pytest.approx(2 * 14.0)


def test_dejavu_prompts_run_ahead_by_at_most_the_prompt_depth(make_profile: ProfileFactory) -> None:
    # As the controller's bound D_p + D_t = 2: prompt 3 s, token step 1 s, 4 token steps per request.
    # P0 [0,3]; P1 [3,6] (2 outstanding: mb0 tokens, mb1 prompt); mb0 tokens [3,7]; P2 may start only
    # when mb0 retires at 7: [7,10]. mb1 tokens [7,11]; mb2 tokens [11,15].
    cost = CostModel(make_profile())
    deployment = Deployment(Policy.DEJAVU, 1, 1, token_depth=1)
    result = simulate(deployment, Trace.of([(0, 10, 5)] * 3), cost, record_timeline=True)
    prompts = [(s.start_s, s.end_s) for s in result.timeline if s.pipeline == "prompt"]
    assert prompts == [(0, 3), (3, 6), (7, 10)]
    assert [r.finish_s for r in result.requests] == [7.0, 11.0, 15.0]


def test_head_runs_on_the_last_stage(make_profile: ProfileFactory) -> None:
    # As test_one_microbatch_two_stages with a 0.25 s head on stage 1: prompt 1.5 + 1.75 = 3.25;
    # token steps 0.5 + 0.75 = 1.25 each -> 3.25 + 2 * 1.25 = 5.75.
    result = simulate(baseline(2), Trace.of([(0, 10, 3)]), CostModel(make_profile(head_s=0.25)), record_timeline=True)
    assert result.makespan_s == pytest.approx(5.75)
    stage1 = [(s.start_s, s.end_s) for s in result.timeline if s.stage == 1]
    assert stage1 == [(1.5, 3.25), (3.75, 4.5), (5.0, 5.75)]


def test_swapping_stretches_token_steps_to_the_transfer(make_profile: ProfileFactory) -> None:
    # 1 stage of 2 layers: prompt 3 s, token 1 s. Swap-in moves 2 layers * 1 B * context at 10 B/s:
    # token step 1 has context 21 -> 4.2 s, step 2 context 22 -> 4.4 s. Finish 3 + 4.2 + 4.4 = 11.6.
    cost = CostModel(make_profile(bandwidth=10.0))
    trace = Trace.of([(0, 20, 3)])
    assert simulate(baseline(1), trace, cost).makespan_s == pytest.approx(5.0)
    assert simulate(baseline(1, swap=True), trace, cost).makespan_s == pytest.approx(11.6)


def test_arrivals_and_latency(make_profile: ProfileFactory) -> None:
    # A request arriving at 100 on an idle single stage: finishes at 100 + 3 + 1.
    cost = CostModel(make_profile())
    result = simulate(baseline(1), Trace.of([(100, 10, 2)]), cost)
    (r,) = result.requests
    assert (r.latency_s, r.normalized_latency_s) == (pytest.approx(4.0), pytest.approx(2.0))


@pytest.mark.parametrize(
    ("batch_wait_s", "finishes"),
    [
        # No wait: r0 forms alone at 0: prompt [0, 3], token [3, 4]; r1 takes the slot at 4: [4, 7], [7, 8].
        (0.0, [4.0, 8.0]),
        # r0's wait runs out at 0.2, before r1 arrives: r0 alone [0.2, 3.2], [3.2, 4.2]; r1 [4.2, 8.2].
        (0.2, [4.2, 8.2]),
        # r1 arrives at 0.3, inside r0's wait: the microbatch is full then, and both run [0.3, 4.3].
        (0.5, [4.3, 4.3]),
    ],
)
def test_partial_microbatch_waits_for_batch_wait(
    make_profile: ProfileFactory, batch_wait_s: float, finishes: list[float]
) -> None:
    # One stage of 2 layers (prompt 3 s, token 1 s), microbatch 2, one slot; r0 at 0, r1 at 0.3, 2 tokens each.
    trace = Trace.of([(0.0, 10, 2), (0.3, 10, 2)])
    result = simulate(baseline(1, b=2), trace, CostModel(make_profile()), batch_wait_s=batch_wait_s)
    assert [r.finish_s for r in result.requests] == [pytest.approx(f) for f in finishes]


def test_a_lone_request_forms_a_microbatch_after_the_wait(make_profile: ProfileFactory) -> None:
    # Microbatch 4 never fills: the lone request starts when its wait ends, for every policy.
    cost = CostModel(make_profile())
    for deployment in (
        baseline(1, b=4),
        Deployment(Policy.FASTER_TRANSFORMER, 1, 4),
        Deployment(Policy.DEJAVU, 1, 4, token_depth=1),
    ):
        (r,) = simulate(deployment, Trace.of([(1.0, 10, 1)]), cost, batch_wait_s=0.25).requests
        assert r.first_token_s == pytest.approx(1.25 + 3.0)
    with pytest.raises(ValueError, match="batch_wait_s"):
        simulate(baseline(1), Trace.of([(0.0, 10, 1)]), cost, batch_wait_s=-1.0)


def _period(deployment: Deployment, cost: CostModel, per_wave: int, waves: tuple[int, int], new: int) -> float:
    """Seconds per microbatch in steady state: makespan growth between two backlog sizes."""
    spans = [simulate(deployment, uniform_trace(per_wave * w, 100, new), cost).makespan_s for w in waves]
    return (spans[1] - spans[0]) / ((waves[1] - waves[0]) * per_wave / deployment.microbatch)


@pytest.mark.parametrize("depth", [2, 3, 4, 6])
def test_baseline_steady_state_matches_eq3(make_profile: ProfileFactory, depth: int) -> None:
    cost = CostModel(make_profile(layers=12, prompt_layer_s=0.25, token_layer_s=0.025))
    N = 20
    measured = _period(baseline(depth, b=2), cost, per_wave=2 * depth, waves=(3, 5), new=N + 1)
    Y, t = cost.prompt_time_at(depth, 2, 100), cost.token_time_at(depth, 2)
    assert measured == pytest.approx(formulas.baseline_inverse_throughput(depth, Y, t, N), rel=1e-9)


@pytest.mark.parametrize(("d_p", "d_t", "m"), [(1, 3, 1.0), (2, 2, 1.0), (3, 1, 1.0), (1, 3, 1.5)])
def test_dejavu_steady_state_matches_max_of_pipelines(
    make_profile: ProfileFactory, d_p: int, d_t: int, m: float
) -> None:
    cost = CostModel(make_profile(layers=12, prompt_layer_s=0.25, token_layer_s=0.025, m=m))
    N, D = 20, d_p + d_t
    deployment = Deployment(Policy.DEJAVU, d_p, 1, token_depth=d_t)
    measured = _period(deployment, cost, per_wave=12, waves=(4, 16), new=N + 1)
    Y, t = cost.prompt_time_at(D, 1, 100), cost.token_time_at(D, 1)
    # Not exact: when prompts bind, the last microbatch's token latency depends on how it overlaps
    # its predecessor in the token pipeline (one stage time at most), spread over 144 microbatches.
    assert measured == pytest.approx(formulas.disaggregated_inverse_throughput(D, d_p, d_t, Y, t, N, m), rel=1e-3)


def test_data_parallel_replicas_share_the_queue(make_profile: ProfileFactory) -> None:
    cost = CostModel(make_profile(layers=12))
    trace = uniform_trace(24, 100, 11)
    one = simulate(baseline(2), trace, cost)
    two = simulate(baseline(2, replicas=2), trace, cost)
    assert two.makespan_s == pytest.approx(one.makespan_s / 2, rel=0.05)
    assert two.deployment.machines == 4


def test_every_request_finishes_once_after_its_first_token(make_profile: ProfileFactory) -> None:
    cost = CostModel(make_profile(layers=12))
    trace = lmsys_like_trace(200, 50, median_new=20, max_new=100, rate_per_s=5.0, seed=4)
    for deployment in (
        Deployment(Policy.FASTER_TRANSFORMER, 4, 4),
        baseline(4, b=4),
        baseline(2, b=4, replicas=2),
        Deployment(Policy.DEJAVU, 1, 4, token_depth=3),
    ):
        result = simulate(deployment, trace, cost)
        assert [r.rid for r in result.requests] == list(range(200))
        assert all(r.arrival_s < r.first_token_s <= r.finish_s for r in result.requests)
        assert result.makespan_s == max(r.finish_s for r in result.requests)
