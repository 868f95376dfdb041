"""`dejavu bench plot`: draw the plots of saved benchmark results again, several servers side by side.

    dejavu bench plot serve ours.json vllm.json --out compare.png    # two servers, the same workload
    dejavu bench plot serve benchmarks/results/serve-url.json        # one result (beside it, .png)
    dejavu bench plot chaos benchmarks/results/chaos.json --out chaos.svg

``serve`` takes results of ``dejavu bench serve`` (``--base-url`` mode, or the paper's experiment) for
the same workload: throughput and TTFT, TPOT and ITL percentiles per load, one bar per system (named
by each result's ``--label``). ``chaos`` takes one ``chaos.json``: its timeline of faults and
recoveries. The suffix of ``--out`` picks PNG or SVG. Exit status 2 if a file cannot be plotted (the
message names it and what is wrong); nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.*
from benchmarks.plots import ResultError, load_result, plot_chaos, plot_serve, read_serve


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dejavu bench plot", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("kind", choices=["serve", "chaos"], help="Which benchmark's results.")
    p.add_argument("results", type=Path, nargs="+", help="Result JSON files (chaos: one).")
    p.add_argument("--out", type=Path, default=None, help="The plot, .png or .svg (default: beside the first file).")
    p.add_argument("--title", default=None, help="Title of the figure (default: the files' names).")
    args = p.parse_args(argv)
    if args.kind == "chaos" and len(args.results) != 1:
        p.error("chaos plots one result file")
    if args.out is None:
        first = args.results[0]
        args.out = first.with_suffix(".png") if len(args.results) == 1 else first.with_name(f"{first.stem}-compare.png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    title = args.title or " vs ".join(path.name for path in args.results)
    try:
        if args.kind == "serve":
            plot_serve([read_serve(path) for path in args.results], args.out, title)
        else:
            plot_chaos(load_result(args.results[0]), args.out, title, str(args.results[0]))
    except ResultError as exc:
        print(f"dejavu bench plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
