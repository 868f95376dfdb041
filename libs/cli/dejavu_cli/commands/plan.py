"""``dejavu plan``: the best Baseline, Baseline-DP and DejaVu configuration for D machines.

Also defines the profile and workload options that ``dejavu simulate`` shares.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from dejavu_cli.main import CLIError

if TYPE_CHECKING:
    from dejavu_planner.profile import Profile
    from dejavu_planner.trace import Trace


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return values


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", required=True, help="profile JSON file, or a shipped one by name (e.g. opt66b-2xa100-80gb)"
    )
    parser.add_argument("--memory-gib", type=float, help="override the profile's machine memory M (GiB)")
    parser.add_argument("--stream-overhead", type=float, help="override the profile's streaming overhead m")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (a trace file, or a synthetic trace)")
    group.add_argument("--trace", type=Path, help="CSV or JSON trace (arrival_s,prompt_len,new_tokens)")
    group.add_argument(
        "--synthetic", choices=("lmsys", "uniform"), default="lmsys", help="generated lengths when no --trace"
    )
    group.add_argument("--requests", type=int, default=500, help="synthetic: number of requests")
    group.add_argument("--prompt-len", type=int, default=1000, help="synthetic: prompt tokens")
    group.add_argument("--new-tokens", type=int, default=150, help="synthetic: median (lmsys) or exact (uniform)")
    group.add_argument("--max-new", type=int, default=1024, help="synthetic lmsys: longest generation")
    group.add_argument(
        "--same-length-groups", type=int, default=1, help="synthetic lmsys: runs of this many requests share a length"
    )
    group.add_argument("--rate", type=float, help="synthetic: Poisson arrivals per second (default: all at 0)")
    group.add_argument("--seed", type=int, default=0)


def load_profile(args: argparse.Namespace) -> Profile:
    from dejavu_planner.profile import Profile

    try:
        profile = Profile.load(Path(args.profile))
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot load profile {args.profile}: {exc}") from exc
    changes: dict[str, object] = {}
    if args.memory_gib is not None:
        changes["machine_memory_bytes"] = int(args.memory_gib * 2**30)
    if args.stream_overhead is not None:
        changes["stream_overhead"] = args.stream_overhead
    try:
        return dataclasses.replace(profile, **changes)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc


def load_trace(args: argparse.Namespace) -> Trace:
    from dejavu_planner.trace import Trace, lmsys_like_trace, uniform_trace

    try:
        if args.trace is not None:
            return Trace.load(args.trace)
        if args.synthetic == "uniform":
            return uniform_trace(args.requests, args.prompt_len, args.new_tokens, args.rate, args.seed)
        return lmsys_like_trace(
            args.requests,
            args.prompt_len,
            args.new_tokens,
            max_new=args.max_new,
            rate_per_s=args.rate,
            seed=args.seed,
            group=args.same_length_groups,
        )
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot build the trace: {exc}") from exc


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="best pipeline configuration per policy for D machines",
        description="Search Baseline, Baseline-DP and DejaVu configurations (memory-checked, scored by the "
        "paper's formulas; with --simulate re-ranked by simulated makespan over the trace).",
    )
    add_profile_args(parser)
    parser.add_argument("--machines", "-D", type=int, required=True, help="machines available (D)")
    parser.add_argument("--microbatches", type=int_list, default=(1, 2, 4, 8, 16, 32), help="sizes to try")
    parser.add_argument("--swap", action="store_true", help="allow microbatch swapping (larger microbatches)")
    parser.add_argument("--simulate", action="store_true", help="re-rank the best candidates by simulation")
    parser.add_argument(
        "--runtime",
        action="store_true",
        help="also plan the serving runtime's DejaVu (cohort batching), as `dejavu up --planner auto` does",
    )
    parser.add_argument(
        "--max-running", type=int, default=64, help="--runtime: requests decoded at once (controller.max_running)"
    )
    parser.add_argument(
        "--itl-target-ms",
        type=float,
        help="--runtime: inter-token latency the token budget is sized for (default: planner.itl_target_ms)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_workload_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dejavu_planner.planner import Planner
    from dejavu_planner.workload import Workload

    if args.machines < 1:
        raise CLIError("--machines must be >= 1")
    if args.max_running < 1:
        raise CLIError("--max-running must be >= 1")
    profile = load_profile(args)
    trace = load_trace(args)
    planner = Planner(profile, Workload.from_trace(trace), args.microbatches, args.max_running)
    try:
        plan = planner.plan(args.machines, swap=args.swap, trace=trace if args.simulate else None, runtime=args.runtime)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    runtime = _runtime(args, profile, planner.workload) if args.runtime else None
    if not args.json:
        print(f"{profile.model} on {profile.hardware}")
        print(plan.report())
        if runtime is not None:
            print(f"\ndejavu up --workers {args.machines}: {runtime['layout']}; {runtime['why']}")
            if runtime["warning"]:
                print(f"warning: {runtime['warning']}")
        return 0
    rows = []
    for p in plan.policies:
        best = p.best
        rows.append(
            {
                "policy": p.name,
                "configuration": None if best is None else best.deployment.notation(),
                "requests_per_s": None if best is None else best.requests_per_s,
                "makespan_s": None if best is None else best.makespan_s,
                "explanation": p.explanation,
            }
        )
    out = {"machines": args.machines, "policies": rows}
    if runtime is not None:
        out["runtime"] = runtime
    print(json.dumps(out, indent=2))
    return 0


def _runtime(args: argparse.Namespace, profile: Profile, workload) -> dict:
    """What ``dejavu up --workers D`` starts (its layout at the controller's token microbatch) and the token budget
    of its passes, with why: the planner's :func:`plan_runtime` under the current settings."""
    from dejavu_common.settings import Settings
    from dejavu_planner.planner import plan_runtime

    settings = Settings()
    target_ms = settings.planner.itl_target_ms if args.itl_target_ms is None else args.itl_target_ms
    try:
        plan = plan_runtime(
            args.machines,
            profile,
            workload,
            microbatch=settings.controller.token_microbatch,
            swap=args.swap,
            max_running=args.max_running,
            itl_target_s=target_ms / 1000,
            block_size=settings.engine.kv_block_size or 16,
        )
    except ValueError as exc:
        raise CLIError(f"the planner found no configuration for dejavu up: {exc}") from exc
    if plan.colocated:
        layout = f"{plan.token_depth} colocated stage(s)"
    else:
        layout = f"{plan.prompt_depth} prompt + {plan.token_depth} token stages"
    b = plan.budget
    return {
        "layout": layout,
        "colocated": plan.colocated,
        "prompt_depth": plan.prompt_depth,
        "token_depth": plan.token_depth,
        "token_budget": b.tokens,
        "bound": str(b.bound),
        "itl_target_ms": b.target_s * 1000,
        "pass_ms": b.pass_s * 1000,
        "itl_ms": b.itl_s * 1000,
        "prefill_knee": b.knee.positions,
        "why": b.why(),
        "warning": b.warning,
    }
