"""Plots of benchmark results, drawn from their JSON documents.

``dejavu bench serve`` and ``dejavu bench chaos`` draw theirs beside the JSON they write; ``dejavu
bench plot`` (``benchmarks/bench_plot.py``) draws them again from saved files, several servers' serve
results side by side. Matplotlib with its Agg backend (no display); the file's suffix picks PNG or SVG.

- **serve** (:func:`plot_serve`): one row per load (a rate and concurrency, or a replayed trace), four
  panels: output token throughput, and TTFT, TPOT and ITL at p50, p90 and p99, one bar per system (a
  serve-url result is one system, named by its ``--label``; a result of the paper's experiment holds
  one system per deployment). Systems are compared only on the same workload. A latency or percentile
  that no result recorded (null in every result) is left out of the figure.
- **chaos** (:func:`plot_chaos`): a timeline of the run, requests ended per interval (exact, failed,
  wrong, hung) above one lane per fault kind (each fault from its injection until the service is ready
  again, a dot at the next exact completion), and per fault kind the range of both recovery times.

Every reader checks the document it is given and raises :class:`ResultError` naming the file and the
key at fault; nothing is written then.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# Latency panels of the serve plot: JSON name and title.
SERVE_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
# Percentiles of each latency panel: JSON statistic and label.
SERVE_PERCENTILES = (("median", "p50"), ("p90", "p90"), ("p99", "p99"))
# Outcomes of chaos traffic, drawn in this order and colour.
CHAOS_OUTCOMES = (("exact", "tab:green"), ("failed", "tab:orange"), ("wrong", "tab:red"), ("hung", "black"))
FORMATS = (".png", ".svg")
# Widths of the chaos timeline's bins of ended requests: the smallest giving at most 80 bins.
BIN_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300)


class ResultError(ValueError):
    """A result document that cannot be plotted: the message names the file and what is wrong."""


# -- reading and checking ---------------------------------------------------------------------------


def load_result(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; raises :class:`ResultError` if it cannot be read or is not an object."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ResultError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    return doc


def _number(value: Any, where: str) -> float:
    """``value`` as a finite float; raises naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ResultError(f"{where}: expected a finite number, found {value!r}")
    return float(value)


def _optional_number(value: Any, where: str) -> float | None:
    """``value`` as a finite float, or None for null; raises naming ``where``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ResultError(f"{where}: expected a finite number or null, found {value!r}")
    return float(value)


def _field(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """``doc[key]``, which must be a ``kind``; raises naming ``where``."""
    if key not in doc:
        raise ResultError(f"{where}: missing {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ResultError(f"{where}: {key!r} must be {kind.__name__}, found {value!r}")
    return value


def load_label(request_rate: float | str | None, max_concurrency: int | None) -> str:
    """A run's load as the serve benchmarks name it: ``rate inf, conc 16``, ``rate 2``, ``trace``."""
    if request_rate is None:
        rate = "trace"
    else:
        rate = "rate inf" if request_rate == "inf" or math.isinf(float(request_rate)) else f"rate {request_rate:g}"
    return rate if max_concurrency is None else f"{rate}, conc {max_concurrency}"


# -- serve ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServePoint:
    """One system at one load: output tokens/s and each latency's percentiles in ms (None: not recorded)."""

    system: str
    load: str
    output_throughput: float
    latency_ms: dict[str, dict[str, float | None]]


@dataclass(frozen=True)
class ServeResult:
    """The points of one serve result document, its workload (systems compare only on the same one)
    and where it came from (for messages)."""

    source: str
    benchmark: str
    workload: dict[str, Any]
    points: tuple[ServePoint, ...]

    @property
    def systems(self) -> list[str]:
        return list(dict.fromkeys(p.system for p in self.points))


