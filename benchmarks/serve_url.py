"""`dejavu bench serve --base-url URL`: benchmark any running OpenAI-compatible server (ours or a peer's).

Options and metrics follow ``vllm bench serve`` so that a vLLM user reads the figures as theirs:

    dejavu bench serve --base-url http://127.0.0.1:8000 --input-len 256 --output-len 128 \\
        --num-prompts 16 --ignore-eos --max-concurrency 16 1 --goodput ttft:2000 tpot:200

The workload is a seeded random token-id dataset (:mod:`benchmarks.dataset`): exact input lengths
(optionally spread by ``--range-ratio``), output lengths fixed, spread, or LMSys-like
(``--output-dist lmsys``), or a replayed planner trace (``--trace``). Requests stream
``/v1/completions`` with the prompt as token ids. Load is set by ``--request-rate`` (requests per
second, Poisson or gamma arrivals with ``--burstiness``; ``inf``, the default, sends all at once)
and ``--max-concurrency`` (requests in flight at most); several values of either give one run per
combination, on the same requests. After an unmeasured warm-up request, each run prints a
vLLM-style result block; the JSON (configuration, metrics with vLLM's keys, every request's
record) and a plot go to ``--out`` (default ``benchmarks/results/serve-url.json`` and ``.png``): per
load, output throughput and TTFT, TPOT and ITL at p50, p90 and p99 (:func:`benchmarks.plots.plot_serve`),
beside those of the results given with ``--compare`` (other servers measured on the same workload).
Exit status 1 if a request of any run failed or the server could not be reached.

``--dataset prefix-repetition`` (shared prefixes, vLLM's ``prefix_repetition``) and ``--dataset
multi-turn`` (chats that re-send their history through ``/v1/chat/completions``, with TTFT per turn)
exercise a server's prefix cache (:mod:`benchmarks.workloads`). Every run reports the prefix-cache
hit rates beside its figures, from the Prometheus counters at ``--metrics-url`` (default: the
server's ``/metrics``, where vLLM has them) and, with ``--dejavu-redis``, at every worker of that
DejaVu deployment (which serves them with ``DEJAVU_WORKER__METRICS_PORT=0``); absent counters are
reported as absent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from benchmarks import workloads
from benchmarks.conversations import ConversationRunner
from benchmarks.dataset import OutputDist, PrefixRepetitionDataset, RandomDataset, TokenPrompts, token_pool
from benchmarks.loadgen import ClientConfig, LoadGenerator, RequestRecord
from benchmarks.metrics import SLO, RunMetrics, report
from benchmarks.plots import (
    ServeResult,
    check_comparable,
    load_label,
    plot_serve,
    read_serve,
    serve_result,
)
from benchmarks.prefix_cache import Scraper, worker_metrics_urls
from benchmarks.workloads import DatasetName, Measured
from dejavu_planner.trace import Trace

if TYPE_CHECKING:
    from dejavu_common.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Load:
    """One run's load: arrival rate (inf: all at once; None: the replayed trace's arrival times),
    burstiness, and the bound on requests in flight (None: no bound)."""

    request_rate: float | None
    burstiness: float
    max_concurrency: int | None

    @property
    def label(self) -> str:
        return load_label(self.request_rate, self.max_concurrency)

    @property
    def rate_json(self) -> float | str | None:
        """The rate as JSON can hold it (JSON has no infinity)."""
        return "inf" if self.request_rate is not None and math.isinf(self.request_rate) else self.request_rate


@dataclass(frozen=True)
class TargetRun:
    """One run's outcome; ``loadavg`` is the host's 1/5/15-minute load average at its end (a noisy,
    shared host shows there); ``extras``: the prefix-cache hit rates and, for a multi-turn run, TTFT
    per turn (:meth:`benchmarks.workloads.Measured.extras_json`)."""

    load: Load
    metrics: RunMetrics
    records: tuple[RequestRecord, ...]
    loadavg: tuple[float, float, float]
    extras: dict

    def to_json(self) -> dict:
        return {
            "request_rate": self.load.rate_json,
            "burstiness": self.load.burstiness,
            "max_concurrency": self.load.max_concurrency,
            "host_loadavg": self.loadavg,
            **self.metrics.to_json(),
            **self.extras,
            "records": [r.to_json() for r in self.records],
        }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dejavu bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", required=True, help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is ok).")
    p.add_argument("--endpoint", default="/v1/completions", help="Path under the base URL (default: %(default)s).")
    p.add_argument("--model", default=None, help="Model id to request (default: the first of GET /v1/models).")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY if set).")
    p.add_argument("--label", default=None, help="Name of the system under test in the JSON and plot.")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="Checkpoint folder or tokenizer.json whose vocabulary the "
        "prompts draw from (default: the prepared SmolLM2).",
    )
    p.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset_name",
        type=DatasetName,
        choices=list(DatasetName),
        metavar="{random,prefix-repetition,multi-turn}",
        default=DatasetName.RANDOM,
        help="random token ids (the default), shared prefixes, or multi-turn chats (groups below).",
    )
    g = p.add_argument_group("dataset (random token ids)")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=16,
        help="Requests per run, also of prefix-repetition (default: %(default)s).",
    )
    g.add_argument(
        "--input-len", "--random-input-len", dest="input_len", type=int, default=256, help="(default: %(default)s)"
    )
    g.add_argument(
        "--output-len",
        "--random-output-len",
        "--prefix-repetition-output-len",
        dest="output_len",
        type=int,
        default=128,
        help="Output length of every dataset, the median with --output-dist lmsys (default: %(default)s).",
    )
    g.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="Lengths uniform in len * [1 - r, 1 + r] (default: %(default)s).",
    )
    g.add_argument(
        "--output-dist",
        type=OutputDist,
        choices=list(OutputDist),
        metavar="{uniform,lmsys}",
        default=OutputDist.UNIFORM,
        help="uniform (vLLM's random dataset; the default) or lmsys (log-normal, LMSys-Chat-like skew).",
    )
    g.add_argument("--lmsys-sigma", type=float, default=0.9, help="Log-space sigma of lmsys (default: %(default)s).")
    g.add_argument("--max-output-len", type=int, default=1024, help="Clip of lmsys (default: %(default)s).")
    g.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Replay this planner trace (CSV/JSON) instead: its "
        "arrival times and lengths; --num-prompts/--request-rate do not apply.",
    )
    g.add_argument("--seed", type=int, default=0, help="Of lengths, prompts and arrivals (default: %(default)s).")
    workloads.add_arguments(p)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="Requests per second (default inf: all at once), of multi-turn: conversation starts per "
        "second; several values give several runs.",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (default 1: Poisson).")
    g.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=[None],
        help="Requests in flight at most (default: no bound); several values give several runs.",
    )
    g = p.add_argument_group("prefix-cache hit rates")
    g.add_argument(
        "--metrics-url",
        nargs="*",
        default=None,
        metavar="URL",
        help="Prometheus endpoints scraped before and after each run, counters summed (default: BASE_URL/metrics; "
        "none: no scrape).",
    )
    g.add_argument(
        "--dejavu-redis",
        default=None,
        metavar="REDIS_URL",
        help="Also scrape every live worker registered in this DejaVu deployment's Redis (its workers serve "
        "metrics with DEJAVU_WORKER__METRICS_PORT=0).",
    )
    g = p.add_argument_group("requests and results")
    g.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos: generate exactly the output length.")
    g.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:200 (names: ttft, tpot, e2el).",
    )
    g.add_argument(
        "--num-warmups", type=int, default=1, help="Unmeasured requests before the runs (default: %(default)s)."
    )
    g.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="Deadline of one request (default: %(default)s)."
    )
    g.add_argument("--run-timeout-s", type=float, default=1800.0, help="Bound of one run (default: %(default)s).")
    g.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "serve-url.json",
        help="JSON result; the PNG goes beside it (default: results/serve-url.json).",
    )
    g.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=[],
        metavar="JSON",
        help="Results of other servers on the same workload (their --out files), drawn beside this run's.",
    )
    args = p.parse_args(argv)
    try:
        args.slo = SLO.parse(args.goodput) if args.goodput else None
        args.dataset = dataset(args)
        if any(c is not None and c < 1 for c in args.max_concurrency):
            raise ValueError("--max-concurrency must be >= 1")
        if args.num_warmups < 0:
            raise ValueError("--num-warmups must be >= 0")
        if args.trace is not None and args.request_rate != [math.inf]:
            raise ValueError("--trace brings its own arrival times: drop --request-rate")
        if args.trace is not None and args.dataset_name is not DatasetName.RANDOM:
            raise ValueError("--trace replays its own lengths: drop --dataset")
        args.compared = compared(args)  # ResultError is a ValueError: a bad file fails before any request
    except ValueError as exc:
        p.error(str(exc))
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.metrics_url is None:
        args.metrics_url = [f"{args.base_url}/metrics"]
    return args


def dataset(args: argparse.Namespace) -> RandomDataset | PrefixRepetitionDataset | workloads.MultiTurnDataset:
    """The dataset of the options; raises ``ValueError`` for impossible lengths, before any request."""
    if args.dataset_name is DatasetName.PREFIX_REPETITION:
        return workloads.prefix_dataset(args, args.num_prompts, args.output_len)
    if args.dataset_name is DatasetName.MULTI_TURN:
        return workloads.multi_turn_dataset(args, args.output_len)
    random_ids = RandomDataset(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.output_dist,
        args.lmsys_sigma,
        args.max_output_len,
        args.seed,
    )
    random_ids.lengths()
    return random_ids


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id of ``GET /v1/models``; raises ``RuntimeError`` saying why there is none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"cannot list the models at {base_url}/v1/models ({exc}); pass --model") from exc


def loads(args: argparse.Namespace) -> list[Load]:
    """One load per (rate, concurrency) combination; a replayed trace brings its own arrival times."""
    rates: list[float | None] = [None] if args.trace is not None else args.request_rate
    return [Load(rate, args.burstiness, conc) for rate, conc in itertools.product(rates, args.max_concurrency)]


def measure(
    args: argparse.Namespace,
    config: ClientConfig,
    prompts: TokenPrompts,
    save: Callable[[list[TargetRun]], None],
    scraper: Scraper,
) -> list[TargetRun]:
    """Warm up, then one run per load, each on the same requests; prints each run's result block (with
    the prefix-cache hit rates, scraped by ``scraper``) and calls ``save`` with the runs so far after
    each. Raises ``RuntimeError`` if a warm-up request fails (the server is not serving), ``ValueError``
    if a multi-turn run's tokenizer has no usable words."""
    if args.num_warmups:
        warm = Trace.of([(0.0, 16, 4)] * args.num_warmups)
        for record in LoadGenerator(config, lambda r: prompts.ids(16, -1 - r.rid)).run_sync(warm):
            if not record.ok:
                raise RuntimeError(f"the warm-up request failed ({record.status.value}): {record.error}")
    replayed = Trace.load(args.trace) if args.trace is not None else None
    runs = []
    for load in loads(args):
        measured = _run_load(
            args, load, replace(config, max_concurrency=load.max_concurrency), prompts, replayed, scraper
        )
        records = list(measured.records)
        run = TargetRun(
            load, RunMetrics.of(records, args.slo), measured.records, os.getloadavg(), measured.extras_json()
        )
        print(f"Traffic request rate: {load.rate_json or 'trace'}")
        print(f"Burstiness factor: {load.burstiness:g}")
        print(f"Maximum request concurrency: {load.max_concurrency}")
        print(report(run.metrics, "Serving Benchmark Result", args.slo))
        print(measured.report())
        print("Host load average (1/5/15 min): {:.1f} / {:.1f} / {:.1f}".format(*run.loadavg), flush=True)
        failures = [r for r in records if not r.ok]
        if failures:
            print(f"{len(failures)} requests failed, e.g. {failures[0].status.value}: {failures[0].error}")
        runs.append(run)
        save(runs)
    return runs


