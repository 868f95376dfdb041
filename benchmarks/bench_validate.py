"""`dejavu bench validate`: the simulator's predicted makespan against the real system, on one trace.

Each of ``--rounds`` rounds profiles the default model on this host, then replays the trace through
the real system in three deployments and predicts each run's makespan with the discrete-event
simulator from that round's profile: the colocated 2-stage baseline and DejaVu with 1 prompt + 1
token worker (profiled with one torch thread, as each worker gets when two share the 2 cores, and
``--co-runners`` other decoding processes, since the two workers compete for the same memory
bandwidth), and what ``dejavu up`` starts on this host, one colocated stage with both cores (profiled
with two threads and no co-runner); ``--deployments`` picks some. The simulator models the runtime's
own policy: iteration-level batching in cohorts (``Batching.COHORT`` with the controller's
``max_running``), and for the one colocated stage, which schedules requests, the very scheduler it runs
(``Batching.BUDGET``, ``engine.token_budget``); the paper's microbatch policy's prediction is kept next to it
(``simulated_paper_policy_s``), to show what modelling the runtime's policy changes. Profiling
in every round keeps the profile and the real runs minutes apart on a host whose speed drifts.
Prints the comparison table (every round, then medians) and writes
``benchmarks/results/validate.json`` (and each round's profile next to it).

The trace: ``--requests`` requests of ``--prompt-len`` tokens, sent ``--spacing-ms`` apart in trace
order (a backlog within a fraction of a second, so the makespan measures throughput), generated
lengths drawn from the planner's LMSys-like log-normal distribution (median ``--median-new``,
clipped to ``--max-new``, seeded). Requests do not ask to ignore EOS (as real traffic), so each
simulation uses the lengths that its real run actually generated.

Which requests share a microbatch matters: a microbatch runs until its longest request ends, so
the grouping alone moves the makespan by 10-15 % on this trace. Requests sent all at once reach
the controller in whatever order the event loops deliver them; sent a few milliseconds apart (after
a warm-up request) they mostly arrive in trace order, and the simulator models the controller's
``batch_wait_ms`` rule, so it forms the same microbatches. Mostly: when the controller's event loop
stalls for longer than the spacing, it admits the waiting requests in another order. The grouping
is then an input, not something to predict, so the simulator replays the trace in the order the
controller admitted it, read off the client's first-token times (one prompt pass gives a
microbatch's rows their first token together). Each row reports how many real microbatches were
in trace order, and the trace-order prediction is kept in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dejavu_common.settings import Settings
    from dejavu_planner.profile import Profile

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH.parent))
from benchmarks.procs import free_port, stop_on_sigterm  # noqa: E402

BATCH_WAIT_MS = 50.0  # the controller's partial-microbatch wait, also given to the simulator


def _settings(model: Path, colocated: bool, microbatch: int, depth: int = 2, threads: int = 1):
    from dejavu_common.settings import Mode, Settings

    base = Settings()
    ctl = {
        "port": free_port(),
        "token_microbatch": microbatch,
        "prompt_microbatch": microbatch,
        "batch_wait_ms": BATCH_WAIT_MS,
        "queue_bound": 10_000,
    }
    ctl.update({"mode": Mode.COLOCATED, "token_depth": depth} if colocated else {"prompt_depth": 1, "token_depth": 1})
    return base.model_copy(
        update={
            "redis": base.redis.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"}),
            "model": base.model.model_copy(update={"path": model}),
            "engine": base.engine.model_copy(update={"torch_threads": threads}),
            "controller": base.controller.model_copy(update=ctl),
        }
    )


def _warm_up(base_url: str, model: str) -> None:
    """One short completion before the clock starts, so no request of the trace pays a cold start (the
    gateway's first tokenization and validation, the workers' first passes) and overtakes another."""
    import httpx

    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    httpx.post(f"{base_url}/v1/completions", json=body, timeout=300).raise_for_status()


def run_real(
    model: Path, trace, colocated: bool, microbatch: int, prompts, depth: int = 2, threads: int = 1
) -> tuple[float, list]:
    """Makespan of ``trace`` through a real deployment, and each request's client record (trace order)."""
    from benchmarks.loadgen import ClientConfig, LoadGenerator
    from dejavu_cli.launcher import Launcher

    settings = _settings(model, colocated, microbatch, depth, threads)
    launcher = Launcher(settings, restart_workers=False)
    try:
        launcher.start()
        launcher.wait_ready(300)
        _warm_up(launcher.api_url, settings.model.name)
        config = ClientConfig(
            base_url=launcher.api_url, model=settings.model.name, request_timeout_s=1800, run_timeout_s=3600
        )
        records = LoadGenerator(config, lambda r: prompts[r.rid]).run_sync(trace)
    finally:
        launcher.stop()
    bad = [r for r in records if r.status.value != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].error}")
    return max(r.end_s for r in records) - min(r.send_s for r in records), records


