"""The plan and simulate commands, run in-process through their own parsers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dejavu_cli.commands import plan, simulate
from dejavu_cli.main import CLIError


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command", required=True)
    plan.register(subparsers)
    simulate.register(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_prints_the_three_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["plan", "--profile", "opt66b-2xa100-80gb", "-D", "8", "--requests", "200"]) == 0
    out = capsys.readouterr().out
    assert "Baseline-DP" in out and "((3p, 16b), (5p, 16b))" in out and "binds" in out


def test_plan_json_with_memory_override(capsys: pytest.CaptureFixture[str]) -> None:
    # 100 GiB machines cannot hold OPT-66B's ~123 GiB of weights on one stage: 1 machine fits nothing.
    assert run(["plan", "--profile", "opt66b-2xa100-80gb", "-D", "1", "--memory-gib", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["configuration"] for p in data["policies"]] == [None, None, None]
    assert "nothing fits" in data["policies"][0]["explanation"]


def test_bad_profile_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(CLIError, match="cannot load profile"):
        run(["plan", "--profile", str(tmp_path / "missing.json"), "-D", "2"])


def test_simulate_single_writes_results_and_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--profile", "opt66b-2xa100-80gb", "--policy", "dejavu", "--depth", "2", "--token-depth", "2"]
    argv += ["-b", "2", "--synthetic", "uniform", "--requests", "8", "--new-tokens", "6", "--timeline"]
    assert run([*argv, "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["machines"] == 4 and summary["requests"] == 8
    saved = json.loads((tmp_path / "simulation.json").read_text())
    assert len(saved["per_request"]) == 8
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_sweep_draws_scaling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_len,new_tokens\n" + "".join(f"{i * 0.1},500,{20 + i}\n" for i in range(40)))
    argv = ["simulate", "--profile", "opt66b-2xa100-80gb", "--trace", str(trace), "--sweep", "2,4"]
    assert run([*argv, "--microbatches", "2,8", "--out", str(tmp_path)]) == 0
    points = json.loads((tmp_path / "sweep.json").read_text())
    assert {p["machines"] for p in points} == {2, 4}
    assert {p["policy"] for p in points} == {"Baseline", "Baseline-DP", "DejaVu"}
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "makespan_s" in capsys.readouterr().out


def test_plan_runtime_adds_the_cohort_row(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "smollm2-135m-cpu-1thread", "-D", "3", "--runtime", "--max-running", "32"]
    argv += ["--prompt-len", "256", "--new-tokens", "32", "--max-new", "64", "--requests", "50", "--json"]
    assert run(argv) == 0
    policies = {p["policy"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    assert set(policies) == {"Baseline", "Baseline-DP", "DejaVu", "DejaVu-runtime"}
    assert policies["DejaVu-runtime"]["configuration"].endswith(", 32r)")
    assert "cohort(s) of up to" in policies["DejaVu-runtime"]["explanation"]


def test_simulate_cohort_batching(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--profile", "smollm2-135m-cpu-1thread", "--policy", "dejavu", "-b", "2", "--requests", "12"]
    argv += ["--synthetic", "uniform", "--prompt-len", "64", "--new-tokens", "8", "--batch-wait-ms", "20"]
    assert run([*argv, "--batching", "cohort", "--max-running", "8"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["label"] == "DejaVu-1-1+cohorts" and summary["requests"] == 12
    with pytest.raises(CLIError, match="cohort"):
        run([*argv, "--policy", "ft", "--batching", "cohort"])


def test_up_planner_auto_sizes_the_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    from dejavu_cli.commands import up

    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    args = parser.parse_args(["up", "--planner", "auto", "--workers", "4", "--token-microbatch", "8"])
    controller = up._settings(args).controller
    assert controller.prompt_depth + controller.token_depth == 4 and controller.planner == "auto"
    why = capsys.readouterr().err
    assert "cohort(s) of up to" in why and f"max_running {controller.max_running}" in why and "of 8)" in why


def test_up_without_a_layout_runs_what_the_planner_picks_for_this_host(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dejavu_cli.commands import up
    from dejavu_common.settings import Mode

    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    controller = up._settings(parser.parse_args(["up"])).controller
    assert controller.mode is Mode.COLOCATED and controller.token_depth == 1 and controller.planner == "auto"
    assert "one machine: nothing to disaggregate" in capsys.readouterr().err
    # A layout given on the command line or in the environment is kept as given.
    manual = up._settings(parser.parse_args(["up", "--token-depth", "2"])).controller
    assert (manual.mode, manual.token_depth, manual.planner) == (Mode.DISAGGREGATED, 2, "manual")
    monkeypatch.setenv("DEJAVU_CONTROLLER__PROMPT_DEPTH", "2")
    manual = up._settings(parser.parse_args(["up"])).controller
    assert (manual.mode, manual.prompt_depth, manual.planner) == (Mode.DISAGGREGATED, 2, "manual")
    with pytest.raises(CLIError, match="drop --colocated"):
        up._settings(parser.parse_args(["up", "--planner", "auto", "--colocated"]))
