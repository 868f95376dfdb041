"""The prefix-sharing workloads of ``dejavu bench serve``, in both its modes: their options, and one
measured run of either with the server's prefix-cache hit rates beside it.

- ``prefix-repetition``: :class:`benchmarks.dataset.PrefixRepetitionDataset` (vLLM's
  ``prefix_repetition``), token-id prompts through ``/v1/completions``;
- ``multi-turn``: :class:`benchmarks.conversations.MultiTurnDataset`, chats through
  ``/v1/chat/completions`` that re-send their history, with TTFT per turn.

Every run of any dataset scrapes the server's Prometheus counters before and after
(:mod:`benchmarks.prefix_cache`), so the hit rates stand beside the latencies.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.conversations import MultiTurnDataset, Turn, later_turns, per_turn, turn_report
from benchmarks.dataset import PrefixRepetitionDataset
from benchmarks.loadgen import RequestRecord
from benchmarks.prefix_cache import CacheReport, Scraper


class DatasetName(str, enum.Enum):
    """The datasets of ``dejavu bench serve``; the first is the mode's own random-lengths dataset."""

    RANDOM = "random"  # --base-url: vLLM's random dataset; without: the paper's LMSys-like lengths
    PREFIX_REPETITION = "prefix-repetition"
    MULTI_TURN = "multi-turn"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the two prefix-sharing datasets (their output length is the mode's own option)."""
    g = p.add_argument_group("prefix-repetition dataset (--dataset prefix-repetition)")
    g.add_argument(
        "--num-prefixes",
        "--prefix-repetition-num-prefixes",
        dest="num_prefixes",
        type=int,
        default=10,
        help="Shared prefixes the requests are dealt over (default: %(default)s).",
    )
    g.add_argument(
        "--prefix-len",
        "--prefix-repetition-prefix-len",
        dest="prefix_len",
        type=int,
        default=256,
        help="Tokens of each prefix (default: %(default)s).",
    )
    g.add_argument(
        "--suffix-len",
        "--prefix-repetition-suffix-len",
        dest="suffix_len",
        type=int,
        default=256,
        help="Tokens of each request's own suffix (default: %(default)s).",
    )
    g = p.add_argument_group("multi-turn chat dataset (--dataset multi-turn)")
    g.add_argument("--num-conversations", type=int, default=4, help="Conversations per run (default: %(default)s).")
    g.add_argument("--num-turns", type=int, default=3, help="Turns of each conversation (default: %(default)s).")
    g.add_argument("--user-len", type=int, default=64, help="Tokens of each user message (default: %(default)s).")
    g.add_argument(
        "--think-time-s",
        type=float,
        default=0.0,
        help="Seconds between an answer and the conversation's next turn (default: %(default)s).",
    )


def prefix_dataset(args: argparse.Namespace, num_prompts: int, output_len: int) -> PrefixRepetitionDataset:
    """The prefix-repetition dataset of the options; raises ``ValueError`` for impossible values."""
    return PrefixRepetitionDataset(
        num_prompts, args.num_prefixes, args.prefix_len, args.suffix_len, output_len, args.seed
    )


def multi_turn_dataset(args: argparse.Namespace, output_len: int) -> MultiTurnDataset:
    """The multi-turn dataset of the options; raises ``ValueError`` for impossible values."""
    return MultiTurnDataset(
        args.num_conversations, args.num_turns, args.user_len, output_len, args.think_time_s, args.seed
    )


@dataclass(frozen=True)
class Measured:
    """One run's records, its turns (multi-turn only) and the prefix cache's figures over it."""

    records: tuple[RequestRecord, ...]
    turns: tuple[Turn, ...] | None
    prefix_cache: CacheReport

    def extras_json(self) -> dict:
        """The fields a run's JSON adds to the metrics: ``prefix_cache``, and for a multi-turn run
        ``per_turn`` (TTFT per turn number) and ``later_turns`` (every turn after the first)."""
        out: dict = {"prefix_cache": self.prefix_cache.to_json()}
        if self.turns is not None:
            out["per_turn"] = [s.to_json() for s in per_turn(list(self.turns))]
            out["later_turns"] = later_turns(list(self.turns)).to_json()
        return out

    def report(self) -> str:
        """The text printed after a run's result block: TTFT by turn, then the hit rates."""
        parts = [turn_report(list(self.turns))] if self.turns is not None else []
        return "\n".join([*parts, *self.prefix_cache.lines()])


def measure_load(run: Callable[[], list[RequestRecord]], scraper: Scraper) -> Measured:
    """Scrape, ``run`` a trace (its records), scrape again."""
    before = scraper.scrape()
    records = run()
    return Measured(tuple(records), None, CacheReport.between(before, scraper.scrape()))


def measure_turns(run: Callable[[], list[Turn]], scraper: Scraper) -> Measured:
    """Scrape, ``run`` the conversations (their turns), scrape again."""
    before = scraper.scrape()
    turns = run()
    report = CacheReport.between(before, scraper.scrape())
    return Measured(tuple(t.record for t in turns), tuple(turns), report)
