"""The planner's search, its explanations and the controller's split_workers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dejavu_planner import formulas
from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Batching
from dejavu_planner.planner import Planner, split_workers
from dejavu_planner.profile import Profile
from dejavu_planner.trace import lmsys_like_trace
from dejavu_planner.workload import Workload

ProfileFactory = Callable[..., Profile]


def test_split_workers_matches_the_rounded_optimum(make_profile: ProfileFactory) -> None:
    profile = make_profile(layers=24, prompt_layer_s=0.25, token_layer_s=0.01)
    workload = Workload(prompt_len=100, mean_new_tokens=51, max_new_tokens=200)
    cost = CostModel(profile)
    for n in (2, 3, 5, 8, 12):
        d_p, d_t, why = split_workers(n, profile, workload, batching=Batching.MICROBATCH)
        Y, t = cost.prompt_time_at(n, 1, 100), cost.token_time_at(n, 1)
        assert (d_p, d_t) == formulas.integer_split(n, Y, t, 50, 1.0)
        assert "binds" in why


def test_split_workers_respects_token_memory(make_profile: ProfileFactory) -> None:
    # 24 layers; 20 B of KV per token per layer and 100 + 200 positions: 6,000 B per layer per
    # microbatch. A token pipeline of any depth holds L (C0 + K0) = 24 * 6,000 = 144,000 B per stage
    # (Eq. 2's denominator M - L(C0+K0) < 0 with M = 16,000), so no split fits.
    profile = make_profile(layers=24, weight_bytes=100, kv_bytes=20, memory=16_000)
    workload = Workload(prompt_len=100, mean_new_tokens=100, max_new_tokens=200)
    with pytest.raises(ValueError, match="nothing fits"):
        split_workers(4, profile, workload)
    with pytest.raises(ValueError, match="at least 2"):
        split_workers(1, profile, workload)


def test_memory_moves_the_split_away_from_the_optimum(make_profile: ProfileFactory) -> None:
    # Weights 1,000 B per layer, 12 layers, memory 4,500 B, KV negligible (1 B per token per layer,
    # 10-token contexts): a prompt or token stage needs ceil(12/d) * ~1,000 B, so both need d >= 3
    # (4 layers: 4,000 + KV). Prompt-heavy times put the continuous optimum at D_t ~ 1, so with 6
    # machines the only feasible split is (3, 3).
    profile = make_profile(
        layers=12, weight_bytes=1000, kv_bytes=1, memory=4500, prompt_layer_s=1.0, token_layer_s=0.001
    )
    workload = Workload(prompt_len=5, mean_new_tokens=3, max_new_tokens=5)
    d_p, d_t, why = split_workers(6, profile, workload, batching=Batching.MICROBATCH)
    assert (d_p, d_t) == (3, 3)
    assert "does not fit memory" in why


def test_plan_reproduces_the_papers_opt66b_table() -> None:
    # Appendix C, OPT-66B on 2xA100-80GB, prompt 1000 tokens, LMSys lengths. With our hand-written
    # profile the formulas pick the paper's configurations where the paper's table is memory-bound
    # or balanced: 1 machine (1p, 4b); DejaVu on 2, 8 and 16 machines.
    profile = Profile.load(Path("opt66b-2xa100-80gb"))
    workload = Workload.from_trace(lmsys_like_trace(2000, 1000, seed=1))
    planner = Planner(profile, workload)
    one = planner.plan(1)
    assert one.policies[0].best is not None and one.policies[0].best.deployment.notation() == "(1p, 4b)"
    assert "memory binds" in one.policies[0].explanation
    assert one.policies[1].best is None and one.policies[2].best is None
    expected = {2: "((1p, 4b), (1p, 4b))", 8: "((3p, 16b), (5p, 16b))", 16: "((6p, 16b), (10p, 16b))"}
    for machines, notation in expected.items():
        dejavu = planner.plan(machines).policies[2]
        assert dejavu.best is not None and dejavu.best.deployment.notation() == notation


def test_plan_with_a_trace_ranks_by_simulated_makespan(make_profile: ProfileFactory) -> None:
    profile = make_profile(layers=12, prompt_layer_s=0.05, token_layer_s=0.002)
    trace = lmsys_like_trace(60, 100, median_new=20, max_new=80, seed=2)
    plan = Planner(profile, Workload.from_trace(trace), (1, 4)).plan(4, trace=trace)
    for policy in plan.policies:
        assert policy.best is not None and policy.best.makespan_s is not None
    report = plan.report()
    assert "Baseline-DP" in report and "DejaVu" in report and "makespan" in report


def test_swap_admits_larger_microbatches(make_profile: ProfileFactory) -> None:
    # 4 layers of 10 B, memory 500 B, 50-token contexts at 1 B: b microbatch rows cost 50 b B per layer.
    # Depth 4, no swap: 10 + 4*50 b <= 500 -> b <= 2. With swap (2 resident): 10 + 2*50 b -> b <= 4.
    profile = make_profile(layers=4, weight_bytes=10, kv_bytes=1, memory=500, bandwidth=1e12)
    workload = Workload(prompt_len=25, mean_new_tokens=20, max_new_tokens=25)
    planner = Planner(profile, workload, (1, 2, 4, 8))
    assert max(c.deployment.microbatch for c in planner.baseline(4)) == 2
    assert max(c.deployment.microbatch for c in planner.baseline(4, swap=True)) == 4


def test_swap_costs_the_transfer_and_needs_a_bandwidth(make_profile: ProfileFactory) -> None:
    # 4 layers, depth 4: one layer per stage; Y = 1.5 s, compute t = 0.5 s. Swapping b=2 rows at the
    # mean context 25 + 20/2 = 35 positions, 1 B each, at 1 B/s takes 70 s: t becomes max(0.5, 70) = 70.
    slow = make_profile(layers=4, weight_bytes=10, kv_bytes=1, memory=10**6, bandwidth=1.0)
    workload = Workload(prompt_len=25, mean_new_tokens=20, max_new_tokens=25)
    planner = Planner(slow, workload, (2,))
    (swapped,) = planner.baseline(4, swap=True)
    assert swapped.inverse_throughput_s == pytest.approx(formulas.baseline_inverse_throughput(4, 1.5, 70.0, 19))
    with pytest.raises(ValueError, match="cannot swap"):
        Planner(make_profile(), workload).plan(2, swap=True)


def test_planner_and_simulator_do_not_import_torch() -> None:
    code = (
        "import sys; import dejavu_planner.planner, dejavu_planner.simulator, dejavu_planner.plots; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0
