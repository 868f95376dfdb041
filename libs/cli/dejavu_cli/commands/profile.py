"""``dejavu profile``: measure a planner profile of the configured model on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dejavu_cli.commands.plan import int_list
from dejavu_cli.main import CLIError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure prompt and token times of the model for the planner",
        description="Time prefill and decode of the configured model (DEJAVU_MODEL__*; default: the prepared "
        "SmolLM2) on this machine and write a profile JSON for `dejavu plan` / `dejavu simulate`.",
    )
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--batches", type=int_list, default=(1, 2, 4), help="microbatch sizes to time")
    parser.add_argument("--prompt-lens", type=int_list, default=(32, 128, 256), help="prompt lengths to time")
    parser.add_argument(
        "--token-batches",
        type=int_list,
        help="rows of the token steps to time (default: --batches); the runtime's cohorts batch up to "
        "max_running / D_t rows in one step",
    )
    parser.add_argument("--decode-context", type=int, default=128, help="cached positions when timing token steps")
    parser.add_argument("--decode-steps", type=int, default=8, help="token steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument("--layers", type=int, help="time only the first N layers and scale (faster)")
    parser.add_argument("--threads", type=int, help="torch threads (default: engine.torch_threads)")
    parser.add_argument("--memory-gib", type=float, help="machine memory M to record (default: the device's)")
    parser.add_argument("--host-device-gbps", type=float, help="swap bandwidth in GB/s to record (default: none)")
    parser.add_argument(
        "--co-runners",
        type=int,
        default=0,
        help="other processes decoding on this host while timing: measure a machine shared by that many "
        "more workers (default 0: the machine alone)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import CheckpointError
    from dejavu_planner.profiler import ProfilerOptions, measure_profile

    try:
        settings = Settings()
        if args.threads is not None:
            settings = settings.model_copy(
                update={"engine": settings.engine.model_copy(update={"torch_threads": args.threads})}
            )
        options = ProfilerOptions(
            batches=args.batches,
            prompt_lens=args.prompt_lens,
            decode_context=args.decode_context,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            layers=args.layers,
            machine_memory_bytes=None if args.memory_gib is None else int(args.memory_gib * 2**30),
            host_device_bytes_per_s=None if args.host_device_gbps is None else args.host_device_gbps * 1e9,
            co_runners=args.co_runners,
            token_batches=args.token_batches,
        )
        profile = measure_profile(settings, options, progress=lambda line: print(line, file=sys.stderr))
    except (CheckpointError, ValueError, RuntimeError) as exc:
        raise CLIError(str(exc)) from exc
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.model} on {profile.hardware}, m = {profile.stream_overhead:.3f}")
    return 0
