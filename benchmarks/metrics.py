"""Serving metrics of one load-generator run, named as ``vllm bench serve`` names them.

Over the requests that completed (streamed to ``[DONE]`` with a finish reason), from the client's
records (:class:`benchmarks.loadgen.RequestRecord`, times in seconds since the run's start):

- **TTFT**: send to the first streamed chunk that carries a choice;
- **TPOT**: (end-to-end latency - TTFT) / (output tokens - 1), per request (none for one token);
- **ITL**: every gap between two successive chunks of a request, pooled over all requests;
- **E2EL**: send to the end of the stream; **normalized latency**: E2EL / output tokens (the paper's);
- **duration**: first send to the last end of any sent request; request, output-token and total-token
  (input + output) throughputs divide the completed requests' counts by it;
- **goodput**: completed requests that met every given SLO (:class:`SLO`), per second of duration.

Each latency is summarized as mean, median, p90 and p99 (:class:`Summary`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from benchmarks.loadgen import RequestRecord, Status

# The latencies a run reports, by their names in reports and JSON keys.
LATENCIES = ("ttft", "tpot", "itl", "e2el")
# The statistics of each latency, by their names in JSON keys (``median_ttft_ms``, ``p90_itl_ms``...).
STATS = ("mean", "median", "p90", "p99")


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of sorted ``ordered`` (numpy's default 'linear' method); None if empty."""
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """Mean, median, p90 and p99 of a sample (percentiles interpolate as numpy's); None when it is empty."""

    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        ordered = sorted(values)
        mean = statistics.fmean(ordered) if ordered else None
        return cls(mean, percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99), len(ordered))


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds (None: not constrained), as ``--goodput ttft:500 tpot:50``.

    A request meets them when each constrained latency is at most its bound; a request of one token
    has no TPOT and meets any TPOT bound (as in vLLM).
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> SLO:
        """``["ttft:500", "tpot:50"]`` -> SLO; raises ``ValueError`` naming the bad item."""
        bounds: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of milliseconds") from None
            if not ms > 0 or math.isinf(ms):
                raise ValueError(f"bad SLO {item!r}: the bound must be a positive number of milliseconds")
            if name in bounds:
                raise ValueError(f"bad SLO {item!r}: {name} given twice")
            bounds[name] = ms
        if not bounds:
            raise ValueError("no SLO given")
        return cls(**{f"{name}_ms": ms for name, ms in bounds.items()})

    def met_by(self, record: RequestRecord) -> bool:
        """Whether a completed ``record`` meets every bound."""
        checks = ((self.ttft_ms, record.ttft_s), (self.tpot_ms, record.tpot_s or 0.0), (self.e2el_ms, record.e2e_s))
        return record.ok and all(bound is None or (v is not None and v * 1000 <= bound) for bound, v in checks)

    def __str__(self) -> str:
        bounds = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return " ".join(f"{name}:{ms:g}" for name, ms in bounds if ms is not None)


@dataclass(frozen=True)
class RunMetrics:
    """The metrics of one run (module docstring); ``request_goodput`` is None without an SLO."""

    requests: int
    completed: int
    failed: int
    timeouts: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    requested_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft_s: Summary
    tpot_s: Summary
    itl_s: Summary
    e2el_s: Summary
    normalized_latency_s: Summary

    @classmethod
    def of(cls, records: Sequence[RequestRecord], slo: SLO | None = None) -> RunMetrics:
        done = [r for r in records if r.ok]
        sent = [r for r in records if r.send_s is not None and r.end_s is not None]
        duration = max(r.end_s for r in sent) - min(r.send_s for r in sent) if sent else 0.0

        def per_second(count: float) -> float:
            return count / duration if duration > 0 else 0.0

        def sample(metric: Callable[[RequestRecord], float | None]) -> Summary:
            return Summary.of(v for r in done if (v := metric(r)) is not None)

        input_tokens = sum(r.input_tokens for r in done)
        output_tokens = sum(r.generated for r in done)
        return cls(
            requests=len(records),
            completed=len(done),
            failed=len(records) - len(done),
            timeouts=sum(r.status is Status.TIMEOUT for r in records),
            duration_s=duration,
            total_input_tokens=input_tokens,
            total_output_tokens=output_tokens,
            requested_output_tokens=sum(r.request.new_tokens for r in records),
            request_throughput=per_second(len(done)),
            output_throughput=per_second(output_tokens),
            total_token_throughput=per_second(input_tokens + output_tokens),
            request_goodput=None if slo is None else per_second(sum(slo.met_by(r) for r in done)),
            ttft_s=sample(lambda r: r.ttft_s),
            tpot_s=sample(lambda r: r.tpot_s),
            itl_s=Summary.of(gap for r in done for gap in r.itl_s),
            e2el_s=sample(lambda r: r.e2e_s),
            normalized_latency_s=sample(lambda r: r.normalized_latency_s),
        )

    def latency(self, name: str) -> Summary:
        """The summary of ``name`` in :data:`LATENCIES` or ``normalized_latency``."""
        return getattr(self, f"{name}_s")

    def to_json(self) -> dict:
        """Flat, with vLLM's keys (``duration`` in s, ``mean_ttft_ms``...), plus our extras."""
        out: dict = {k: v for k, v in asdict(self).items() if not isinstance(getattr(self, k), Summary)}
        out["duration"] = out.pop("duration_s")
        for name in (*LATENCIES, "normalized_latency"):
            summary = self.latency(name)
            for stat in STATS:
                value = getattr(summary, stat)
                out[f"{stat}_{name}_ms"] = None if value is None else value * 1000
        return out


def report(metrics: RunMetrics, title: str, slo: SLO | None = None) -> str:
    """A text block laid out like ``vllm bench serve``'s result, latencies in milliseconds."""
    width = 50

    def rule(label: str) -> str:
        return f"{label:-^{width}}"

    def row(label: str, value: object) -> str:
        text = "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        return f"{label:<40} {text:<10}"

    m = metrics
    lines = [
        *([f"Goodput SLOs (ms): {slo}"] if slo is not None else []),
        f"{f' {title} ':=^{width}}",
        row("Successful requests:", m.completed),
        row("Failed requests:", m.failed),
        row("Benchmark duration (s):", m.duration_s),
        row("Total input tokens:", m.total_input_tokens),
        row("Total generated tokens:", m.total_output_tokens),
        row("Request throughput (req/s):", m.request_throughput),
        row("Output token throughput (tok/s):", m.output_throughput),
        row("Total Token throughput (tok/s):", m.total_token_throughput),
    ]
    if m.request_goodput is not None:
        lines.append(row("Request goodput (req/s):", m.request_goodput))
    headings = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for name, (heading, short) in headings.items():
        summary = m.latency(name)
        lines.append(rule(heading))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            value = getattr(summary, stat)
            lines.append(row(f"{label} {short} (ms):", None if value is None else value * 1000))
    lines.append("=" * width)
    return "\n".join(lines)