def _run_load(
    args: argparse.Namespace,
    load: Load,
    config: ClientConfig,
    prompts: TokenPrompts,
    replayed: Trace | None,
    scraper: Scraper,
) -> Measured:
    """One run of the dataset (or the replayed trace) at ``load``, between two scrapes."""
    if isinstance(args.dataset, workloads.MultiTurnDataset):
        runner = ConversationRunner(LoadGenerator(config), args.dataset, args.chat_tokenizer)
        rate = math.inf if load.request_rate is None else load.request_rate
        return workloads.measure_turns(lambda: runner.run_sync(rate, load.burstiness), scraper)
    trace = replayed or args.dataset.trace(load.request_rate, load.burstiness)
    generator = LoadGenerator(config, _prompt_of(args.dataset, prompts))
    return workloads.measure_load(lambda: generator.run_sync(trace), scraper)


def chat_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of the checkpoint folder (or of the folder of a ``tokenizer.json``) the multi-turn
    user messages are built with; raises ``ValueError`` (``TokenizerError``) without one."""
    from dejavu_common.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(path if path.is_dir() else path.parent)


def _prompt_of(dataset: RandomDataset | PrefixRepetitionDataset, prompts: TokenPrompts):
    """Each request's prompt: for prefix-repetition its prefix and suffix ids, else ``prompt_len``
    random ids varied by its request id."""
    if isinstance(dataset, PrefixRepetitionDataset):
        prefixes = dataset.prefix_of()
        return lambda request: dataset.prompt(prompts, request.rid, prefixes)
    return lambda request: prompts.ids(request.prompt_len, request.rid)


def plot(args: argparse.Namespace, model: str, runs: list[TargetRun], path: Path, title: str) -> None:
    """This run's plot, beside the ``--compare`` results (:func:`benchmarks.plots.plot_serve`)."""
    this = serve_result(json.loads(json.dumps(result_json(args, model, runs))), str(args.out))
    plot_serve([this, *args.compared], path, title)