def microbatches(first_token_s: dict[int, float], gap_s: float = 0.25) -> list[frozenset[int]]:
    """Which requests shared a microbatch, in the order the microbatches formed, read off first-token times.

    One prompt pass gives every row of a microbatch its first token at once, and the next
    microbatch's first tokens come at least a stage's prompt time later (0.4 s or more here), so a
    request whose first token came within ``gap_s`` of the previous one's belongs with it.
    """
    groups: list[set[int]] = []
    last = None
    for rid, t in sorted(first_token_s.items(), key=lambda item: (item[1], item[0])):
        if last is None or t - last > gap_s:
            groups.append(set())
        groups[-1].add(rid)
        last = t
    return [frozenset(g) for g in groups]


def in_admitted_order(trace, groups: list[frozenset[int]]):
    """``trace`` with its requests in the order the controller admitted them (microbatch by microbatch).

    The arrival times stay where they were; only which request comes when changes, so FIFO
    microbatch formation in the simulator puts the same requests together as the real run did.
    """
    from dejavu_planner.trace import Request, Trace

    by_rid = {r.rid: r for r in trace.requests}
    order = [rid for group in groups for rid in sorted(group)]
    arrivals = [r.arrival_s for r in trace.requests]
    return Trace(
        tuple(
            Request(rid, at, by_rid[rid].prompt_len, by_rid[rid].new_tokens)
            for rid, at in zip(order, arrivals, strict=True)
        )
    )


def per_request(records, sim) -> list[dict]:
    """Each request's real and simulated first-token and finish times (seconds from the first send)."""
    t0 = min(r.send_s for r in records)
    simulated = {s.rid: s for s in sim.requests}
    return [
        {
            "rid": r.request.rid,
            "generated": r.generated,
            "real_first_s": r.chunk_times_s[0] - t0 if r.chunk_times_s else None,
            "real_finish_s": r.end_s - t0,
            "sim_first_s": simulated[r.request.rid].first_token_s,
            "sim_finish_s": simulated[r.request.rid].finish_s,
        }
        for r in records
    ]


# name, colocated, stages of the decoding pipeline, torch threads per worker
DEPLOYMENTS = (
    ("colocated 2-stage baseline", True, 2, 1),
    ("DejaVu 1 prompt + 1 token", False, 1, 1),
    ("dejavu up: 1 colocated stage", True, 1, 2),
)


