"""The planner sizes the token budget of a pass: the rule on synthetic profiles (the target, the prefill knee, the
smallest legal budget with a warning), the shipped profile's default, the cost it uses against the pass the policy
really schedules, and the budget reaching the settings `dejavu up` starts with (an explicit one winning)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dejavu_cli.commands import plan, simulate, up
from dejavu_common.sched import BlockBook, Budget, RequestState, Scheduler
from dejavu_common.settings import PlannerSettings
from dejavu_planner.budget import pass_stage_time
from dejavu_planner.costmodel import CostModel
from dejavu_planner.planner import plan_runtime
from dejavu_planner.profile import Profile
from dejavu_planner.table import Curve, Grid
from dejavu_planner.tokenbudget import Bound, full_pass_time, prefill_knee, size_token_budget
from dejavu_planner.workload import Workload

SHIPPED = "smollm2-135m-cpu-1thread"


def curve_profile(
    lengths: tuple[int, ...], prompt_s: tuple[float, ...], token_s: float = 0.1, head_s: float | None = None, layers=1
) -> Profile:
    """A whole-model profile (``measured_depth`` 1) whose one-prompt times at ``lengths`` are ``prompt_s``, whose
    token step costs ``token_s`` whatever its rows, and whose head (apart when given) ``head_s``."""
    return Profile(
        model="synthetic",
        hardware="synthetic",
        layers=layers,
        weight_bytes_per_layer=1,
        kv_bytes_per_token_per_layer=1,
        machine_memory_bytes=10**12,
        measured_depth=1,
        prompt_time=Grid((1.0,), tuple(float(n) for n in lengths), (prompt_s,)),
        token_time=Curve((1.0,), (token_s,)),
        head_time=None if head_s is None else Curve((1.0,), (head_s,)),
        source="unit test",
    )


def linear_profile(fixed_s: float = 1.0, per_position_s: float = 0.001, **kwargs) -> Profile:
    """Prompt time ``fixed_s + per_position_s * n``: throughput still gains over 5% a doubling at 1,024 (no knee)."""
    lengths = (16, 64, 256, 1024)
    return curve_profile(lengths, tuple(fixed_s + per_position_s * n for n in lengths), **kwargs)


def knee_profile(rates: tuple[float, ...] = (100, 150, 200, 205, 206)) -> Profile:
    """Prefill throughput (positions a second) at 32, 64, 128, 256, 512: +50%, +33%, +2.5%, +0.5% a doubling."""
    lengths = (32, 64, 128, 256, 512)
    return curve_profile(lengths, tuple(n / r for n, r in zip(lengths, rates, strict=True)), token_s=0.01, layers=4)


def test_the_target_picks_the_largest_block_multiple_whose_pass_meets_it() -> None:
    # 4 decodes (0.1 s) and a chunk of B - 4 positions (1 s + 1 ms a position): B - 4 <= 200 meets 1.3 s.
    budget = size_token_budget(CostModel(linear_profile()), depth=1, max_running=4, itl_target_s=1.3)
    assert (budget.tokens, budget.bound, budget.decodes) == (192, Bound.TARGET, 4)
    assert budget.pass_s == pytest.approx(0.1 + 1.0 + 0.188) and budget.next_s == pytest.approx(0.1 + 1.0 + 0.204)
    assert budget.warning is None and not budget.knee.measured and budget.knee.positions == 1024
    assert "192 positions" in budget.why() and "208 positions would take 1304 ms" in budget.why()


def test_budgets_grow_with_the_target_and_each_is_the_largest_that_meets_it() -> None:
    cost = CostModel(linear_profile(head_s=0.05, layers=4))
    chosen = []
    for target in (1.25, 1.3, 1.5, 2.0, 2.5, 3.0):
        b = size_token_budget(cost, depth=2, max_running=8, itl_target_s=target)
        assert b.tokens % 16 == 0 and b.decodes == 4 and b.bound is Bound.TARGET
        # Two passes in flight: a request waits two passes of the slowest (last: the head) stage between tokens.
        assert b.itl_s == pytest.approx(2 * full_pass_time(cost, 2, 4, b.tokens - 4)) and b.itl_s <= target
        assert 2 * full_pass_time(cost, 2, 4, b.tokens + 16 - 4) > target
        chosen.append(b.tokens)
    assert chosen == sorted(chosen) and len(set(chosen)) == len(chosen)


def test_no_more_prompt_positions_a_pass_than_twice_the_knee() -> None:
    profile = knee_profile()
    assert prefill_knee(profile).positions == 128 and prefill_knee(profile).measured
    budget = size_token_budget(CostModel(profile), depth=1, max_running=4, itl_target_s=100.0)
    assert (budget.tokens, budget.bound) == (256, Bound.KNEE)  # 4 decodes + 252 prompt positions <= 2 x 128
    assert "knee is 128 positions" in budget.why()
    # A grid of quadruplings counts per doubling: 32 -> 128 gains 10% a doubling, 128 -> 512 1.6%.
    coarse = curve_profile((32, 128, 512), (32 / 100, 128 / 121, 512 / 125))
    assert prefill_knee(coarse).positions == 128
    # Still gaining at the longest measured prompt: that prompt stands in for the knee.
    assert prefill_knee(knee_profile((100, 150, 200, 300, 450))).positions == 512


def test_a_target_no_budget_meets_gets_the_smallest_legal_budget_and_a_warning() -> None:
    budget = size_token_budget(CostModel(linear_profile()), depth=1, max_running=20, itl_target_s=0.5)
    # 20 decodes and one block of prompt, rounded up to a block: 48.
    assert (budget.tokens, budget.bound) == (48, Bound.MINIMUM)
    assert budget.itl_s > 0.5 and budget.warning is not None and "no token budget meets" in budget.warning
    assert "48 positions" in budget.warning


def test_a_disaggregated_budget_packs_prompts_up_to_the_knee_and_checks_the_decodes_pass() -> None:
    cost = CostModel(knee_profile())
    budget = size_token_budget(cost, depth=2, max_running=64, itl_target_s=0.001, colocated=False)
    # The token pipeline's passes are 32 decodes; prompt passes delay no stream: 2 x the knee.
    assert (budget.tokens, budget.bound, budget.decodes) == (256, Bound.KNEE, 32)
    assert budget.pass_s == pytest.approx(full_pass_time(cost, 2, 32, 0)) and budget.warning is not None
    many = size_token_budget(cost, depth=1, max_running=512, itl_target_s=10.0, colocated=False)
    assert (many.tokens, many.bound, many.warning) == (528, Bound.MINIMUM, None)


def test_bad_sizes_are_refused() -> None:
    cost = CostModel(linear_profile())
    for kwargs in ({"itl_target_s": 0.0}, {"depth": 0}, {"max_running": 0}, {"block_size": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            size_token_budget(cost, **{"depth": 1, "max_running": 4, **kwargs})


def test_the_shipped_profile_gives_the_default_deployment_256() -> None:
    profile = Profile.load(Path(SHIPPED))
    runtime = plan_runtime(1, profile, Workload(1000, 128, 256), microbatch=4, max_running=64)
    b = runtime.budget
    assert runtime.colocated and b.tokens == 256 and b.bound is Bound.TARGET and b.warning is None
    assert b.target_s == PlannerSettings().itl_target_ms / 1000
    assert b.knee.positions == 128 and b.pass_s <= b.target_s < b.next_s
    # A tighter target gives a smaller budget on the same profile.
    assert plan_runtime(1, profile, Workload(1000, 128, 256), 4, max_running=64, itl_target_s=0.8).budget.tokens == 128


def test_the_pass_sized_is_the_pass_the_policy_schedules() -> None:
    cost = CostModel(Profile.load(Path(SHIPPED)))
    b = size_token_budget(cost, depth=1, max_running=64)
    sched = Scheduler(BlockBook(4096, 16, caching=False), Budget(tokens=b.tokens, max_running=65))
    for i in range(64):
        sched.add(RequestState(f"r{i}", [1] * 16, 16, 100))
    while any(r.prefilling for r in sched.running) or sched.waiting:  # every one prefilled: decoding now
        step = sched.schedule()
        sched.update(step, {s.request.request_id: 7 for s in step.slices if s.samples})
    sched.add(RequestState("long", [1] * (b.tokens - 64), b.tokens - 64, 8))
    step = sched.schedule()
    assert step.tokens == b.tokens and sum(s.decode for s in step.slices) == 64
    assert pass_stage_time(cost, cost.layers, step.slices, last=True) == pytest.approx(b.pass_s)


def _up(argv: list[str]):
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return up._settings(parser.parse_args(["up", *argv]))


def test_up_starts_with_the_planned_budget(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _up([])
    assert settings.engine.token_budget == 256
    assert "token budget 256 positions a pass" in capsys.readouterr().err
    monkeypatch.setenv("DEJAVU_PLANNER__ITL_TARGET_MS", "800")
    settings = _up([])
    err = capsys.readouterr().err
    assert settings.engine.token_budget == 128 and "against a target of 800 ms" in err and "warning" not in err
    # What the launcher hands the workers.
    assert settings.to_env()["DEJAVU_ENGINE__TOKEN_BUDGET"] == "128"
    monkeypatch.setenv("DEJAVU_PLANNER__ITL_TARGET_MS", "100")
    assert _up([]).engine.token_budget == 80  # 64 decodes and a block: the smallest legal budget
    assert "warning: no token budget meets" in capsys.readouterr().err


def test_an_explicit_token_budget_overrides_the_planner(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEJAVU_PLANNER__ITL_TARGET_MS", "100")  # the planner would pick 80, with a warning
    monkeypatch.setenv("DEJAVU_ENGINE__TOKEN_BUDGET", "512")
    assert _up([]).engine.token_budget == 512
    err = capsys.readouterr().err
    assert "engine.token_budget = 512 is set and overrides" in err and "warning" not in err
    # A manual layout leaves the budget as configured: the planner does not run.
    monkeypatch.delenv("DEJAVU_ENGINE__TOKEN_BUDGET")
    assert _up(["--colocated"]).engine.token_budget == 256
    assert "token budget" not in capsys.readouterr().err


def test_up_sizes_a_split_for_its_token_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    settings = _up(["--workers", "4"])
    assert (settings.controller.prompt_depth, settings.controller.token_depth) == (3, 1)
    assert settings.engine.token_budget == 256  # 2 x the knee: prompt passes delay no stream
    assert "a token pass of 64 decodes" in capsys.readouterr().err


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command", required=True)
    plan.register(subparsers)
    simulate.register(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_prints_the_runtime_budget_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", SHIPPED, "-D", "1", "--runtime", "--requests", "20", "--json"]
    assert _cli([*argv, "--itl-target-ms", "800"]) == 0
    runtime = json.loads(capsys.readouterr().out)["runtime"]
    assert runtime["token_budget"] == 128 and runtime["bound"] == "target" and runtime["warning"] is None
    assert runtime["pass_ms"] <= 800 and "800 ms" in runtime["why"]
    assert _cli(argv[:-1]) == 0
    assert "dejavu up --workers 1: 1 colocated stage(s); token budget 256 positions" in capsys.readouterr().out


def test_simulate_runs_with_the_planned_budget(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--profile", SHIPPED, "--policy", "baseline", "--batching", "budget", "--requests", "4"]
    argv += ["--synthetic", "uniform", "--prompt-len", "300", "--new-tokens", "4"]
    assert _cli([*argv, "--itl-target-ms", "800"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["deployment"] == "(1p, 8b, 64r, 128t)" and "token budget 128" in out.err
    assert _cli([*argv, "--token-budget", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["deployment"] == "(1p, 8b, 64r, 64t)"