def workload_json(args: argparse.Namespace) -> dict:
    """The workload as the JSON records it: the dataset, or the replayed trace's path."""
    if args.trace:
        return {"trace": str(args.trace)}
    if args.dataset_name is not DatasetName.RANDOM:
        return {"dataset": args.dataset_name.value, **asdict(args.dataset)}
    return {**asdict(args.dataset), "output_dist": args.output_dist.value}


def workload_title(args: argparse.Namespace) -> str:
    """The workload in a few words, for the plot's title."""
    if args.trace:
        return f"trace {args.trace.name}"
    d = args.dataset
    if isinstance(d, PrefixRepetitionDataset):
        return f"{d.num_prompts} over {d.num_prefixes} prefixes x {d.prefix_len} + {d.suffix_len} -> {d.output_len}"
    if isinstance(d, workloads.MultiTurnDataset):
        return f"{d.num_conversations} chats x {d.num_turns} turns of {d.user_len} -> {d.output_len}"
    return f"{d.num_prompts} x {d.input_len} -> {d.output_len}"


def compared(args: argparse.Namespace) -> list[ServeResult]:
    """The ``--compare`` results, each checked to be a serve-url result of this run's workload; raises
    :class:`ResultError` naming the file that is not."""
    results = [read_serve(path) for path in args.compare]
    this = {"workload": json.loads(json.dumps(workload_json(args))), "ignore_eos": args.ignore_eos}
    check_comparable([ServeResult("this run", "serve-url", this, ()), *results])
    return results