def measure(args: argparse.Namespace, settings: Settings, co_runners: int) -> Profile:
    """A fresh profile of the default model on this host, as the workers will run it."""
    from dejavu_planner.profiler import ProfilerOptions, measure_profile

    # Token steps up to every request in one cohort: the runtime batches that many rows in one step.
    token_rows = {1, args.microbatch, args.requests} | {args.microbatch << k for k in range(1, 5)}
    opts = ProfilerOptions(
        batches=tuple(sorted({1, args.microbatch, 2 * args.microbatch})),
        token_batches=tuple(sorted(r for r in token_rows if r <= args.requests)),
        prompt_lens=(64, args.prompt_len),
        # Token steps at the middle of a typical request's generation: attention grows with context.
        decode_context=args.prompt_len + args.median_new // 2,
        decode_steps=8,
        repeats=3,
        co_runners=co_runners,
    )
    return measure_profile(settings, opts, progress=lambda line: print("  " + line, file=sys.stderr, flush=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench validate", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median-new", type=int, default=24)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument(
        "--spacing-ms", type=float, default=10.0, help="send requests this far apart, in trace order (see above)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="profile + both deployments, this many times")
    parser.add_argument(
        "--co-runners",
        type=int,
        default=1,
        help="profile with this many other processes decoding (default 1: the two workers share this host)",
    )
    parser.add_argument("--profile", help="use this profile in every round instead of measuring one")
    parser.add_argument(
        "--deployments",
        nargs="+",
        type=int,
        default=list(range(len(DEPLOYMENTS))),
        help="which deployments, by index: " + ", ".join(f"{i} {d[0]}" for i, d in enumerate(DEPLOYMENTS)),
    )
    args = parser.parse_args(argv)
    stop_on_sigterm()  # stopped, it still stops the deployment it started

    from benchmarks.loadgen import PromptBuilder
    from dejavu_common.settings import Settings
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.checkpoint import ensure_default_model
    from dejavu_planner.costmodel import CostModel
    from dejavu_planner.deployment import Batching, Deployment, Policy
    from dejavu_planner.profile import Profile
    from dejavu_planner.simulator import simulate
    from dejavu_planner.trace import Request, Trace, lmsys_like_trace

    model = ensure_default_model(Settings())
    lengths = lmsys_like_trace(
        args.requests, args.prompt_len, median_new=args.median_new, sigma=0.7, max_new=args.max_new, seed=1
    )
    trace = Trace(
        tuple(Request(r.rid, r.rid * args.spacing_ms / 1000, r.prompt_len, r.new_tokens) for r in lengths.requests)
    )
    builder = PromptBuilder(Tokenizer.from_pretrained(model))
    prompts = {r.rid: builder.text(r.prompt_len, key=r.rid) for r in trace.requests}
    RESULTS.mkdir(parents=True, exist_ok=True)

    chosen = [DEPLOYMENTS[i] for i in args.deployments]
    rows = []
    for round_no in range(1, args.rounds + 1):
        profiles: dict[int, Profile] = {}
        for threads in sorted({d[3] for d in chosen}):
            if args.profile:
                profiles[threads] = Profile.load(Path(args.profile))
                continue
            # Two one-thread workers share the host's memory bandwidth; the two-thread one has it alone.
            co_runners = args.co_runners if threads == 1 else 0
            print(f"round {round_no}: profiling ({threads} thread(s), {co_runners} co-runner(s)) ...", file=sys.stderr)
            profiles[threads] = measure(args, Settings(engine={"torch_threads": threads}), co_runners)
            profiles[threads].save(RESULTS / f"validate-profile-{round_no}-{threads}t.json")
        for name, colocated, depth, threads in chosen:
            profile = profiles[threads]
            print(f"round {round_no}: running {name} ...", file=sys.stderr, flush=True)
            real, records = run_real(model, trace, colocated, args.microbatch, prompts, depth, threads)
            generated = [r.generated for r in records]
            # Simulate the trace with the lengths this run really produced (EOS can end a request early).
            actual = Trace(
                tuple(
                    Request(r.rid, r.arrival_s, r.prompt_len, max(1, g))
                    for r, g in zip(trace.requests, generated, strict=True)
                )
            )
            # The runtime's policy (cohorts, the controller's max_running), and the paper's for comparison.
            paper = (
                Deployment(Policy.BASELINE, depth, args.microbatch)
                if colocated
                else Deployment(Policy.DEJAVU, 1, args.microbatch, token_depth=1)
            )
            served = Settings()
            # One colocated stage schedules requests (engine.request_scheduling): the simulator runs that very
            # policy (Batching.BUDGET, the dejavu_common.sched.Scheduler); every other deployment runs cohorts.
            budgeted = colocated and depth == 1 and served.engine.request_scheduling
            deployment = dataclasses.replace(
                paper,
                batching=Batching.BUDGET if budgeted else Batching.COHORT,
                max_running=served.controller.max_running,
                token_budget=served.engine.token_budget,
                block_size=served.engine.kv_block_size or 16,
            )
            cost, wait_s = CostModel(profile), BATCH_WAIT_MS / 1000
            in_trace_order = simulate(deployment, actual, cost, batch_wait_s=wait_s)
            # Requests only milliseconds apart can still reach the controller out of order (its event loop
            # stalls now and then on 2 busy cores). Which requests share a microbatch is an input, not a
            # prediction: replay the trace in the order the controller admitted it, and say whether it had to.
            # (A request whose every chunk was held back has no first chunk: its end stands in.)
            real_groups = microbatches({r.request.rid: (r.chunk_times_s or (r.end_s,))[0] for r in records})
            replay = actual if budgeted else in_admitted_order(actual, real_groups)  # budget: no grouping to replay
            sim = simulate(deployment, replay, cost, batch_wait_s=wait_s)
            predicted = sim.makespan_s
            paper_predicted = simulate(paper, replay, cost, batch_wait_s=wait_s).makespan_s
            simulated_groups = set(microbatches({s.rid: s.first_token_s for s in sim.requests}))
            trace_groups = set(microbatches({s.rid: s.first_token_s for s in in_trace_order.requests}))
            rows.append(
                {
                    "round": round_no,
                    "deployment": name,
                    "notation": deployment.notation(),
                    "real_makespan_s": real,
                    "simulated_makespan_s": predicted,
                    "error": (predicted - real) / real,
                    "simulated_paper_policy_s": paper_predicted,
                    "paper_policy_error": (paper_predicted - real) / real,
                    "generated_tokens": sum(generated),
                    "microbatches": len(real_groups),
                    "microbatches_in_trace_order": sum(g in trace_groups for g in real_groups),
                    "microbatches_replayed": sum(g in simulated_groups for g in real_groups),
                    "simulated_in_trace_order_s": in_trace_order.makespan_s,
                    "requests": per_request(records, sim),
                }
            )
            print(
                f"  real {real:.1f} s, simulated {predicted:.1f} s ({rows[-1]['error']:+.1%}); "
                f"{rows[-1]['microbatches_in_trace_order']} of {len(real_groups)} microbatches in trace order "
                f"(trace order simulated: {in_trace_order.makespan_s:.1f} s; the paper's microbatch policy: "
                f"{paper_predicted:.1f} s, {rows[-1]['paper_policy_error']:+.1%})",
                file=sys.stderr,
            )

    print(
        f"\nsimulator vs real system: {args.requests} requests x {args.prompt_len} prompt tokens, "
        f"microbatch {args.microbatch}, sent {args.spacing_ms:g} ms apart, {args.rounds} round(s)"
    )
    print(
        f"{'round':>5s} {'deployment':30s} {'notation':28s} {'real s':>8s} {'simulated s':>12s} {'error':>7s}"
        f"  {'microbatches in trace order':>27s}"
    )
    for r in rows:
        print(
            f"{r['round']:5d} {r['deployment']:30s} {r['notation']:28s} {r['real_makespan_s']:8.1f} "
            f"{r['simulated_makespan_s']:12.1f} {r['error']:+7.1%}  {r['microbatches_in_trace_order']:>18d} of "
            f"{r['microbatches']:<6d}"
        )
    summary = []
    for name, *_ in chosen:
        mine = [r for r in rows if r["deployment"] == name]
        real = statistics.median(r["real_makespan_s"] for r in mine)
        predicted = statistics.median(r["simulated_makespan_s"] for r in mine)
        errors = [r["error"] for r in mine]
        summary.append(
            {
                "deployment": name,
                "median_real_s": real,
                "median_simulated_s": predicted,
                "median_error": statistics.median(errors),
                "max_abs_error": max(abs(e) for e in errors),
            }
        )
        print(
            f"{'med':>5s} {name:30s} {'':28s} {real:8.1f} {predicted:12.1f} {summary[-1]['median_error']:+7.1%}"
            f"  (worst round {summary[-1]['max_abs_error']:.1%})"
        )
    out = {"args": vars(args), "ucx_progress": Settings().transport.ucx_progress, "rows": rows, "summary": summary}
    (RESULTS / "validate.json").write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {RESULTS / 'validate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
