"""``dejavu up`` / ``dejavu down``: run the whole system on this host."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start Redis (if needed), the controller and the workers on this host")
    p.add_argument("--prompt-depth", type=int, help="prompt pipeline stages (D_p)")
    p.add_argument("--token-depth", type=int, help="token pipeline stages (D_t)")
    p.add_argument("--prompt-microbatch", type=int, help="requests per prompt microbatch")
    p.add_argument("--token-microbatch", type=int, help="requests per token microbatch")
    p.add_argument("--colocated", action="store_true", help="the baseline: prompts and tokens on one pipeline")
    p.add_argument(
        "--planner",
        choices=("manual", "auto"),
        help="auto (the default unless a depth or --colocated is given): the planner picks colocated stages or "
        "a D_p + D_t split of --workers machines",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="machines the planner plans for (default 1: this host; workers on one host share its cores)",
    )
    p.add_argument("--profile", default="smollm2-135m-cpu-1thread", help="planner profile (file or shipped name)")
    p.add_argument("--workload", default="1000,128,256", help="planner workload: prompt,mean new,max new tokens")
    p.add_argument("--spares", type=int, default=0, help="pre-started spare token workers")
    p.add_argument("--prompt-spares", type=int, default=0, help="pre-started spare prompt workers")
    p.add_argument("--pin-cpus", action="store_true", help="give each worker its own core (round-robin)")
    p.add_argument("--model", help="checkpoint folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights and KV dtype of every worker")
    p.add_argument("--host", help="API bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="API port (default 8000)")
    p.add_argument("--redis-url", help="Redis URL (started here if none answers on loopback)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /ready")
    p.add_argument("--demo", action="store_true", help="send one streamed demo request once ready")
    p.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo")
    p.set_defaults(func=_up)
    d = subparsers.add_parser("down", help="stop a system started by `dejavu up`")
    d.set_defaults(func=_down)


def _settings(args: argparse.Namespace):
    from dejavu_common.settings import Mode, Settings

    s = Settings()
    ctl = {
        k: v
        for k, v in {
            "prompt_depth": args.prompt_depth,
            "token_depth": args.token_depth,
            "prompt_microbatch": args.prompt_microbatch,
            "token_microbatch": args.token_microbatch,
            "host": args.host,
            "port": args.port,
        }.items()
        if v is not None
    }
    if args.colocated:
        ctl["mode"] = Mode.COLOCATED
    # A layout given on the command line or in the environment (DEJAVU_CONTROLLER__*) is kept as given.
    layout_set = {"mode", "prompt_depth", "token_depth"} & s.controller.model_fields_set
    manual = args.colocated or args.prompt_depth is not None or args.token_depth is not None or bool(layout_set)
    if args.planner == "auto" or (args.planner is None and not manual):
        if args.colocated:
            from dejavu_cli.main import CLIError

            raise CLIError("--planner auto picks the mode itself: drop --colocated")
        layout, budget = _planned_layout(args, s.model_copy(update={"controller": s.controller.model_copy(update=ctl)}))
        ctl.update(layout)
        if "token_budget" not in s.engine.model_fields_set:  # engine.token_budget given (setting or env) wins
            s = s.model_copy(update={"engine": s.engine.model_copy(update={"token_budget": budget})})
    update: dict = {"controller": s.controller.model_copy(update=ctl)}
    model: dict = {}
    if args.model:
        from pathlib import Path

        model["path"] = Path(args.model)
    if args.dtype:
        model["dtype"] = args.dtype
    if model:
        update["model"] = s.model.model_copy(update=model)
    if args.redis_url:
        update["redis"] = s.redis.model_copy(update={"url": args.redis_url})
    return s.model_copy(update=update)


def _planned_layout(args: argparse.Namespace, settings) -> tuple[dict, int]:
    """``planner: auto``: the planner picks, for ``--workers`` machines, colocated stages or a split into
    prompt and token stages, modelling the runtime's policy (cohorts of up to ``max_running / D_t`` rows)
    at its token microbatch size, and the token budget of a pass for ``planner.itl_target_ms``. One machine
    (this host, the default) runs colocated. Returns the controller's layout and the budget; prints why."""
    from pathlib import Path

    from dejavu_cli.main import CLIError
    from dejavu_common.settings import Mode
    from dejavu_planner.planner import plan_runtime
    from dejavu_planner.profile import Profile
    from dejavu_planner.workload import Workload

    if args.workers < 1:
        raise CLIError(f"--workers must be >= 1, got {args.workers}")
    controller = settings.controller
    prompt_len, mean_new, max_new = (int(x) for x in args.workload.split(","))
    try:
        plan = plan_runtime(
            args.workers,
            Profile.load(Path(args.profile)),
            Workload(prompt_len, mean_new, max_new),
            microbatch=controller.token_microbatch,
            max_running=controller.max_running,
            itl_target_s=settings.planner.itl_target_ms / 1000,
            block_size=settings.engine.kv_block_size or 16,
        )
    except ValueError as exc:
        raise CLIError(f"the planner found no configuration: {exc}") from exc
    if plan.colocated:
        why = plan.why
        if plan.token_depth == 1:  # what runs there is the request-scheduled stage, not the cohorts modelled
            why = (
                "one machine: nothing to disaggregate, prompts and tokens share one stage of every layer, which "
                "schedules requests (engine.request_scheduling): each pass the running decodes, then prompt "
                "chunks, up to engine.token_budget positions, prefixes found cached skipped."
            )
        print(f"planner: {args.workers} machine(s) -> {plan.token_depth} colocated stage(s)\n{why}", file=sys.stderr)
        layout = {"mode": Mode.COLOCATED, "token_depth": plan.token_depth, "planner": "auto"}
    else:
        stages = f"{plan.prompt_depth} prompt + {plan.token_depth} token stages"
        print(f"planner: {args.workers} machine(s) -> {stages}\n{plan.why}", file=sys.stderr)
        layout = {"prompt_depth": plan.prompt_depth, "token_depth": plan.token_depth, "planner": "auto"}
    print(_budget_lines(plan.budget, settings.engine), file=sys.stderr)
    return layout, plan.budget.tokens


