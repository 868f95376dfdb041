"""Seeded synthetic workloads for serving benchmarks: lengths, arrival times and token-id prompts.

Like ``vllm bench serve --dataset-name random``: each request's prompt is a sequence of random token
ids of the served model's vocabulary (special tokens excluded) and it asks for a given number of
new tokens. Prompts are sent as token ids, so the input lengths are exact on any server that
accepts token-id prompts, whatever its tokenizer does to text. Everything is a pure function of
the seed: two runs (or two servers) get the same requests.

:class:`PrefixRepetitionDataset` is vLLM's ``prefix_repetition``: a few shared prefixes (system
prompts), each request one of them followed by a suffix of its own, so a server with a prefix cache
computes every prefix once. The multi-turn chat dataset is in :mod:`benchmarks.conversations`.
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dejavu_planner.trace import Trace, arrivals, lmsys_like_trace


class OutputDist(str, enum.Enum):
    """How output lengths are drawn."""

    UNIFORM = "uniform"  # uniform in output_len * [1 - range_ratio, 1 + range_ratio] (vLLM's random dataset)
    LMSYS = "lmsys"  # log-normal with median output_len, LMSys-Chat-1M-like skew (dejavu_planner.trace)


def uniform_lengths(count: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """``count`` integers uniform in ``[floor(mean * (1 - r)), ceil(mean * (1 + r))]``, at least 1.

    ``range_ratio`` 0 gives ``mean`` every time; it must lie in [0, 1).
    """
    if mean < 1:
        raise ValueError(f"a length must be >= 1 (got {mean})")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1) (got {range_ratio})")
    low, high = max(1, math.floor(mean * (1 - range_ratio))), math.ceil(mean * (1 + range_ratio))
    return [rng.randint(low, high) for _ in range(count)]


def arrival_times(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of ``count`` requests at ``request_rate`` per second on average.

    ``inf`` sends all at 0. Otherwise the gaps are gamma-distributed with shape ``burstiness`` and
    mean ``1 / request_rate``: burstiness 1 is a Poisson process, below 1 burstier, above 1 more
    regular (vLLM's ``--burstiness``).
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive or inf (got {request_rate})")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive (got {burstiness})")
    rng = random.Random(seed)
    if math.isinf(request_rate):
        return [0.0] * count
    if burstiness == 1.0:
        return arrivals(count, request_rate, rng)
    now, times = 0.0, []
    for _ in range(count):
        now += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        times.append(now)
    return times


@dataclass(frozen=True)
class RandomDataset:
    """``num_prompts`` requests: input lengths uniform around ``input_len``, output lengths from
    ``output_dist`` (for LMSys: median ``output_len``, log-space ``sigma``, clipped to ``max_output_len``)."""

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    output_dist: OutputDist = OutputDist.UNIFORM
    sigma: float = 0.9
    max_output_len: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1 (got {self.num_prompts})")

    def lengths(self) -> list[tuple[int, int]]:
        """(input, output) length of every request; raises ``ValueError`` for impossible lengths."""
        rng = random.Random(self.seed)
        inputs = uniform_lengths(self.num_prompts, self.input_len, self.range_ratio, rng)
        if self.output_dist is OutputDist.UNIFORM:
            outputs = uniform_lengths(self.num_prompts, self.output_len, self.range_ratio, rng)
        else:
            if self.output_len < 1 or self.max_output_len < 1:
                raise ValueError("output_len and max_output_len must be >= 1")
            drawn = lmsys_like_trace(
                self.num_prompts, 1, self.output_len, self.sigma, self.max_output_len, None, self.seed + 1
            )
            outputs = [r.new_tokens for r in drawn.requests]
        return list(zip(inputs, outputs, strict=True))

    def trace(self, request_rate: float = math.inf, burstiness: float = 1.0) -> Trace:
        """The requests with their arrival times (the same lengths at every rate)."""
        times = arrival_times(self.num_prompts, request_rate, burstiness, self.seed)
        return Trace.of([(t, n_in, n_out) for t, (n_in, n_out) in zip(times, self.lengths(), strict=True)])


@dataclass(frozen=True)
class PrefixRepetitionDataset:
    """``num_prompts`` requests over ``num_prefixes`` shared prefixes of ``prefix_len`` token ids, each
    followed by a suffix of ``suffix_len`` ids of its own, asking ``output_len`` tokens (vLLM's
    ``prefix_repetition``).

    The prefixes are dealt to the requests in turn (every prefix serves ``num_prompts // num_prefixes``
    requests, the first ``num_prompts % num_prefixes`` one more) and the order is shuffled with the
    seed, so which request repeats which prefix is a pure function of the seed, and every prefix repeats
    as soon as there are at least two requests per prefix.
    """

    num_prompts: int
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefixes < 1 or self.prefix_len < 1 or self.output_len < 1 or self.suffix_len < 0:
            raise ValueError("num_prefixes, prefix_len and output_len must be >= 1 and suffix_len >= 0")
        if self.num_prompts < self.num_prefixes:
            raise ValueError(f"num_prompts ({self.num_prompts}) must be >= num_prefixes ({self.num_prefixes})")

    def prefix_of(self) -> list[int]:
        """The prefix index of every request, in request order."""
        dealt = [i % self.num_prefixes for i in range(self.num_prompts)]
        random.Random(self.seed).shuffle(dealt)
        return dealt

    def trace(self, request_rate: float = math.inf, burstiness: float = 1.0) -> Trace:
        """The requests with their arrival times (the same prompts at every rate)."""
        times = arrival_times(self.num_prompts, request_rate, burstiness, self.seed)
        prompt_len = self.prefix_len + self.suffix_len
        return Trace.of([(t, prompt_len, self.output_len) for t in times])

    def prompt(self, prompts: TokenPrompts, rid: int, prefixes: Sequence[int] | None = None) -> list[int]:
        """Request ``rid``'s token ids: its prefix, then its own suffix. ``prefixes`` is :meth:`prefix_of`
        (computed here when not given)."""
        which = (prefixes or self.prefix_of())[rid]
        # Prefixes and suffixes draw from disjoint key ranges, so no suffix equals a prefix by construction.
        return prompts.ids(self.prefix_len, -1_000_000 - which) + prompts.ids(self.suffix_len, rid)


class TokenPrompts:
    """Random token-id prompts drawn from ``pool`` (the allowed ids), a pure function of (seed, key)."""

    def __init__(self, pool: Sequence[int], seed: int = 0) -> None:
        if not pool:
            raise ValueError("the token pool is empty")
        self._pool = list(pool)
        self._seed = seed

    def ids(self, n_tokens: int, key: int = 0) -> list[int]:
        """``n_tokens`` ids; ``key`` (e.g. a request id) varies them."""
        rng = random.Random(self._seed * 1_000_003 + key)
        return rng.choices(self._pool, k=n_tokens)


def token_pool(tokenizer_path: Path) -> list[int]:
    """The ordinary token ids of a tokenizer (a checkpoint folder or its ``tokenizer.json``): every id
    of the vocabulary except added and special tokens, so no prompt holds an EOS or a chat marker."""
    from tokenizers import Tokenizer as HFTokenizer

    path = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
    if not path.is_file():
        raise ValueError(f"no tokenizer.json at {tokenizer_path}")
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"cannot read {path}: {exc}") from exc
    added = set(tokenizer.get_added_tokens_decoder())
    special = _special_ids(path.parent, tokenizer)
    return [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in added | special]


def _special_ids(folder: Path, tokenizer) -> set[int]:
    """Ids of the special tokens named in ``tokenizer_config.json`` (when the folder has one)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return set()
    names = json.loads(config.read_text())
    ids = set()
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = names.get(key)
        token = value.get("content") if isinstance(value, dict) else value
        if isinstance(token, str) and (i := tokenizer.token_to_id(token)) is not None:
            ids.add(i)
    return ids
