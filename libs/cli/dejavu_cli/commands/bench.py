"""``dejavu bench NAME [ARGS...]``: run ``benchmarks/bench_NAME.py`` of the repository."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="Run benchmarks/bench_NAME.py with the remaining arguments.")
    parser.add_argument("name", help="Benchmark name, e.g. 'engine' for benchmarks/bench_engine.py.")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="Arguments passed to the benchmark script.")
    parser.set_defaults(func=run_bench)


def benchmarks_dir() -> Path | None:
    """The repository's benchmarks/ folder: above this (editable) package, else above the cwd."""
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for folder in (start, *start.parents):
            if (folder / "benchmarks").is_dir() and (folder / "pyproject.toml").is_file():
                return folder / "benchmarks"
    return None


def run_bench(args: argparse.Namespace) -> int:
    """Run the script in a child Python with the same interpreter; return its exit code."""
    from dejavu_cli.main import CLIError

    folder = benchmarks_dir()
    if folder is None:
        raise CLIError("benchmarks/ not found: run from the repository checkout")
    script = folder / f"bench_{args.name}.py"
    if not script.is_file():
        available = sorted(p.stem.removeprefix("bench_") for p in folder.glob("bench_*.py"))
        raise CLIError(f"no benchmark {args.name!r}; available: {', '.join(available) or 'none'}")
    return subprocess.call([sys.executable, str(script), *args.args], cwd=folder.parent)
