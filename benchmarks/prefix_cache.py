"""Prefix-cache hit rates of a run, from the server's Prometheus counters scraped before and after it.

Two families of counters are read, both in tokens: DejaVu's workers'
``dejavu_prefix_cache_queries_tokens_total`` / ``dejavu_prefix_cache_hits_tokens_total`` (a
request-scheduled stage, docs/metrics.md) and vLLM's ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total``. Each is summed over every label set and every scraped endpoint
(DejaVu's workers serve their metrics on ports of their own; the controller's ``/metrics`` has none of
these). The run's figures are the differences between the two scrapes; the hit rate is hits / queries.
A family found in neither scrape, an endpoint that did not answer, or a counter that went backwards (a
restarted process) is reported as such, never as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

# source -> (queries sample, hits sample), as they appear in the text exposition format.
COUNTERS = {
    "dejavu": ("dejavu_prefix_cache_queries_tokens_total", "dejavu_prefix_cache_hits_tokens_total"),
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}


@dataclass(frozen=True)
class Counters:
    """Prefix-cache queries and hits of one source, in tokens."""

    queried_tokens: float
    hit_tokens: float

    def __add__(self, other: Counters) -> Counters:
        return Counters(self.queried_tokens + other.queried_tokens, self.hit_tokens + other.hit_tokens)


def parse(text: str) -> dict[str, Counters]:
    """The prefix-cache counters in a Prometheus text exposition, summed over label sets, by source;
    a source with neither counter is left out. Raises ``ValueError`` for text that does not parse."""
    sums: dict[str, float] = {}
    wanted = {name for pair in COUNTERS.values() for name in pair}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return {
        source: Counters(sums.get(queries, 0.0), sums.get(hits, 0.0))
        for source, (queries, hits) in COUNTERS.items()
        if queries in sums or hits in sums
    }


@dataclass(frozen=True)
class Scrape:
    """The counters of every endpoint that answered, summed by source, and why the others did not."""

    urls: tuple[str, ...]
    counters: dict[str, Counters]
    errors: dict[str, str] = field(default_factory=dict)


def scrape(urls: Sequence[str], headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Scrape:
    """GET every URL (each within ``timeout_s``) and sum the counters; never raises for an endpoint."""
    total: dict[str, Counters] = {}
    errors: dict[str, str] = {}
    for url in urls:
        try:
            response = httpx.get(url, headers=headers or {}, timeout=timeout_s)
            response.raise_for_status()
            found = parse(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            errors[url] = f"{type(exc).__name__}: {exc}"
            continue
        for source, counters in found.items():
            total[source] = total[source] + counters if source in total else counters
    return Scrape(tuple(urls), total, errors)


@dataclass(frozen=True)
class HitRate:
    """One source's prefix-cache figures over a run, in tokens."""

    source: str
    queried_tokens: int
    hit_tokens: int

    @property
    def rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None


@dataclass(frozen=True)
class CacheReport:
    """The run's hit rates by source, or why there are none (``absent``)."""

    urls: tuple[str, ...]
    rates: tuple[HitRate, ...]
    absent: str | None = None

    @classmethod
    def between(cls, before: Scrape, after: Scrape) -> CacheReport:
        """The differences of the counters from ``before`` to ``after``."""
        urls = tuple(dict.fromkeys((*before.urls, *after.urls)))
        rates, problems = [], []
        for source in COUNTERS:
            if source not in before.counters or source not in after.counters:
                continue
            a, b = before.counters[source], after.counters[source]
            queried, hit = b.queried_tokens - a.queried_tokens, b.hit_tokens - a.hit_tokens
            if queried < 0 or hit < 0:
                problems.append(f"{source} counters went backwards (a process restarted during the run)")
                continue
            rates.append(HitRate(source, round(queried), round(hit)))
        errors = {**before.errors, **after.errors}
        if not rates:
            names = " or ".join(f"{q} / {h}" for q, h in COUNTERS.values())
            why = problems or [f"no {names} at {', '.join(urls) or 'no metrics URL'}"]
            why += [f"{url}: {error}" for url, error in errors.items()]
            return cls(urls, (), "; ".join(why))
        return cls(urls, tuple(rates))

    def to_json(self) -> dict:
        return {
            "metrics_urls": list(self.urls),
            "absent": self.absent,
            "sources": {
                r.source: {"queried_tokens": r.queried_tokens, "hit_tokens": r.hit_tokens, "hit_rate": r.rate}
                for r in self.rates
            },
        }

    def lines(self) -> list[str]:
        """Report lines in the layout of :func:`benchmarks.metrics.report`."""
        width = 50
        out = [f"{'Prefix cache':-^{width}}"]
        if self.absent is not None:
            return [*out, f"absent: {self.absent}"]
        for r in self.rates:
            rate = "-" if r.rate is None else f"{r.rate:.2%}"
            out += [
                f"{f'Queried tokens ({r.source}):':<40} {r.queried_tokens:<10}",
                f"{f'Hit tokens ({r.source}):':<40} {r.hit_tokens:<10}",
                f"{f'Hit rate ({r.source}):':<40} {rate:<10}",
            ]
        return out


class Scraper:
    """Scrapes a fixed list of URLs plus, where ``discover`` is given, the URLs it finds at each scrape
    (a deployment's workers may be replaced between two scrapes)."""

    def __init__(
        self,
        urls: Sequence[str],
        discover: Callable[[], list[str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._urls = list(urls)
        self._discover = discover
        self._headers = headers

    def scrape(self) -> Scrape:
        found: list[str] = []
        errors: dict[str, str] = {}
        if self._discover is not None:
            try:
                found = self._discover()
            except (RedisError, ValueError, OSError) as exc:  # loses the workers' figures, not the run
                errors["workers"] = f"cannot list the workers' metrics URLs: {type(exc).__name__}: {exc}"
        result = scrape(list(dict.fromkeys([*self._urls, *found])), self._headers)
        return Scrape(result.urls, result.counters, {**result.errors, **errors})


def worker_metrics_urls(redis_url: str) -> list[str]:
    """The metrics URLs of every live worker registered in the DejaVu deployment at ``redis_url``
    (workers serve them with ``worker.metrics_port`` set, e.g. ``DEJAVU_WORKER__METRICS_PORT=0``)."""
    from dejavu_common import keys
    from dejavu_common.messages import WorkerInfo
    from dejavu_common.redis_client import sync_client
    from dejavu_common.settings import Settings

    settings = Settings()
    client = sync_client(settings.redis.model_copy(update={"url": redis_url}))
    try:
        urls = []
        for wid in sorted(m.decode() for m in client.smembers(keys.WORKERS)):
            raw = client.hget(keys.worker(wid), "info")
            if raw is None or not client.exists(keys.worker_lease(wid)):
                continue
            info = WorkerInfo.decode(raw)
            if info.metrics_url:
                urls.append(info.metrics_url)
        return urls
    finally:
        client.close()
