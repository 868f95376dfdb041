"""`dejavu bench validate`: the simulator's predicted makespan against the real system, on one trace.

In one run: profile the default model on this machine (one torch thread, as each worker gets when two
share the 2 cores), build a trace, predict its makespan with the discrete-event simulator for the
colocated 2-stage baseline and for DejaVu with 1 prompt + 1 token worker, then replay the same trace
through the real system in both deployments and measure. Prints the comparison table and writes
``benchmarks/results/validate.json``.

The trace: ``--requests`` requests of ``--prompt-len`` tokens, all arriving at t = 0 (a backlog, so
the makespan measures throughput), generated lengths drawn from the planner's LMSys-like log-normal
distribution (median ``--median-new``, clipped to ``--max-new``, seeded). Requests cannot ignore EOS,
so the trace's lengths are taken from what the real system actually generated in the first run, and
the simulation uses those.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH.parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(model: Path, colocated: bool, microbatch: int):
    from dejavu_common.settings import Mode, Settings

    base = Settings()
    ctl = {
        "port": _free_port(),
        "token_microbatch": microbatch,
        "prompt_microbatch": microbatch,
        "batch_wait_ms": 50.0,
        "queue_bound": 10_000,
    }
    ctl.update({"mode": Mode.COLOCATED, "token_depth": 2} if colocated else {"prompt_depth": 1, "token_depth": 1})
    return base.model_copy(
        update={
            "redis": base.redis.model_copy(update={"url": f"redis://127.0.0.1:{_free_port()}/0"}),
            "model": base.model.model_copy(update={"path": model}),
            "engine": base.engine.model_copy(update={"torch_threads": 1}),
            "controller": base.controller.model_copy(update=ctl),
        }
    )


def run_real(model: Path, trace, colocated: bool, microbatch: int, prompts) -> tuple[float, list[int]]:
    """Makespan of ``trace`` through a real deployment, and each request's generated count."""
    from benchmarks.loadgen import ClientConfig, LoadGenerator
    from dejavu_cli.launcher import Launcher

    settings = _settings(model, colocated, microbatch)
    launcher = Launcher(settings, restart_workers=False)
    try:
        launcher.start()
        launcher.wait_ready(300)
        config = ClientConfig(
            base_url=launcher.api_url, model=settings.model.name, request_timeout_s=1800, run_timeout_s=3600
        )
        records = LoadGenerator(config, lambda r: prompts[r.rid]).run_sync(trace)
    finally:
        launcher.stop()
    bad = [r for r in records if r.status.value != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].error}")
    return max(r.end_s for r in records) - min(r.send_s for r in records), [r.generated for r in records]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench validate", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median-new", type=int, default=24)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--profile", help="use this profile instead of measuring one")
    args = parser.parse_args(argv)

    from benchmarks.loadgen import PromptBuilder
    from dejavu_common.settings import Settings
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.checkpoint import ensure_default_model
    from dejavu_planner.costmodel import CostModel
    from dejavu_planner.deployment import Deployment, Policy
    from dejavu_planner.profile import Profile
    from dejavu_planner.simulator import simulate
    from dejavu_planner.trace import Request, Trace, lmsys_like_trace

    model = ensure_default_model(Settings())
    if args.profile:
        profile = Profile.load(Path(args.profile))
    else:
        from dejavu_planner.profiler import ProfilerOptions, measure_profile

        print("profiling the default model (one thread) ...", file=sys.stderr, flush=True)
        opts = ProfilerOptions(
            batches=(1, 2, 4),
            prompt_lens=(64, args.prompt_len),
            decode_context=args.prompt_len,
            decode_steps=8,
            repeats=2,
        )
        profile = measure_profile(Settings(engine={"torch_threads": 1}), opts)
        RESULTS.mkdir(parents=True, exist_ok=True)
        profile.save(RESULTS / "validate-profile.json")
    trace = lmsys_like_trace(
        args.requests, args.prompt_len, median_new=args.median_new, sigma=0.7, max_new=args.max_new, seed=1
    )
    builder = PromptBuilder(Tokenizer.from_pretrained(model))
    prompts = {r.rid: builder.text(r.prompt_len, key=r.rid) for r in trace.requests}

    rows = []
    measured_lengths = None
    for name, colocated in (("colocated 2-stage baseline", True), ("DejaVu 1 prompt + 1 token", False)):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        real, generated = run_real(model, trace, colocated, args.microbatch, prompts)
        if measured_lengths is None:
            measured_lengths = generated
        # Simulate the trace with the lengths the model really produced (EOS can end a request early).
        actual = Trace(
            tuple(
                Request(r.rid, r.arrival_s, r.prompt_len, max(1, g))
                for r, g in zip(trace.requests, measured_lengths, strict=True)
            )
        )
        deployment = (
            Deployment(Policy.BASELINE, 2, args.microbatch)
            if colocated
            else Deployment(Policy.DEJAVU, 1, args.microbatch, token_depth=1)
        )
        predicted = simulate(deployment, actual, CostModel(profile)).makespan_s
        rows.append(
            {
                "deployment": name,
                "notation": deployment.notation(),
                "real_makespan_s": real,
                "simulated_makespan_s": predicted,
                "error": (predicted - real) / real,
                "generated_tokens": sum(generated),
            }
        )

    print(
        f"\nsimulator vs real system: {args.requests} requests x {args.prompt_len} prompt tokens, "
        f"microbatch {args.microbatch}, backlog at t=0"
    )
    print(f"{'deployment':30s} {'notation':26s} {'real s':>8s} {'simulated s':>12s} {'error':>7s}")
    for r in rows:
        print(
            f"{r['deployment']:30s} {r['notation']:26s} {r['real_makespan_s']:8.1f} "
            f"{r['simulated_makespan_s']:12.1f} {r['error']:+7.1%}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "ucx_progress": Settings().transport.ucx_progress, "rows": rows}
    (RESULTS / "validate.json").write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {RESULTS / 'validate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