def _budget_lines(budget, engine) -> str:
    """The planned token budget and why (with a warning where it misses the inter-token latency target), or the
    explicit ``engine.token_budget`` that overrides it."""
    if "token_budget" in engine.model_fields_set:
        return (
            f"planner: engine.token_budget = {engine.token_budget} is set and overrides the planner's choice, "
            f"{budget.why()}"
        )
    text = f"planner: {budget.why()}"
    return text if budget.warning is None else f"{text}\nwarning: {budget.warning}"


def _up(args: argparse.Namespace) -> int:
    import logging

    from dejavu_cli.launcher import Launcher
    from dejavu_cli.main import CLIError

    # The console shows the launcher's own lines; libraries (httpx's request lines, ...) speak only of problems.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("dejavu").setLevel(logging.INFO)
    settings = _settings(args)
    if not settings.model.folder.is_dir():
        raise CLIError(f"model folder {settings.model.folder} does not exist (run `dejavu model prepare`)")
    if not settings.controller.api_keys:
        print("note: no API keys configured: the API on 127.0.0.1 is unauthenticated", file=sys.stderr)
    launcher = Launcher(settings, spares=args.spares, prompt_spares=args.prompt_spares, pin_cpus=args.pin_cpus)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        launcher.start()
        print(f"starting DejaVu; logs in {launcher.log_dir}", flush=True)
        launcher.wait_ready(args.ready_timeout)
        print(f"DejaVu is serving {settings.model.name} at {launcher.api_url}/v1 (Ctrl-C or `dejavu down` stops it)")
        if args.demo:
            _demo(launcher.api_url, settings)
        if not args.exit_after_demo:
            launcher.supervise(stop.is_set)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:
        raise CLIError(str(exc)) from exc
    finally:
        print("stopping DejaVu ...", file=sys.stderr)
        launcher.stop()
    return 0


def _demo(api_url: str, settings) -> None:
    """Stream one chat completion to the terminal."""
    import httpx

    headers = {}
    if settings.controller.api_keys:
        headers["Authorization"] = f"Bearer {settings.controller.api_keys[0].get_secret_value()}"
    body = {
        "model": settings.model.name,
        "messages": [{"role": "user", "content": DEMO_PROMPT}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }
    print(f"\n>>> {DEMO_PROMPT}\n<<< ", end="", flush=True)
    with httpx.stream("POST", f"{api_url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            print(delta, end="", flush=True)
    print("\n", flush=True)


def _down(args: argparse.Namespace) -> int:
    from dejavu_cli.launcher import stop_from_state_file

    n = stop_from_state_file()
    print(f"sent SIGTERM to {n} process(es)" if n else "no running DejaVu system found")
    return 0
