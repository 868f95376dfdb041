"""The paper's formulas against cases worked by hand (units: GB and seconds, arbitrary but consistent)."""

from __future__ import annotations

import math
import random

import pytest

from dejavu_planner import formulas as f


def test_min_prompt_depth_eq1() -> None:
    # L=64 layers of W0=2 GB with a C0=1 GB prompt KV on M=80 GB machines: ceil(64*3/80) = ceil(2.4) = 3.
    assert f.min_prompt_depth(64, 1, 2, 80) == 3
    # Exact division: ceil(10*8/40) = 2.
    assert f.min_prompt_depth(10, 3, 5, 40) == 2
    # One layer plus its prompt KV (9 GB) exceeds an 8 GB machine: no depth works.
    assert f.min_prompt_depth(10, 4, 5, 8) is None


def test_min_token_depth_eq2() -> None:
    # M - L(C0+K0) = 80 - 64*0.5 = 48 GB left for weights; D_t >= 64*2/48 = 8/3.
    assert f.min_token_depth(64, 0.25, 0.25, 2, 80) == pytest.approx(8 / 3)
    # The KV of all in-flight microbatches alone fills the machine: L(C0+K0) = 64*1.25 = 80 = M.
    assert f.min_token_depth(64, 1, 0.25, 2, 80) is None
    assert f.min_token_depth(64, 1, 1, 2, 80) is None


def test_baseline_inverse_throughput_eq3() -> None:
    # D=4, Y=10, t=1, N=100: (3*9)/4 + 10 + 100 = 116.75.
    assert f.baseline_inverse_throughput(4, 10, 1, 100) == pytest.approx(116.75)
    # One stage has no bubble: Y + N t.
    assert f.baseline_inverse_throughput(1, 10, 1, 100) == pytest.approx(110)


def test_pipeline_inverse_throughputs() -> None:
    # I_t = N D t / D_t = 100*4*1/2 = 200; I_p = m D Y / D_p = 1.5*4*10/2 = 30; I_dis = max = 200.
    assert f.token_inverse_throughput(4, 2, 1, 100) == pytest.approx(200)
    assert f.prompt_inverse_throughput(4, 2, 10, 1.5) == pytest.approx(30)
    assert f.disaggregated_inverse_throughput(4, 2, 2, 10, 1, 100, 1.5) == pytest.approx(200)


def test_optimal_split_eq5_eq6_balances_the_pipelines() -> None:
    # D=4, N=100, t=1, m=1, Y=10: D_t = 400/110, D_p = 40/110; both pipelines then take m Y + N t = 110.
    d_t = f.optimal_token_depth(4, 10, 1, 100, 1)
    d_p = f.optimal_prompt_depth(4, 10, 1, 100, 1)
    assert d_t == pytest.approx(400 / 110)
    assert d_p == pytest.approx(40 / 110)
    assert f.token_inverse_throughput(4, d_t, 1, 100) == pytest.approx(110)
    assert f.prompt_inverse_throughput(4, d_p, 10, 1) == pytest.approx(110)


def test_benefit_condition_eq4_matches_direct_comparison() -> None:
    # m=1, D=4: threshold (D-1)/(D(2-m)-1) = 3/3 = 1; Y/t = 10 beats it, and indeed 110 < 116.75.
    assert f.benefit_threshold(4, 1.0) == pytest.approx(1.0)
    assert f.disaggregation_beneficial(4, 10, 1, 1.0)
    # m=1.5, D=4: threshold 3/(4*0.5-1) = 3.
    assert f.benefit_threshold(4, 1.5) == pytest.approx(3.0)
    # Y/t = 2 < 3: I_c = 3*1/4 + 2 + 10 = 12.75 < I_dis = 1.5*2 + 10 = 13 (N=10).
    assert not f.disaggregation_beneficial(4, 2, 1, 1.5)
    assert f.baseline_inverse_throughput(4, 2, 1, 10) < 1.5 * 2 + 10
    # Y/t = 4 > 3: I_c = 3*3/4 + 4 + 10 = 16.25 > I_dis = 6 + 10 = 16.
    assert f.disaggregation_beneficial(4, 4, 1, 1.5)
    assert f.baseline_inverse_throughput(4, 4, 1, 10) > 1.5 * 4 + 10


