"""Request traces: the file format for real ones and synthetic generators.

A trace is a list of requests, each with an arrival time (seconds from the trace start), a
prompt length and the number of tokens it generates (the first of which the prompt yields).
Files are CSV with the header ``arrival_s,prompt_len,new_tokens`` or JSON
``{"requests": [{"arrival_s": .., "prompt_len": .., "new_tokens": ..}, ...]}``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

FIELDS = ("arrival_s", "prompt_len", "new_tokens")


@dataclass(frozen=True)
class Request:
    """One request of a trace; ``rid`` is its index in the trace."""

    rid: int
    arrival_s: float
    prompt_len: int
    new_tokens: int

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.prompt_len < 1 or self.new_tokens < 1:
            raise ValueError(f"invalid request {self}: arrival >= 0, prompt_len >= 1, new_tokens >= 1")


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival time."""

    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a trace needs at least one request")
        if any(b.arrival_s < a.arrival_s for a, b in zip(self.requests, self.requests[1:], strict=False)):
            raise ValueError("trace requests must be sorted by arrival_s")

    def __len__(self) -> int:
        return len(self.requests)

    @classmethod
    def of(cls, rows: list[tuple[float, int, int]]) -> Trace:
        """Build from ``(arrival_s, prompt_len, new_tokens)`` rows, sorting them by arrival."""
        ordered = sorted(rows, key=lambda row: row[0])
        return cls(tuple(Request(i, float(a), int(p), int(n)) for i, (a, p, n) in enumerate(ordered)))

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(FIELDS)
        for r in self.requests:
            writer.writerow((r.arrival_s, r.prompt_len, r.new_tokens))
        return out.getvalue()

    def to_json(self) -> str:
        rows = [{k: v for k, v in asdict(r).items() if k in FIELDS} for r in self.requests]
        return json.dumps({"requests": rows}, indent=1) + "\n"

    def save(self, path: Path) -> None:
        """Write as JSON when the suffix is ``.json``, else as CSV."""
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_csv())

    @classmethod
    def load(cls, path: Path) -> Trace:
        """Read a CSV or JSON trace (by suffix); raises ``ValueError`` on a malformed file."""
        text = path.read_text()
        try:
            if path.suffix == ".json":
                rows = [(r["arrival_s"], r["prompt_len"], r["new_tokens"]) for r in json.loads(text)["requests"]]
            else:
                reader = csv.DictReader(io.StringIO(text))
                if reader.fieldnames is None or not set(FIELDS) <= set(reader.fieldnames):
                    raise ValueError(f"CSV trace needs the header {','.join(FIELDS)}")
                rows = [(float(r["arrival_s"]), int(r["prompt_len"]), int(r["new_tokens"])) for r in reader]
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed trace {path}: {exc}") from exc
        return cls.of(rows)


def arrivals(count: int, rate_per_s: float | None, rng: random.Random) -> list[float]:
    """All at 0 when ``rate_per_s`` is None (a backlog), else a Poisson process of that rate."""
    if rate_per_s is None:
        return [0.0] * count
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be positive")
    now, times = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def uniform_trace(
    count: int, prompt_len: int, new_tokens: int, rate_per_s: float | None = None, seed: int = 0
) -> Trace:
    """Every request has the same prompt and generation length."""
    times = arrivals(count, rate_per_s, random.Random(seed))
    return Trace.of([(a, prompt_len, new_tokens) for a in times])


def lmsys_like_trace(
    count: int,
    prompt_len: int,
    median_new: int = 150,
    sigma: float = 0.9,
    max_new: int = 1024,
    rate_per_s: float | None = None,
    seed: int = 0,
    group: int = 1,
) -> Trace:
    """Skewed generation lengths resembling LMSys-Chat-1M responses (an assumption, not the data set).

    ``new_tokens`` is log-normal with the given median and log-space ``sigma`` (mean
    ``median * exp(sigma^2 / 2)``, about 225 for the defaults), rounded and clipped to
    ``[1, max_new]``: most answers are short and a long tail reaches ``max_new``. The prompt
    length is fixed, as in the paper's experiments (1,000 tokens there). With ``group = b``
    consecutive runs of ``b`` requests share one length, the paper's assumption that "all
    requests within a microbatch generate the same number of tokens".
    """
    if group < 1:
        raise ValueError("group must be >= 1")
    rng = random.Random(seed)
    times = arrivals(count, rate_per_s, rng)
    mu = math.log(median_new)
    drawn = [min(max(round(rng.lognormvariate(mu, sigma)), 1), max_new) for _ in range(-(-count // group))]
    lengths = [drawn[i // group] for i in range(count)]
    return Trace.of([(a, prompt_len, n) for a, n in zip(times, lengths, strict=True)])
