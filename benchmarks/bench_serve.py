"""``dejavu bench serve``: serving benchmarks over HTTP, in two modes.

With ``--base-url URL`` it benchmarks any running OpenAI-compatible server, ours or a peer's, with
``vllm bench serve``'s options and metrics: see ``benchmarks/serve_url.py`` (``dejavu bench serve
--base-url URL --help``).

Without it, it runs the paper's disaggregation experiment: DejaVu (1 prompt + 1 token worker)
against the colocated 2-stage baseline (section 5.2, "Performance without failures") on this host:
fixed-length prompts (1,000 tokens by default), generated lengths drawn from a skewed LMSys-like
distribution, and one open-loop client sending Poisson arrivals at several request rates. For each
deployment the script starts the whole system (its own redis-server, controller and workers, one
torch thread per worker), sends one warm-up request, runs every rate in turn (a rate's run ends when
all its requests have), and stops the system. It prints a table and writes
``benchmarks/results/serve.json`` (configuration, metrics and every request's record), ``serve.png``
(median normalized latency, and p99 dashed, against the request rate) and ``serve-percentiles.png``
(per rate, each deployment's output throughput and TTFT, TPOT and ITL at p50, p90 and p99).

The workload: ``new_tokens`` is log-normal with median ``--median-new`` and log-space sigma
``--sigma`` (``dejavu_planner.trace.lmsys_like_trace``), rounded and clipped to
``[--min-new, --max-new]``; it is sent as ``max_tokens`` with greedy sampling, so both deployments
generate the same tokens; the model may stop earlier (metrics use the actual counts) unless
``--ignore-eos`` is given. Every rate uses the same seed, hence the same lengths and prompts; only
the arrival times differ.

With ``--trace FILE`` (the planner's CSV/JSON format) it replays that trace instead of the Poisson
rates, to validate the simulator against the real system.

``--dataset prefix-repetition`` and ``--dataset multi-turn`` run the prefix-sharing workloads of
:mod:`benchmarks.workloads` at each rate instead (for multi-turn, the rate of conversation starts), with
``--output-len`` tokens out; ``--deployments colocated-1`` is ``dejavu up``'s default deployment (one
colocated request-scheduled stage, the one with a prefix cache). Every worker serves its metrics on a
free port, and each run reports the prefix-cache hit rates scraped from them before and after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.*
from benchmarks import workloads
from benchmarks.conversations import ConversationRunner
from benchmarks.dataset import TokenPrompts, token_pool
from benchmarks.loadgen import ClientConfig, LoadGenerator, PromptBuilder, RequestRecord
from benchmarks.metrics import RunMetrics
from benchmarks.plots import plot_rates, plot_serve, serve_result
from benchmarks.prefix_cache import Scraper, worker_metrics_urls
from benchmarks.procs import free_port, stop_on_sigterm
from benchmarks.workloads import DatasetName, Measured
from dejavu_cli.launcher import Launcher
from dejavu_common.settings import Mode, Settings
from dejavu_planner.trace import Trace, lmsys_like_trace

RESULTS = Path(__file__).resolve().parent / "results"
# A smoke run (~3 minutes on 2 idle cores, most of it starting the deployments), not a measurement.
QUICK = {"rates": [0.2, 0.4], "requests": 3, "prompt_len": 256, "max_new": 32}


@dataclass(frozen=True)
class Deployment:
    """One system under test on this host."""

    name: str
    mode: Mode
    prompt_depth: int
    token_depth: int

    @property
    def workers(self) -> int:
        return self.token_depth + (self.prompt_depth if self.mode is Mode.DISAGGREGATED else 0)


DEPLOYMENTS = {
    "dejavu": Deployment("dejavu-1P+1T", Mode.DISAGGREGATED, prompt_depth=1, token_depth=1),
    "baseline": Deployment("baseline-colocated-2", Mode.COLOCATED, prompt_depth=1, token_depth=2),
    "colocated-1": Deployment("colocated-1", Mode.COLOCATED, prompt_depth=1, token_depth=1),
}


@dataclass(frozen=True)
class Workload:
    """The requests of one rate: fixed prompt length, LMSys-like generated lengths (module docstring)."""

    requests: int
    prompt_len: int
    median_new: int
    sigma: float
    min_new: int
    max_new: int
    seed: int

    def trace(self, rate_per_s: float) -> Trace:
        drawn = lmsys_like_trace(
            self.requests, self.prompt_len, self.median_new, self.sigma, self.max_new, rate_per_s, self.seed
        )
        return Trace.of([(r.arrival_s, r.prompt_len, max(r.new_tokens, self.min_new)) for r in drawn.requests])


@dataclass(frozen=True)
class Run:
    """One deployment at one load (a rate, or the replayed trace when ``rate_per_s`` is None);
    ``extras``: the prefix-cache hit rates and, for multi-turn, TTFT per turn
    (:meth:`benchmarks.workloads.Measured.extras_json`)."""

    deployment: str
    rate_per_s: float | None
    metrics: RunMetrics
    records: tuple[RequestRecord, ...]
    extras: dict

    def to_json(self) -> dict:
        return {
            "deployment": self.deployment,
            "rate_per_s": self.rate_per_s,
            "metrics": self.metrics.to_json(),
            **self.extras,
            "records": [r.to_json() for r in self.records],
        }


# Runs one load: the client's configuration, the rate (None: the replayed trace), the scraper.
LoadRunner = Callable[[ClientConfig, float | None, Scraper], Measured]


def deployment_settings(base: Settings, deployment: Deployment, args: argparse.Namespace) -> Settings:
    """``base`` (the environment's settings) with this deployment's shape, fresh ports and 1 torch thread."""
    controller = base.controller.model_copy(
        update={
            "port": free_port(),
            "mode": deployment.mode,
            "prompt_depth": deployment.prompt_depth,
            "token_depth": deployment.token_depth,
            "prompt_microbatch": args.microbatch,
            "token_microbatch": args.microbatch,
            "batch_wait_ms": args.batch_wait_ms,
            "request_timeout_s": args.request_timeout_s,
        }
    )
    return base.model_copy(
        update={
            "redis": base.redis.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"}),
            "model": base.model.model_copy(update={"path": args.model_folder}),
            "engine": base.engine.model_copy(update={"torch_threads": 1}),
            "worker": base.worker.model_copy(update={"metrics_port": 0}),  # for the prefix-cache counters
            "controller": controller,
        }
    )


def measure(
    deployment: Deployment,
    settings: Settings,
    rates: list[float | None],
    run_load: LoadRunner,
    args: argparse.Namespace,
    runs: list[Run],
) -> None:
    """Start the deployment, warm it up, run every load in turn (appending to ``runs``), and stop it
    (always, by PID). Raises ``RuntimeError``/``TimeoutError`` if it does not start or a process dies."""
    launcher = Launcher(settings, spares=0, restart_workers=False)
    print(f"== {deployment.name}: starting ({deployment.workers} workers), logs in {launcher.log_dir}", flush=True)
    try:
        launcher.start()
        launcher.wait_ready(args.ready_timeout_s)
        config = ClientConfig(
            launcher.api_url,
            settings.model.name,
            request_timeout_s=args.request_timeout_s,
            run_timeout_s=args.run_timeout_s,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        warm_prompts = TokenPrompts(token_pool(args.model_folder), seed=args.seed)
        warm = LoadGenerator(config, lambda r: warm_prompts.ids(16, -1)).run_sync(Trace.of([(0.0, 16, 4)]))[0]
        print(f"   warm-up: {warm.status.value} in {warm.e2e_s or 0:.1f} s", flush=True)  # first-request costs
        redis_url = settings.redis.url
        scraper = Scraper([f"{launcher.api_url}/metrics"], lambda: worker_metrics_urls(redis_url))
        for rate in rates:
            started = time.monotonic()
            measured = run_load(config, rate, scraper)
            _check_alive(launcher)
            metrics = RunMetrics.of(list(measured.records))
            runs.append(Run(deployment.name, rate, metrics, measured.records, measured.extras_json()))
            print(f"   {_label(rate)}: done in {time.monotonic() - started:.0f} s", flush=True)
            print(measured.report(), flush=True)
    finally:
        launcher.stop()
    shutil.rmtree(launcher.log_dir, ignore_errors=True)  # kept above when the deployment failed


def load_runner(args: argparse.Namespace, workload: Workload) -> tuple[list[float | None], LoadRunner]:
    """The loads of the options (the rates, or the replayed trace) and how one of them runs."""
    from dejavu_common.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model_folder)
    rates: list[float | None] = [None] if args.trace else list(args.rates)
    if args.dataset_name is DatasetName.MULTI_TURN:
        chats = workloads.multi_turn_dataset(args, args.output_len)

        def run_chats(config: ClientConfig, rate: float | None, scraper: Scraper) -> Measured:
            runner = ConversationRunner(LoadGenerator(config), chats, tokenizer)
            return workloads.measure_turns(lambda: runner.run_sync(rate or math.inf), scraper)

        return rates, run_chats
    if args.dataset_name is DatasetName.PREFIX_REPETITION:
        shared = workloads.prefix_dataset(args, args.requests, args.output_len)
        ids, prefixes = TokenPrompts(token_pool(args.model_folder), seed=args.seed), shared.prefix_of()

        def run_shared(config: ClientConfig, rate: float | None, scraper: Scraper) -> Measured:
            generator = LoadGenerator(config, lambda r: shared.prompt(ids, r.rid, prefixes))
            return workloads.measure_load(lambda: generator.run_sync(shared.trace(rate or math.inf)), scraper)

        return rates, run_shared
    builder = PromptBuilder(tokenizer, seed=args.seed)
    replayed = Trace.load(args.trace) if args.trace else None

    def run_trace(config: ClientConfig, rate: float | None, scraper: Scraper) -> Measured:
        generator = LoadGenerator(config, lambda r: builder.text(r.prompt_len, r.rid))
        trace = replayed if rate is None else workload.trace(rate)
        return workloads.measure_load(lambda: generator.run_sync(trace), scraper)

    return rates, run_trace


def _check_alive(launcher: Launcher) -> None:
    """Raise if any process of the deployment has exited: a run with a dead worker measures nothing.

    (``Launcher.check_children`` would restart a dead worker instead, hiding the failure.)
    """
    dead = [f"{c.name} (exit {c.proc.returncode})" for c in launcher.children if c.proc and c.proc.poll() is not None]
    if dead:
        raise RuntimeError(f"{', '.join(dead)} exited during the run; logs in {launcher.log_dir}")


def _label(rate: float | None) -> str:
    return "trace" if rate is None else f"{rate:g} req/s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def print_table(runs: list[Run]) -> None:
    """One row per run; latencies in milliseconds (normalized latency: ms per generated token), the
    prefix cache's hit rate over the run ("-": no counters)."""
    head = (
        f"{'deployment':<22}{'load':>12}{'ok/n':>7}{'norm p50':>10}{'norm p99':>10}{'ttft p50':>10}"
        f"{'ttft p99':>10}{'tpot p50':>10}{'tpot p99':>10}{'tok/s':>8}{'req/s':>8}{'errors':>8}{'hit':>8}"
    )
    print(head)
    print("-" * len(head))
    for run in runs:
        m = run.metrics
        print(
            f"{run.deployment:<22}{_label(run.rate_per_s):>12}{f'{m.completed}/{m.requests}':>7}"
            f"{_ms(m.normalized_latency_s.median):>10}{_ms(m.normalized_latency_s.p99):>10}"
            f"{_ms(m.ttft_s.median):>10}{_ms(m.ttft_s.p99):>10}{_ms(m.tpot_s.median):>10}{_ms(m.tpot_s.p99):>10}"
            f"{m.output_throughput:>8.2f}{m.request_throughput:>8.3f}{m.failed:>8}{_hit_rate(run):>8}"
        )


def _hit_rate(run: Run) -> str:
    """The run's prefix-cache hit rate as a percentage, "-" without counters."""
    sources = run.extras.get("prefix_cache", {}).get("sources", {})
    rates = [s["hit_rate"] for s in sources.values() if s["hit_rate"] is not None]
    return f"{rates[0]:.0%}" if rates else "-"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Without --base-url: the paper's experiment, options below.",
        epilog="dejavu bench serve --base-url URL --help: the options of the URL mode.",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.15], help="Request rates (req/s).")
    p.add_argument("--requests", type=int, default=6, help="Requests per rate.")
    p.add_argument("--prompt-len", type=int, default=1000, help="Prompt length in tokens.")
    p.add_argument("--median-new", type=int, default=64, help="Median of the generated-length distribution.")
    p.add_argument("--sigma", type=float, default=0.9, help="Log-space sigma of the generated lengths.")
    p.add_argument("--min-new", type=int, default=8, help="Generated lengths are clipped to [min, max].")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--microbatch", type=int, default=4, help="Prompt and token microbatch size of both systems.")
    p.add_argument("--batch-wait-ms", type=float, default=20.0, help="How long a partial microbatch waits.")
    p.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS))
    p.add_argument("--trace", type=Path, default=None, help="Replay this trace file instead of the rates.")
    p.add_argument(
        "--dataset",
        type=DatasetName,
        choices=list(DatasetName),
        metavar="{random,prefix-repetition,multi-turn}",
        default=DatasetName.RANDOM,
        dest="dataset_name",
        help="random: the paper's fixed prompts and LMSys-like lengths (the default); prefix-repetition\n"
        "(--requests over shared prefixes) or multi-turn chats: options below.",
    )
    p.add_argument(
        "--output-len", type=int, default=64, help="Output tokens of prefix-repetition and multi-turn (default 64)."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="Generate exactly each request's length.")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="Deadline of one request.")
    p.add_argument("--run-timeout-s", type=float, default=300.0, help="Bound of one rate's run.")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="Bound of a deployment's start.")
    p.add_argument("--model-folder", type=Path, default=None, help="Checkpoint (default: the prepared SmolLM2).")
    p.add_argument("--out", type=Path, default=RESULTS / "serve.json", help="JSON result; the PNGs go beside it.")
    p.add_argument("--quick", action="store_true", help=f"Smoke run (~3 min), sets {QUICK}.")
    workloads.add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    try:
        if args.trace is not None and args.dataset_name is not DatasetName.RANDOM:
            raise ValueError("--trace replays its own lengths: drop --dataset")
        args.dataset = dataset(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.model_folder is None:
        from dejavu_engine.checkpoint import ensure_default_model

        args.model_folder = ensure_default_model(Settings())
    return args


def dataset(args: argparse.Namespace) -> workloads.PrefixRepetitionDataset | workloads.MultiTurnDataset | None:
    """The prefix-sharing dataset of the options (None: the paper's workload); raises ``ValueError``."""
    if args.dataset_name is DatasetName.PREFIX_REPETITION:
        return workloads.prefix_dataset(args, args.requests, args.output_len)
    if args.dataset_name is DatasetName.MULTI_TURN:
        return workloads.multi_turn_dataset(args, args.output_len)
    return None


def workload_json(args: argparse.Namespace, workload: Workload) -> dict:
    """The workload as the JSON records it: the dataset's shape, or the replayed trace's path."""
    if args.trace is not None:
        return {"trace": str(args.trace)}
    if args.dataset is not None:
        return {"dataset": args.dataset_name.value, **asdict(args.dataset)}
    return asdict(workload)


def result_json(
    args: argparse.Namespace, base: Settings, workload: Workload, runs: list[Run], failed: dict[str, str]
) -> dict:
    """The serve.json document: configuration, deployments that failed to start, and every run."""
    return {
        "benchmark": "serve",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "config": {
            "workload": workload_json(args, workload),
            "rates": args.rates if args.trace is None else None,
            "microbatch": args.microbatch,
            "batch_wait_ms": args.batch_wait_ms,
            "ignore_eos": args.ignore_eos,
            "torch_threads_per_worker": 1,
            "transport": base.transport.kind,
            "replication": base.recovery.replication.value,
            "swap": base.swap.enabled,
            "deployments": {DEPLOYMENTS[k].name: asdict(DEPLOYMENTS[k]) for k in args.deployments},
            "quick": args.quick,
        },
        "failed": failed,
        "runs": [r.to_json() for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    """With ``--base-url``, benchmark that server (``serve_url``). Otherwise run every deployment at
    every load; exit 1 if a deployment failed to start or died."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--base-url" or a.startswith("--base-url=") for a in argv):
        from benchmarks import serve_url

        return serve_url.main(argv)
    args = parse_args(argv)
    stop_on_sigterm()  # stopped, it still stops the deployments it started
    workload = Workload(
        args.requests, args.prompt_len, args.median_new, args.sigma, args.min_new, args.max_new, args.seed
    )
    rates, run_load = load_runner(args, workload)
    if args.dataset is None:
        trace = Trace.load(args.trace) if args.trace else workload.trace(args.rates[0])
        print(f"new_tokens per request: {[r.new_tokens for r in trace.requests]}", flush=True)
    base = Settings()
    runs: list[Run] = []
    failed: dict[str, str] = {}
    for key in args.deployments:
        deployment = DEPLOYMENTS[key]
        try:
            measure(deployment, deployment_settings(base, deployment, args), rates, run_load, args, runs)
        except (RuntimeError, TimeoutError, OSError) as exc:
            failed[deployment.name] = str(exc)
            print(f"!! {deployment.name} failed: {exc}", flush=True)
    print_table(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = result_json(args, base, workload, runs, failed)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    if runs:
        for png in write_plots(json.loads(json.dumps(doc)), args):
            print(f"wrote {png}")
    return 1 if failed else 0


def write_plots(doc: dict, args: argparse.Namespace) -> list[Path]:
    """The plots of ``doc`` (this run's serve.json) beside ``args.out``: normalized latency against the
    rate (not for a replayed trace) and the percentiles per load; the paths written."""
    if args.trace:
        title = f"trace {args.trace.name}"
    elif args.dataset is not None:
        title = f"{args.dataset_name.value}, {args.output_len} tokens out"
    else:
        title = f"{args.prompt_len}-token prompts, LMSys-like generated lengths, {args.requests} requests per rate"
    written = []
    if args.trace is None:
        plot_rates(doc, args.out.with_suffix(".png"), title, str(args.out))
        written.append(args.out.with_suffix(".png"))
    percentiles = args.out.with_name(f"{args.out.stem}-percentiles.png")
    plot_serve([serve_result(doc, str(args.out))], percentiles, title)
    return [*written, percentiles]


if __name__ == "__main__":
    sys.exit(main())