@pytest.mark.parametrize("m", [2.0, 2.5, 1.8, 1.75])
def test_no_benefit_once_denominator_is_not_positive(m: float) -> None:
    # D(2-m)-1 <= 0 for m >= 2 - 1/D = 1.75 (D=4): the paper's "m >= 2" is not even needed.
    # E.g. m=1.8, Y=100, t=1, N=10: I_c = 3*99/4 + 100 + 10 = 184.25 < I_dis = 180 + 10 = 190.
    assert f.benefit_threshold(4, m) is None
    assert not f.disaggregation_beneficial(4, 100, 1, m)
    assert f.baseline_inverse_throughput(4, 100, 1, 10) < m * 100 + 10


def test_benefit_condition_agrees_with_formulas_everywhere() -> None:
    rng = random.Random(7)
    for _ in range(500):
        D, Y, t, N, m = (
            rng.randint(2, 32),
            rng.uniform(0.01, 50),
            rng.uniform(0.01, 5),
            rng.uniform(1, 500),
            rng.uniform(1, 2.5),
        )
        at_optimum = m * Y + N * t  # I_t = I_p at the continuous optimum
        baseline = f.baseline_inverse_throughput(D, Y, t, N)
        if not math.isclose(at_optimum, baseline, rel_tol=1e-9):
            assert f.disaggregation_beneficial(D, Y, t, m) == (at_optimum < baseline)


def test_integer_split_rounds_down_or_up() -> None:
    # D=10, Y=1, t=1, N=3, m=1: D_t = 30/4 = 7.5. D_t=7: max(30/7, 10/3) = 4.29; D_t=8: max(3.75, 5) = 5 -> (3, 7).
    assert f.integer_split(10, 1, 1, 3, 1) == (3, 7)
    # N=2.2: D_t = 22/3.2 = 6.875. D_t=6: max(3.67, 2.5) = 3.67; D_t=7: max(3.14, 3.33) = 3.33 -> (3, 7).
    assert f.integer_split(10, 1, 1, 2.2, 1) == (3, 7)


def test_integer_split_respects_memory_minima() -> None:
    # Continuous optimum 6.875 tokens stages, but the prompt pipeline needs >= 4 machines: (4, 6).
    assert f.integer_split(10, 1, 1, 2.2, 1, min_prompt=4) == (4, 6)
    # D=4, Y=10, t=1, N=100: D_t = 3.64 -> ceil 4 leaves no prompt stage, so it clamps to 3: (1, 3).
    assert f.integer_split(4, 10, 1, 100, 1) == (1, 3)
    # Minima that need more than D machines: infeasible.
    assert f.integer_split(4, 10, 1, 100, 1, min_prompt=2, min_token=3) is None


def test_integer_split_is_the_exhaustive_optimum() -> None:
    rng = random.Random(3)
    for _ in range(300):
        D = rng.randint(2, 24)
        Y, t, N, m = rng.uniform(0.1, 20), rng.uniform(0.01, 2), rng.uniform(0, 400), rng.uniform(1, 3)
        min_p, min_t = rng.randint(1, 4), rng.randint(1, 6)
        split = f.integer_split(D, Y, t, N, m, min_p, min_t)
        feasible = [(D - dt, dt) for dt in range(min_t, D - min_p + 1)]
        if not feasible:
            assert split is None
            continue
        best = min(f.disaggregated_inverse_throughput(D, p, q, Y, t, N, m) for p, q in feasible)
        assert split is not None
        assert f.disaggregated_inverse_throughput(D, *split, Y, t, N, m) == pytest.approx(best)


def test_domain_errors() -> None:
    for call in (
        lambda: f.baseline_inverse_throughput(0, 1, 1, 1),
        lambda: f.baseline_inverse_throughput(2, 1, 1, -1),
        lambda: f.optimal_token_depth(4, 0, 1, 1, 1),
        lambda: f.min_token_depth(0, 1, 1, 1, 1),
        lambda: f.benefit_threshold(4, 0),
    ):
        with pytest.raises(ValueError):
            call()
