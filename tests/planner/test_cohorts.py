"""The serving runtime's cohort policy in the simulator: hand-worked traces, invariants, steady state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dejavu_planner import formulas
from dejavu_planner.cohorts import CohortSimulator
from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Batching, Deployment, Policy
from dejavu_planner.planner import Planner, plan_runtime, split_workers
from dejavu_planner.profile import Profile
from dejavu_planner.result import SimResult
from dejavu_planner.simulator import simulate
from dejavu_planner.table import Curve, Grid
from dejavu_planner.trace import Trace, lmsys_like_trace, uniform_trace
from dejavu_planner.workload import Workload

ProfileFactory = Callable[..., Profile]

# The toy profile (conftest) with its 2 layers on one stage: a prompt takes 3 s and a token pass 1 s,
# whatever the rows, so the hand-worked times below only follow the policy.


def dejavu(b: int = 1, d_p: int = 1, d_t: int = 1, max_running: int = 64, swap: bool = False) -> Deployment:
    return Deployment(
        Policy.DEJAVU, d_p, b, token_depth=d_t, swap=swap, batching=Batching.COHORT, max_running=max_running
    )


def colocated(depth: int = 1, b: int = 1, max_running: int = 64) -> Deployment:
    return Deployment(Policy.BASELINE, depth, b, batching=Batching.COHORT, max_running=max_running)


def times(result: SimResult) -> list[tuple[float, float]]:
    return [(r.first_token_s, r.finish_s) for r in result.requests]


def token_passes(result: SimResult, pipeline: str = "token", stage: int = 0) -> list[tuple[float, float, int]]:
    return [(s.start_s, s.end_s, s.rows) for s in result.timeline if s.pipeline == pipeline and s.stage == stage]


def test_a_request_arriving_mid_generation_joins_at_the_next_step_boundary(make_profile: ProfileFactory) -> None:
    # r0 (0 s, 10 tokens): prompt [0, 3], then 9 token passes [3, 12]. r1 arrives at 1 s; the prompt
    # stage is free at 3: prompt [3, 6]. At the step boundary at 6 r1 joins r0's cohort: passes [6, 7]
    # and [7, 8] give its 2nd and 3rd tokens. r0 is not held up (a pass costs the same for 1 or 2 rows).
    result = simulate(dejavu(), Trace.of([(0, 10, 10), (1, 10, 3)]), CostModel(make_profile()), record_timeline=True)
    assert times(result) == [(3.0, 12.0), (6.0, 8.0)]
    assert (6.0, 7.0, 2) in token_passes(result) and (5.0, 6.0, 1) in token_passes(result)
    # The paper's microbatch policy: r1 waits for the token pipeline's one slot until r0 ends at 12.
    paper = simulate(Deployment(Policy.DEJAVU, 1, 1, token_depth=1), Trace.of([(0, 10, 10), (1, 10, 3)]),
                     CostModel(make_profile()))  # fmt: skip
    assert times(paper) == [(3.0, 12.0), (6.0, 14.0)]


def test_a_burst_gets_lower_ttft_than_with_microbatches(make_profile: ProfileFactory) -> None:
    # 6 requests at once, then 6 more at 20 s; 1 prompt + 1 token stage, b = 1. With microbatches
    # a prompt may run ahead of the single token slot by one microbatch, so each burst queues behind
    # whole generations; with cohorts every prompt runs back to back (3 s each) and joins at once.
    trace = Trace.of([(0, 10, 8)] * 6 + [(20, 10, 8)] * 6)
    cost = CostModel(make_profile())
    cohorts = simulate(dejavu(), trace, cost)
    paper = simulate(Deployment(Policy.DEJAVU, 1, 1, token_depth=1), trace, cost)
    assert [r.first_token_s for r in cohorts.requests[:6]] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]

    def ttft(result: SimResult) -> float:
        return sum(r.first_token_s - r.arrival_s for r in result.requests) / len(result.requests)

    assert ttft(cohorts) < ttft(paper) / 2
    assert all(c.first_token_s <= p.first_token_s for c, p in zip(cohorts.requests, paper.requests, strict=True))
    assert cohorts.makespan_s < paper.makespan_s


def test_a_finished_microbatch_frees_its_rows_at_once_and_finished_rows_stop_being_computed(
    make_profile: ProfileFactory,
) -> None:
    # max_running 2: one cohort of up to 2 rows; the controller dispatches up to 2 + 1·2 = 4 requests.
    # Microbatch A = {r0: 1 token, r1: 6 tokens}, B = {r2, r3: 2 tokens}, all at 0 (both form at once).
    # A: prompt [0, 3] (r0 ends there), then 5 passes [3, 8] computing r1's row only, as the runtime
    # does. B: prompt [3, 6], waits (its 2 rows do not fit beside r1's under the cap of 2) and joins the
    # moment A leaves: pass [8, 9] of 2 rows.
    trace = Trace.of([(0, 10, 1), (0, 10, 6), (0, 10, 2), (0, 10, 2)])
    result = simulate(dejavu(b=2, max_running=2), trace, CostModel(make_profile()), record_timeline=True)
    assert times(result) == [(3.0, 3.0), (3.0, 8.0), (6.0, 9.0), (6.0, 9.0)]
    assert token_passes(result) == [(3.0 + k, 4.0 + k, 1) for k in range(5)] + [(8.0, 9.0, 2)]


def test_dispatch_waits_for_unfinished_requests(make_profile: ProfileFactory) -> None:
    # max_running 1, b = 1: the controller keeps at most 1 + 1 requests dispatched. r0 (6 tokens) and r1
    # (2 tokens) form at 0; r1's prompt [3, 6] is done while r0 fills the cohort's one row, so r1 joins
    # when r0 leaves at 8: pass [8, 9]. r2 forms only when r0 finishes (8): prompt [8, 11], pass [11, 12].
    trace = Trace.of([(0, 10, 6), (0, 10, 2), (0, 10, 2)])
    result = simulate(dejavu(max_running=1), trace, CostModel(make_profile()), record_timeline=True)
    assert times(result) == [(3.0, 8.0), (6.0, 9.0), (11.0, 12.0)]
    assert [(s.start_s, s.end_s) for s in result.timeline if s.pipeline == "prompt"] == [(0, 3), (3, 6), (8, 11)]


@pytest.mark.parametrize(("d_t", "max_running", "b"), [(1, 8, 2), (2, 8, 2), (3, 10, 3), (2, 5, 1)])
def test_the_row_cap_per_cohort_holds_and_cohorts_balance(
    make_profile: ProfileFactory, d_t: int, max_running: int, b: int
) -> None:
    trace = lmsys_like_trace(120, 20, median_new=12, max_new=40, rate_per_s=4.0, seed=3)
    deployment = dejavu(b=b, d_t=d_t, max_running=max_running)
    result = simulate(deployment, trace, CostModel(make_profile(layers=6)), record_timeline=True)
    passes = token_passes(result)
    cap = -(-max_running // d_t)
    assert deployment.cohort_rows == cap
    # Microbatches join whole (partial ones too: no batch wait here), up to the cap, which the busy
    # cohorts come within one microbatch of.
    assert cap - b < max(rows for *_, rows in passes) <= cap
    by_cohort = {s.microbatch for s in result.timeline if s.pipeline == "token"}
    assert by_cohort == set(range(d_t))  # every cohort got work
    assert [r.rid for r in result.requests] == list(range(120))
    assert all(r.arrival_s < r.first_token_s <= r.finish_s for r in result.requests)


def test_each_member_beyond_the_first_costs_the_profiles_member_time(
    make_profile: ProfileFactory, tmp_path: Path
) -> None:
    # 0.1 s per extra member for the whole model (2 layers): 0.05 s per layer. A pass of 3 members on
    # the one stage: 1 s of rows + 2 · 0.1 s.
    profile = make_profile(member_s=0.1)
    cost = CostModel(profile)
    assert cost.cohort_step_time(2, [(1, 10), (2, 10), (1, 10)]) == pytest.approx(1.2)
    assert cost.cohort_step_time(1, [(4, 10)]) == pytest.approx(0.5)
    # As the first test: r1 joins at 6, and the two passes of both members take 1.1 s each.
    result = simulate(dejavu(), Trace.of([(0, 10, 10), (1, 10, 3)]), cost)
    assert [(a, pytest.approx(b)) for a, b in times(result)] == [(3.0, 12.2), (6.0, 8.2)]
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    legacy = profile.to_json()
    del legacy["member_time_s"]
    assert Profile.from_json(legacy).member_time == 0.0
    with pytest.raises(ValueError, match="member_time"):
        make_profile(member_s=-1.0)


def test_with_swapping_a_cohort_holds_one_microbatch(make_profile: ProfileFactory) -> None:
    trace = uniform_trace(12, 10, 5)
    cost = CostModel(make_profile(layers=4, bandwidth=1e9))
    result = simulate(dejavu(b=2, d_t=2, swap=True), trace, cost, record_timeline=True)
    assert {rows for *_, rows in token_passes(result)} == {2}


def test_colocated_cohorts_interleave_prefills_with_token_passes(make_profile: ProfileFactory) -> None:
    # One colocated stage: r0 (0 s, 5 tokens) prefill [0, 3]; r1 (1 s, 3 tokens) was formed meanwhile, so
    # at the boundary at 3 the cohort prefills r1 [3, 6] (r0 skips that pass); then both decode: [6, 7]
    # and [7, 8] end r1, [8, 9] and [9, 10] end r0.
    result = simulate(colocated(), Trace.of([(0, 10, 5), (1, 10, 3)]), CostModel(make_profile()), record_timeline=True)
    assert times(result) == [(3.0, 10.0), (6.0, 8.0)]
    assert token_passes(result, "pipeline0") == [(0, 3, 1), (3, 6, 1), (6, 7, 2), (7, 8, 2), (8, 9, 1), (9, 10, 1)]


def test_results_are_deterministic(make_profile: ProfileFactory) -> None:
    trace = lmsys_like_trace(150, 30, median_new=15, max_new=60, rate_per_s=3.0, seed=9)
    cost = CostModel(make_profile(layers=6))
    for deployment in (dejavu(b=2, d_p=2, d_t=3, max_running=12), colocated(depth=3, b=2, max_running=12)):
        first, second = (simulate(deployment, trace, cost, record_timeline=True, batch_wait_s=0.05) for _ in range(2))
        assert first == second


def test_paper_deployments_are_not_cohorts(make_profile: ProfileFactory) -> None:
    paper = Deployment(Policy.DEJAVU, 1, 4, token_depth=1)
    assert paper.batching is Batching.MICROBATCH
    with pytest.raises(ValueError, match="does not batch in cohorts"):
        CohortSimulator(paper, Trace.of([(0, 10, 2)]), CostModel(make_profile()))
    with pytest.raises(ValueError, match="cohort"):
        Deployment(Policy.FASTER_TRANSFORMER, 2, 4, batching=Batching.COHORT)
    with pytest.raises(ValueError, match="cohort"):
        Deployment(Policy.BASELINE, 2, 4, replicas=2, batching=Batching.COHORT)
    with pytest.raises(ValueError, match="max_running"):
        dejavu(max_running=0)
    assert dejavu(b=4, d_t=3, max_running=64).notation() == "((1p, 4b), (3p, 4b), 64r)"
    assert dejavu(d_t=3).cohort_rows == 22
    # A full cohort holds whole microbatches up to the cap, at least one.
    assert (formulas.cohort_rows(64, 3, 4), formulas.cohort_rows(5, 2, 4), formulas.cohort_rows(8, 1, 1)) == (20, 4, 8)


def _batch_profile(layers: int = 12, member_s: float = 0.0) -> Profile:
    """Token passes cost more with more rows (0.2 s + 0.01 s per row for the whole model, plus ``member_s``
    per cohort member beyond the first); prompts 0.05 s."""
    return Profile(
        model="toy",
        hardware="toy",
        layers=layers,
        weight_bytes_per_layer=1,
        kv_bytes_per_token_per_layer=1,
        machine_memory_bytes=10**12,
        measured_depth=1,
        prompt_time=Grid((1.0, 2.0), (1.0,), ((0.05,), (0.1,))),
        token_time=Curve((1.0, 100.0), (0.21, 1.2)),
        member_time=member_s,
        source="unit test",
    )


@pytest.mark.parametrize(
    ("d_t", "max_running", "b", "member_s"), [(1, 8, 1, 0.0), (2, 8, 2, 0.0), (3, 12, 2, 0.0), (2, 8, 1, 0.03)]
)
def test_steady_state_matches_the_cohort_formula(d_t: int, max_running: int, b: int, member_s: float) -> None:
    # Uniform backlogs: when prompts keep up, every cohort stays full and the token side sets the pace.
    profile = _batch_profile(member_s=member_s)
    planner = Planner(profile, Workload(prompt_len=10, mean_new_tokens=41, max_new_tokens=41), (b,), max_running)
    deployment = dejavu(b=b, d_t=d_t, max_running=max_running)
    cost = CostModel(profile)
    spans = [simulate(deployment, uniform_trace(n, 10, 41), cost).makespan_s for n in (240, 480)]
    measured = (spans[1] - spans[0]) / (240 / b)  # seconds per microbatch
    times = planner.cohort_times(deployment)
    assert times.rows == formulas.cohort_rows(max_running, d_t, b) and times.token_s > times.prompt_s
    assert measured == pytest.approx(times.token_s, rel=0.02)
    assert planner.predict(deployment).inverse_throughput_s == pytest.approx(times.token_s)


# -- the planner's runtime model ------------------------------------------------------------------


def test_split_workers_sizes_the_runtime_by_its_cohorts() -> None:
    # 4 workers, b = 1, N = 40, a prompt 1 s for the whole model, a token pass 0.2 s + 0.01 s per row.
    # The paper's model decodes one request per microbatch step, so tokens bind and Eq. 5 gives D_t = 3.
    # Cohorts of ceil(64 / D_t) rows make tokens cheap: (1, 3) waits on the one prompt stage
    # (I_p = 1 s per request) while (2, 2) balances at I_p = 0.5 s against I_t = 40 · 0.52 / 64 = 0.33 s.
    profile = _batch_profile()
    profile = Profile(**{**profile.__dict__, "prompt_time": Grid((1.0, 2.0), (1.0,), ((1.0,), (2.0,)))})
    workload = Workload(prompt_len=10, mean_new_tokens=41, max_new_tokens=41)
    d_p, d_t, why = split_workers(4, profile, workload)
    assert (d_p, d_t) == (2, 2) and "2 cohort(s) of up to 32 rows" in why and "prompt pipeline (I_p) binds" in why
    assert split_workers(4, profile, workload, batching=Batching.MICROBATCH)[:2] == (1, 3)
    # The simulator agrees that (2, 2) is the faster runtime deployment.
    trace, cost = uniform_trace(120, 10, 41), CostModel(profile)
    spans = {split: simulate(dejavu(d_p=split[0], d_t=split[1]), trace, cost).makespan_s for split in ((1, 3), (2, 2))}
    assert spans[(2, 2)] < spans[(1, 3)]
    # With a trace the best splits are re-ranked by simulated makespan.
    assert split_workers(4, profile, workload, trace=trace)[:2] == (2, 2)


def test_plan_adds_the_runtime_row_when_asked(make_profile: ProfileFactory) -> None:
    profile = make_profile(layers=12, prompt_layer_s=0.05, token_layer_s=0.002)
    trace = lmsys_like_trace(40, 100, median_new=20, max_new=80, seed=2)
    planner = Planner(profile, Workload.from_trace(trace), (1, 4), max_running=16)
    assert [p.name for p in planner.plan(4).policies] == ["Baseline", "Baseline-DP", "DejaVu"]
    plan = planner.plan(4, trace=trace, runtime=True)
    runtime = plan.policies[3]
    assert runtime.name == "DejaVu-runtime" and runtime.best is not None
    assert runtime.best.deployment.cohorts and runtime.best.deployment.max_running == 16
    assert runtime.best.makespan_s is not None and "cohort(s) of up to" in runtime.explanation
    assert "DejaVu-runtime" in plan.report()


def test_runtime_memory_counts_every_dispatched_request(make_profile: ProfileFactory) -> None:
    # 4 layers of 10 B, 1 B of KV per position; prompt 10 + 10 new tokens = 20 positions. D_t = 2 puts 2
    # layers on a token stage, which holds max_running 8 + D_p·b = 10 requests: 2 · (10 + 10 · 20) = 420 B.
    workload = Workload(prompt_len=10, mean_new_tokens=10, max_new_tokens=10)
    deployment = dejavu(b=1, d_p=2, d_t=2, max_running=8)
    assert Planner(make_profile(layers=4, weight_bytes=10, memory=420), workload).fits(deployment)
    assert not Planner(make_profile(layers=4, weight_bytes=10, memory=419), workload).fits(deployment)
    # The smallest need of any split of 4 machines: D_t = 3 (2 layers, 8 + 1 requests), 2 · (10 + 9 · 20) = 380 B.
    assert split_workers(4, make_profile(layers=4, weight_bytes=10, memory=380), workload, max_running=8)[:2] == (1, 3)
    with pytest.raises(ValueError, match="nothing fits 4 machines: a token stage holds the KV of up to 9"):
        split_workers(4, make_profile(layers=4, weight_bytes=10, memory=379), workload, max_running=8)


def test_the_runtime_plan_runs_one_machine_colocated_and_compares_the_modes_on_more() -> None:
    # One machine has nothing to split: its prompt and token workers would share the same cores.
    profile = _batch_profile()
    workload = Workload(prompt_len=10, mean_new_tokens=41, max_new_tokens=41)
    one = plan_runtime(1, profile, workload)
    assert one.colocated and one.token_depth == 1 and "nothing to disaggregate" in one.why
    # On 4 machines the colocated pipeline and every split are compared by their predicted throughput.
    planner = Planner(profile, workload, (1,))
    colocated, split = planner.runtime_colocated(4)[0], planner.runtime(4)[0]
    four = plan_runtime(4, profile, workload)
    best = max((colocated, split), key=lambda c: c.requests_per_s)
    assert four.colocated == (best is colocated)
    assert (four.prompt_depth, four.token_depth) == (
        (0, 4) if four.colocated else (best.deployment.depth, best.deployment.token_depth)
    )
    assert "Predicted" in four.why
