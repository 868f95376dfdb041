"""Entry point of the ``dejavu`` command: dispatches to the subcommand modules."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each name is a module of dejavu_cli.commands defining register(subparsers).
COMMANDS: tuple[str, ...] = (
    "model",
    "generate",
    "bench",
    "up",
    "admin",
    "plan",
    "simulate",
    "profile",
)


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dejavu", description="DejaVu: fault-tolerant, disaggregated LLM serving.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dejavu_cli.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"dejavu {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