def _latencies(metrics: dict[str, Any], where: str) -> dict[str, dict[str, float | None]]:
    """Each latency's p50/p90/p99 in ms from vLLM-named keys (``median_ttft_ms``...). The median and
    p99 keys must be present (null when nothing was sampled); p90 may be absent (older results)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, _ in SERVE_LATENCIES:
        out[name] = {}
        for stat, _ in SERVE_PERCENTILES:
            key = f"{stat}_{name}_ms"
            if key not in metrics and stat != "p90":
                raise ResultError(f"{where}: missing {key!r}")
            out[name][stat] = _optional_number(metrics.get(key), f"{where}: {key!r}")
    return out


def _serve_url_points(doc: dict[str, Any], where: str) -> tuple[dict[str, Any], list[ServePoint]]:
    config = _field(doc, "config", dict, where)
    system = config.get("label") or config.get("base_url")
    if not isinstance(system, str) or not system:
        raise ResultError(f"{where}: config needs a 'label' or 'base_url' naming the system")
    workload = {
        "workload": _field(config, "workload", dict, f"{where}: config"),
        "ignore_eos": config.get("ignore_eos"),
    }
    points = []
    for i, run in enumerate(_field(doc, "runs", list, where)):
        at = f"{where}: runs[{i}]"
        if not isinstance(run, dict):
            raise ResultError(f"{at}: expected an object, found {run!r}")
        rate = run.get("request_rate")
        if rate is not None and rate != "inf":
            _number(rate, f"{at}: 'request_rate'")
        concurrency = run.get("max_concurrency")
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)):
            raise ResultError(f"{at}: 'max_concurrency' must be an integer or null, found {concurrency!r}")
        throughput = _number(run.get("output_throughput"), f"{at}: 'output_throughput'")
        points.append(ServePoint(system, load_label(rate, concurrency), throughput, _latencies(run, at)))
    return workload, points


def _serve_points(doc: dict[str, Any], where: str) -> tuple[dict[str, Any], list[ServePoint]]:
    """The paper's experiment (``benchmark: serve``): one system per deployment."""
    config = _field(doc, "config", dict, where)
    workload = {
        "workload": _field(config, "workload", dict, f"{where}: config"),
        "ignore_eos": config.get("ignore_eos"),
    }
    points = []
    for i, run in enumerate(_field(doc, "runs", list, where)):
        at = f"{where}: runs[{i}]"
        if not isinstance(run, dict):
            raise ResultError(f"{at}: expected an object, found {run!r}")
        system = _field(run, "deployment", str, at)
        rate = _optional_number(run.get("rate_per_s"), f"{at}: 'rate_per_s'")
        metrics = _field(run, "metrics", dict, at)
        throughput = _number(metrics.get("output_throughput"), f"{at}: metrics 'output_throughput'")
        points.append(ServePoint(system, load_label(rate, None), throughput, _latencies(metrics, f"{at}: metrics")))
    return workload, points


def serve_result(doc: dict[str, Any], source: str) -> ServeResult:
    """The points of a serve result document (``serve-url``: ``--base-url`` mode; ``serve``: the paper's
    experiment); raises :class:`ResultError` if it is neither or malformed. A load measured twice by one
    system is numbered (``rate inf, conc 16 #2``)."""
    benchmark = doc.get("benchmark")
    readers = {"serve-url": _serve_url_points, "serve": _serve_points}
    if benchmark not in readers:
        raise ResultError(f"{source}: not a serve result ('benchmark' is {benchmark!r}, expected serve-url or serve)")
    workload, points = readers[benchmark](doc, source)
    if not points:
        raise ResultError(f"{source}: no runs to plot")
    seen: dict[tuple[str, str], int] = {}
    numbered = []
    for point in points:
        count = seen[(point.system, point.load)] = seen.get((point.system, point.load), 0) + 1
        numbered.append(point if count == 1 else replace(point, load=f"{point.load} #{count}"))
    return ServeResult(source, benchmark, workload, tuple(numbered))


def read_serve(path: Path) -> ServeResult:
    """:func:`serve_result` of the file ``path``."""
    return serve_result(load_result(path), str(path))


def check_comparable(results: Sequence[ServeResult]) -> None:
    """Raise :class:`ResultError` unless every result is the same benchmark on the same workload."""
    first = results[0]
    for other in results[1:]:
        if other.benchmark != first.benchmark:
            raise ResultError(f"{other.source} is a {other.benchmark} result, {first.source} a {first.benchmark} one")
        if other.workload != first.workload:
            raise ResultError(
                f"{other.source} measured another workload than {first.source}: "
                f"{other.workload} against {first.workload}"
            )


