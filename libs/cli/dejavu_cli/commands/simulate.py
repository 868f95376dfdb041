"""``dejavu simulate``: one deployment over a trace, or a scaling sweep over machine counts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dejavu_cli.commands.plan import add_profile_args, add_workload_args, int_list, load_profile, load_trace
from dejavu_cli.main import CLIError

if TYPE_CHECKING:
    from dejavu_planner.profile import Profile
    from dejavu_planner.trace import Trace


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="discrete-event simulation of ft / baseline / dejavu over a trace",
        description="Simulate one deployment (--policy ...) or sweep machine counts (--sweep 2,4,8), writing "
        "JSON results and PNG figures to --out.",
    )
    add_profile_args(parser)
    parser.add_argument("--policy", choices=("ft", "baseline", "dejavu"), default="dejavu")
    parser.add_argument("--depth", type=int, default=1, help="pipeline depth (dejavu: prompt depth D_p)")
    parser.add_argument("--token-depth", type=int, default=1, help="dejavu: token depth D_t")
    parser.add_argument("--replicas", type=int, default=1, help="baseline: data-parallel pipelines")
    parser.add_argument("--microbatch", "-b", type=int, default=8, help="requests per microbatch")
    parser.add_argument("--swap", action="store_true", help="microbatch swapping on token steps")
    parser.add_argument(
        "--batching",
        choices=("microbatch", "cohort", "budget"),
        default="microbatch",
        help="microbatch: the paper's policy; cohort: the serving runtime's (iteration-level batching in D_t "
        "cohorts); budget: per-request passes under a token budget with chunked prefill and a paged KV pool "
        "(dejavu_common.sched); cohort and budget run on dejavu or on baseline with one pipeline",
    )
    parser.add_argument(
        "--max-running", type=int, default=64, help="cohort, budget: requests decoded at once (controller.max_running)"
    )
    parser.add_argument(
        "--token-budget",
        type=int,
        help="budget: positions one pass computes at most (default: what the planner sizes for --itl-target-ms)",
    )
    parser.add_argument(
        "--itl-target-ms",
        type=float,
        help="budget: inter-token latency the planner sizes the token budget for (default: planner.itl_target_ms)",
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=0, help="budget: KV blocks of 16 positions per stage (0: from the profile)"
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=0.0,
        help="a partial microbatch forms once its oldest request waited this long (the controller's batch_wait_ms)",
    )
    parser.add_argument("--sweep", type=int_list, help="instead: best config per policy for these machine counts")
    parser.add_argument("--microbatches", type=int_list, default=(1, 2, 4, 8, 16, 32), help="sweep: sizes to try")
    parser.add_argument("--price", type=float, default=1.0, help="price of one machine-hour (1: machine-hours)")
    parser.add_argument("--out", type=Path, help="folder for result JSON and PNG figures")
    parser.add_argument("--timeline", action="store_true", help="draw the pipeline timeline (small traces)")
    add_workload_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args)
    trace = load_trace(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        return _sweep(args, profile, trace)
    return _single(args, profile, trace)


def _single(args: argparse.Namespace, profile: Profile, trace: Trace) -> int:
    from dejavu_planner.costmodel import CostModel
    from dejavu_planner.deployment import Batching, Deployment, Policy
    from dejavu_planner.planner import Planner
    from dejavu_planner.plots import plot_timeline
    from dejavu_planner.simulator import simulate
    from dejavu_planner.workload import Workload

    policy = Policy(args.policy)
    try:
        token_budget = _planned_budget(args, profile, policy) if args.token_budget is None else args.token_budget
        deployment = Deployment(
            policy,
            args.depth,
            args.microbatch,
            token_depth=args.token_depth if policy is Policy.DEJAVU else 0,
            replicas=args.replicas,
            swap=args.swap,
            batching=Batching(args.batching),
            max_running=args.max_running,
            token_budget=token_budget,
            kv_blocks=args.kv_blocks,
        )
        planner = Planner(profile, Workload.from_trace(trace), (args.microbatch,), deployment.max_running)
        if not planner.fits(deployment):
            print(f"warning: {deployment.notation()} does not fit {profile.hardware} memory", file=sys.stderr)
        result = simulate(
            deployment, trace, CostModel(profile), record_timeline=args.timeline, batch_wait_s=args.batch_wait_ms / 1000
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    latencies = sorted(r.latency_s for r in result.requests)
    summary = {
        "deployment": deployment.notation(),
        "label": deployment.label(),
        "machines": deployment.machines,
        "requests": len(result.requests),
        "makespan_s": result.makespan_s,
        "requests_per_s": result.requests_per_s,
        "tokens_per_s": result.tokens_per_s,
        "cost": result.cost(args.price),
        "latency_mean_s": result.mean_latency_s(),
        "latency_p50_s": latencies[len(latencies) // 2],
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "normalized_latency_mean_s_per_token": result.mean_normalized_latency_s(),
    }
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        records = [
            {"rid": r.rid, "arrival_s": r.arrival_s, "first_token_s": r.first_token_s, "finish_s": r.finish_s}
            for r in result.requests
        ]
        (args.out / "simulation.json").write_text(json.dumps({**summary, "per_request": records}, indent=1) + "\n")
        if args.timeline:
            try:
                plot_timeline(result, args.out / "timeline.png")
            except ValueError as exc:
                raise CLIError(str(exc)) from exc
    elif args.timeline:
        raise CLIError("--timeline needs --out")
    return 0


def _planned_budget(args: argparse.Namespace, profile: Profile, policy) -> int:
    """``--batching budget`` without ``--token-budget``: the budget the planner sizes for the simulated deployment's
    decoding pipeline and ``--itl-target-ms`` (printed with why on stderr). Other batchings do not use it."""
    from dejavu_common.settings import PlannerSettings
    from dejavu_planner.costmodel import CostModel
    from dejavu_planner.deployment import DEFAULT_TOKEN_BUDGET, Batching, Policy
    from dejavu_planner.tokenbudget import size_token_budget

    if Batching(args.batching) is not Batching.BUDGET:
        return DEFAULT_TOKEN_BUDGET
    target_ms = PlannerSettings().itl_target_ms if args.itl_target_ms is None else args.itl_target_ms
    dejavu = policy is Policy.DEJAVU
    depth = args.token_depth if dejavu else args.depth
    budget = size_token_budget(CostModel(profile), depth, args.max_running, target_ms / 1000, 16, not dejavu)
    print(f"planner: {budget.why()}", file=sys.stderr)
    if budget.warning is not None:
        print(f"warning: {budget.warning}", file=sys.stderr)
    return budget.tokens


def _sweep(args: argparse.Namespace, profile: Profile, trace: Trace) -> int:
    from dejavu_planner.planner import Planner
    from dejavu_planner.plots import plot_scaling
    from dejavu_planner.sweep import sweep
    from dejavu_planner.workload import Workload

    planner = Planner(profile, Workload.from_trace(trace), args.microbatches)
    points = sweep(planner, trace, list(args.sweep), args.price, args.swap)
    print(f"{'machines':>8} {'policy':<12} {'configuration':<28} {'makespan_s':>11} {'cost':>9}")
    for p in points:
        print(f"{p.machines:>8} {p.policy:<12} {p.configuration:<28} {p.makespan_s:>11.1f} {p.cost:>9.3f}")
    if args.out is not None:
        (args.out / "sweep.json").write_text(json.dumps([p.to_json() for p in points], indent=1) + "\n")
        plot_scaling(points, args.out / "scaling.png", title=f"{profile.model} on {profile.hardware}")
    return 0