def result_json(args: argparse.Namespace, model: str, runs: list[TargetRun]) -> dict:
    workload = workload_json(args)
    return {
        "benchmark": "serve-url",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "config": {
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": model,
            "label": args.label or args.base_url,
            "workload": workload,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "goodput": str(args.slo) if args.slo else None,
            "num_warmups": args.num_warmups,
        },
        "runs": [r.to_json() for r in runs],
    }


def save(args: argparse.Namespace, model: str, runs: list[TargetRun]) -> None:
    """Write the JSON of the runs so far (after each run: a later failure loses nothing)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result_json(args, model, runs), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer is None:
        from dejavu_common.settings import Settings
        from dejavu_engine.checkpoint import ensure_default_model

        args.tokenizer = ensure_default_model(Settings())
    try:
        prompts = TokenPrompts(token_pool(args.tokenizer), seed=args.seed)
        multi_turn = args.dataset_name is DatasetName.MULTI_TURN
        args.chat_tokenizer = chat_tokenizer(args.tokenizer) if multi_turn else None
        model = args.model or discover_model(args.base_url, args.api_key)
        config = ClientConfig(
            args.base_url,
            model,
            args.api_key,
            args.request_timeout_s,
            args.run_timeout_s,
            temperature=args.temperature,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            endpoint=args.endpoint,
        )
        discover = (lambda: worker_metrics_urls(args.dejavu_redis)) if args.dejavu_redis else None
        auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        scraper = Scraper(args.metrics_url, discover, auth)
        runs = measure(args, config, prompts, lambda runs: save(args, model, runs), scraper)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 1
    print(f"wrote {args.out}")
    png = args.out.with_suffix(".png")
    plot(args, model, runs, png, f"{model}: {workload_title(args)}{', ignore_eos' if args.ignore_eos else ''}")
    print(f"wrote {png}")
    return 1 if any(r.metrics.failed for r in runs) else 0