def _distinct_systems(results: Sequence[ServeResult]) -> list[ServePoint]:
    """Every point, systems named apart: a name two results share gets its source's file name."""
    owners: dict[str, set[str]] = {}
    for result in results:
        for system in result.systems:
            owners.setdefault(system, set()).add(result.source)
    points = []
    for result in results:
        for p in result.points:
            name = p.system if len(owners[p.system]) == 1 else f"{p.system} ({Path(result.source).name})"
            points.append(replace(p, system=name))
    return points


def plot_serve(results: Sequence[ServeResult], path: Path, title: str) -> None:
    """Draw the serve figure of ``results`` (module docstring) to ``path`` (.png or .svg). Raises
    :class:`ResultError` if there is nothing to draw or the results are not comparable."""
    if not results:
        raise ResultError("no serve result to plot")
    _check_format(path)
    check_comparable(results)
    points = _distinct_systems(results)
    systems = list(dict.fromkeys(p.system for p in points))
    loads = list(dict.fromkeys(p.load for p in points))
    plt = _pyplot()
    latencies = _recorded(points)
    columns = 1 + len(latencies)
    width = max(3.5 * columns, 8.0)
    fig, axes = plt.subplots(
        len(loads), columns, figsize=(width, 2.9 * len(loads) + 0.9), squeeze=False, layout="constrained"
    )
    colors = {s: f"C{i % 10}" for i, s in enumerate(systems)}
    for row, load in zip(axes, loads, strict=True):
        at_load = {p.system: p for p in points if p.load == load}
        _throughput_panel(row[0], systems, at_load, colors, load)
        for ax, (name, title_, stats) in zip(row[1:], latencies, strict=True):
            _latency_panel(ax, systems, at_load, colors, (name, title_), stats)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in systems]
    fig.legend(
        handles,
        systems,
        loc="outside upper center",
        ncol=max(1, min(len(systems), int(width // 2.6))),
        fontsize=9,
        frameon=False,
        title=title,
        title_fontsize=10,
    )
    _save(fig, path)


def _recorded(points: list[ServePoint]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The latency panels to draw, each with its percentiles: those some point recorded (a result
    written from figures that kept only some percentiles draws only those)."""
    panels = []
    for name, title in SERVE_LATENCIES:
        stats = [(s, label) for s, label in SERVE_PERCENTILES if any(p.latency_ms[name][s] is not None for p in points)]
        if stats:
            panels.append((name, title, stats))
    return panels


def _throughput_panel(
    ax, systems: list[str], at_load: dict[str, ServePoint], colors: dict[str, str], load: str
) -> None:
    """One bar per system: output tokens per second at this load."""
    for i, system in enumerate(systems):
        point = at_load.get(system)
        if point is None:
            continue
        bar = ax.bar(i, point.output_throughput, color=colors[system], width=0.7)
        ax.bar_label(bar, fmt="%.4g", fontsize=7)
    ax.set_xticks([])
    ax.set_ylabel(f"{load}\noutput tok/s", fontsize=9)
    ax.set_title("throughput", fontsize=9)
    ax.margins(y=0.15)
    ax.grid(alpha=0.3, axis="y")


def _latency_panel(
    ax,
    systems: list[str],
    at_load: dict[str, ServePoint],
    colors: dict[str, str],
    latency: tuple[str, str],
    stats: list[tuple[str, str]],
) -> None:
    """Grouped bars: one group per percentile in ``stats``, one bar per system that recorded it."""
    name, title = latency
    width = 0.8 / len(systems)
    drawn = False
    for i, system in enumerate(systems):
        point = at_load.get(system)
        if point is None:
            continue
        for j, (stat, _) in enumerate(stats):
            value = point.latency_ms[name][stat]
            if value is not None:
                bar = ax.bar(j - 0.4 + width * (i + 0.5), value, width=width, color=colors[system])
                ax.bar_label(bar, fmt="%.3g", fontsize=6)
                drawn = True
    ax.set_xticks(range(len(stats)), [label for _, label in stats], fontsize=8)
    ax.set_title(f"{title} (ms)", fontsize=9)
    ax.margins(y=0.12)
    ax.grid(alpha=0.3, axis="y")
    if not drawn:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_rates(doc: dict[str, Any], path: Path, title: str, source: str = "serve result") -> None:
    """The paper's figure from a ``serve`` result (the paper's experiment): median (solid) and p99
    (dashed) normalized latency against the request rate, one line per deployment. Runs of a replayed
    trace have no rate and are left out. Raises :class:`ResultError` if ``doc`` is not such a result."""
    _check_format(path)
    if serve_result(doc, source).benchmark != "serve":
        raise ResultError(f"{source}: normalized latency against the rate needs a result of the paper's experiment")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(run["deployment"] for run in doc["runs"]):
        rows = [
            (
                run["rate_per_s"],
                run["metrics"].get("median_normalized_latency_ms"),
                run["metrics"].get("p99_normalized_latency_ms"),
            )
            for run in doc["runs"]
            if run["deployment"] == name and run["rate_per_s"] is not None
        ]
        medians = [(rate, median) for rate, median, _ in rows if median is not None]
        tails = [(rate, p99) for rate, _, p99 in rows if p99 is not None]
        if not medians:
            continue
        (line,) = ax.plot(*zip(*medians, strict=True), marker="o", label=f"{name} median")
        if tails:
            ax.plot(*zip(*tails, strict=True), ls="--", color=line.get_color(), alpha=0.6, label=f"{name} p99")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (ms/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


# -- chaos ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One scheduled fault of a chaos run (times in seconds; None: not within the interval)."""

    kind: str
    at_s: float
    injected: bool
    ready_again_s: float | None
    recovery_s: float | None


@dataclass(frozen=True)
class KindRange:
    """The recoveries of one fault kind: how many faults, the range of each time, how many had none."""

    faults: int
    ready_again_s: tuple[float, float] | None
    recovery_s: tuple[float, float] | None
    not_recovered: int
    values: tuple[tuple[float | None, float | None], ...] = ()


def read_faults(doc: dict[str, Any], where: str) -> list[Fault]:
    """The ``faults`` of a chaos.json document; raises :class:`ResultError` naming a malformed one."""
    faults = []
    for i, f in enumerate(_field(doc, "faults", list, where)):
        at = f"{where}: faults[{i}]"
        if not isinstance(f, dict):
            raise ResultError(f"{at}: expected an object, found {f!r}")
        injected = _field(f, "injected", bool, at)
        ready = _optional_number(f.get("ready_again_s"), f"{at}: 'ready_again_s'") if injected else None
        recovery = _optional_number(f.get("recovery_s"), f"{at}: 'recovery_s'") if injected else None
        faults.append(
            Fault(_field(f, "kind", str, at), _number(f.get("at_s"), f"{at}: 'at_s'"), injected, ready, recovery)
        )
    return faults


def recovery_by_kind(faults: Sequence[Fault]) -> dict[str, KindRange]:
    """Per fault kind that was injected (in schedule order): the injected faults' recovery ranges."""
    out: dict[str, KindRange] = {}
    for kind in dict.fromkeys(f.kind for f in faults):
        if not any(f.injected for f in faults if f.kind == kind):
            continue
        mine = [f for f in faults if f.kind == kind and f.injected]
        ready = [f.ready_again_s for f in mine if f.ready_again_s is not None]
        recovery = [f.recovery_s for f in mine if f.recovery_s is not None]
        out[kind] = KindRange(
            len(mine),
            (min(ready), max(ready)) if ready else None,
            (min(recovery), max(recovery)) if recovery else None,
            sum(f.recovery_s is None for f in mine),
            tuple((f.ready_again_s, f.recovery_s) for f in mine),
        )
    return out


def kind_ranges_json(ranges: dict[str, KindRange]) -> dict[str, dict[str, Any]]:
    """``recovery_by_kind`` as chaos.json holds it (ranges as ``[min, max]``)."""
    return {
        kind: {
            "faults": r.faults,
            "ready_again_s": list(r.ready_again_s) if r.ready_again_s else None,
            "recovery_s": list(r.recovery_s) if r.recovery_s else None,
            "not_recovered": r.not_recovered,
        }
        for kind, r in ranges.items()
    }


def _range(value: Any, where: str) -> tuple[float, float] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ResultError(f"{where}: expected [min, max] or null, found {value!r}")
    low, high = (_number(v, where) for v in value)
    if low > high:
        raise ResultError(f"{where}: min {low} is above max {high}")
    return low, high


def _kind_ranges(doc: dict[str, Any], where: str) -> dict[str, KindRange]:
    """``recovery_by_kind`` as written (a summary without per-fault times) when there are no faults."""
    ranges = {}
    for kind, r in _field(doc, "recovery_by_kind", dict, where).items():
        at = f"{where}: recovery_by_kind[{kind!r}]"
        if not isinstance(r, dict):
            raise ResultError(f"{at}: expected an object, found {r!r}")
        faults = _field(r, "faults", int, at)
        not_recovered = r.get("not_recovered", 0)
        if isinstance(not_recovered, bool) or not isinstance(not_recovered, int) or not 0 <= not_recovered <= faults:
            raise ResultError(f"{at}: 'not_recovered' must be an integer from 0 to {faults}, found {not_recovered!r}")
        ranges[kind] = KindRange(
            faults,
            _range(r.get("ready_again_s"), f"{at}: 'ready_again_s'"),
            _range(r.get("recovery_s"), f"{at}: 'recovery_s'"),
            not_recovered,
        )
    return ranges


def _outcome_times(doc: dict[str, Any], where: str) -> dict[str, list[float]]:
    """``outcomes_at_s``: seconds since traffic started at which requests ended, per outcome (optional)."""
    raw = doc.get("outcomes_at_s")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ResultError(f"{where}: 'outcomes_at_s' must be an object, found {raw!r}")
    known = {name for name, _ in CHAOS_OUTCOMES}
    out = {}
    for name, times in raw.items():
        if name not in known:
            raise ResultError(f"{where}: 'outcomes_at_s' has an unknown outcome {name!r} (known: {sorted(known)})")
        if not isinstance(times, list):
            raise ResultError(f"{where}: outcomes_at_s[{name!r}] must be a list of seconds")
        out[name] = [_number(t, f"{where}: outcomes_at_s[{name!r}]") for t in times]
    return out


def _requests_line(doc: dict[str, Any], where: str) -> str:
    counts = _field(doc, "requests", dict, where)
    names = (
        ("completed_exact", "exact"),
        ("completed_wrong", "wrong"),
        ("failed_with_error", "failed"),
        ("hung", "hung"),
    )
    parts = []
    for key, label in names:
        value = _field(counts, key, int, f"{where}: requests")
        parts.append(f"{value:,} {label}")
    return "requests: " + ", ".join(parts)


def plot_chaos(doc: dict[str, Any], path: Path, title: str, source: str = "chaos result") -> None:
    """Draw the chaos figure (module docstring) of a chaos.json document to ``path``. A document with
    per-fault times (``faults``) gets the timeline; one with only ``recovery_by_kind`` (a summary) gets
    the ranges. Raises :class:`ResultError` if it has neither or is malformed."""
    _check_format(path)
    if "faults" in doc:
        faults = read_faults(doc, source)
        ranges = recovery_by_kind(faults)
    elif "recovery_by_kind" in doc:
        faults, ranges = [], _kind_ranges(doc, source)
    else:
        raise ResultError(f"{source}: not a chaos result (it has neither 'faults' nor 'recovery_by_kind')")
    if not ranges and not faults:
        raise ResultError(f"{source}: no faults to plot")
    requests = _requests_line(doc, source)
    outcomes = _outcome_times(doc, source)
    timed = bool(faults)
    plt = _pyplot()
    heights = ([1.6] if timed and outcomes else []) + ([0.45 * len({f.kind for f in faults}) + 0.8] if timed else [])
    heights.append(0.45 * max(len(ranges), 1) + 0.8)
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 1.0), height_ratios=heights, squeeze=False)
    axes = list(axes[:, 0])
    if timed and outcomes:
        _outcomes_panel(axes.pop(0), outcomes, faults)
    if timed:
        _timeline_panel(axes.pop(0), faults, _interval(doc), _timeline_end(outcomes, faults))
    _ranges_panel(axes.pop(0), ranges)
    fig.suptitle(f"{title}\n{requests}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def _interval(doc: dict[str, Any]) -> float | None:
    """The run's ``--interval`` (seconds between faults) from its args, if recorded."""
    args = doc.get("args")
    value = args.get("interval") if isinstance(args, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def _kind_colors(kinds: list[str]) -> dict[str, str]:
    return {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}


def _outcomes_panel(ax, outcomes: dict[str, list[float]], faults: list[Fault]) -> None:
    """Requests ended per bin, by outcome, with a faint line at each fault."""
    end = _timeline_end(outcomes, faults)
    width = next((w for w in BIN_WIDTHS_S if w >= end / 80), BIN_WIDTHS_S[-1])
    bins = [i * width for i in range(int(end / width) + 2)]
    for name, color in CHAOS_OUTCOMES:
        times = outcomes.get(name) or []
        if times:
            ax.hist(times, bins=bins, histtype="step", color=color, label=f"{name} ({len(times)})", linewidth=1.2)
    for f in faults:
        ax.axvline(f.at_s, color="grey", alpha=0.25, linewidth=0.8)
    ax.set_ylabel(f"requests ended\nper {width:g} s", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    ax.set_xlim(0, end)


def _timeline_end(outcomes: dict[str, list[float]], faults: list[Fault]) -> float:
    """The last second the timeline shows: the last request's end or fault's recovery."""
    ends = [t for times in outcomes.values() for t in times]
    ends += [f.at_s + max(f.ready_again_s or 0.0, f.recovery_s or 0.0) for f in faults]
    return max([*ends, 1.0]) * 1.01


def _timeline_panel(ax, faults: list[Fault], interval: float | None, end: float) -> None:
    """One lane per fault kind: injection to ready again (a bar), the next exact completion (a dot),
    faults without it (a red cross at the end of the interval) and faults not injected (a grey cross)."""
    kinds = list(dict.fromkeys(f.kind for f in faults))
    colors = _kind_colors(kinds)
    for f in faults:
        y = kinds.index(f.kind)
        if not f.injected:
            ax.plot(f.at_s, y, "x", color="grey", markersize=7)
            continue
        ax.barh(y, f.ready_again_s or 0.0, left=f.at_s, height=0.5, color=colors[f.kind], alpha=0.55)
        ax.plot(f.at_s, y, "|", color=colors[f.kind], markersize=12)
        if f.recovery_s is not None:
            ax.plot(f.at_s + f.recovery_s, y, "o", color=colors[f.kind], markersize=4)
        else:
            ax.plot(f.at_s + (interval or f.ready_again_s or 0.0), y, "x", color="tab:red", markersize=8)
    ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds since traffic started", fontsize=9)
    ax.set_title(
        "faults: | injected, bar until ready again, o next exact completion, red x none within the interval, "
        "grey x not injected",
        fontsize=8,
    )
    ax.grid(alpha=0.3, axis="x")


def _ranges_panel(ax, ranges: dict[str, KindRange]) -> None:
    """Per fault kind, the min-max of ready-again and next-exact-completion times (each fault's value a dot)."""
    kinds = list(ranges)
    for y, kind in enumerate(kinds):
        r = ranges[kind]
        for offset, span, color, index in (
            (-0.15, r.ready_again_s, "tab:blue", 0),
            (0.15, r.recovery_s, "tab:green", 1),
        ):
            if span is not None:
                ax.plot(span, (y + offset, y + offset), color=color, linewidth=4, alpha=0.6, solid_capstyle="butt")
            values = [v[index] for v in r.values if v[index] is not None]
            ax.plot(values, [y + offset] * len(values), "o", color=color, markersize=3)
        note = f"{r.faults} faults" + (f", {r.not_recovered} not recovered" if r.not_recovered else "")
        ax.annotate(
            note,
            (1.0, y),
            xycoords=("axes fraction", "data"),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    ax.plot([], [], color="tab:blue", linewidth=4, alpha=0.6, label="ready again")
    ax.plot([], [], color="tab:green", linewidth=4, alpha=0.6, label="next exact completion")
    ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_ylim(len(kinds) - 0.5, -0.5)
    ax.set_xlabel("seconds after the fault", fontsize=9)
    ax.set_xlim(left=0)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")


# -- output -----------------------------------------------------------------------------------------


def _check_format(path: Path) -> None:
    if Path(path).suffix.lower() not in FORMATS:
        raise ResultError(f"{path}: a plot is written as .png or .svg, not {Path(path).suffix or 'no suffix'!r}")


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Write ``fig`` (its folder made if missing) and free it."""
    plt = _pyplot()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
