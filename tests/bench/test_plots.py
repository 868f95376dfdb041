"""The benchmark plots (``benchmarks/plots.py``, ``dejavu bench plot``) on small synthetic result JSON:
a file is written and is a valid PNG (or SVG), and malformed input is refused with an error naming
the file and the key, writing nothing."""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from benchmarks import bench_chaos, bench_plot, bench_serve
from benchmarks.plots import (
    ResultError,
    kind_ranges_json,
    load_result,
    plot_chaos,
    plot_rates,
    plot_serve,
    read_faults,
    read_serve,
    recovery_by_kind,
    serve_result,
)

from .conftest import FakeServer
from .test_serve_url import _tiny_tokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORKLOAD = {"num_prompts": 4, "input_len": 12, "output_len": 3, "seed": 0, "output_dist": "uniform"}


def _metrics(throughput: float, ms: float) -> dict[str, Any]:
    out: dict[str, Any] = {"output_throughput": throughput}
    for name in ("ttft", "tpot", "itl", "e2el", "normalized_latency"):
        for stat, factor in (("mean", 1.1), ("median", 1.0), ("p90", 1.5), ("p99", 2.0)):
            out[f"{stat}_{name}_ms"] = ms * factor
    return out


def _serve_url(label: str, scale: float = 1.0) -> dict[str, Any]:
    return {
        "benchmark": "serve-url",
        "config": {"label": label, "base_url": "http://127.0.0.1:8000", "workload": dict(WORKLOAD), "ignore_eos": True},
        "runs": [
            {"request_rate": "inf", "max_concurrency": 2, **_metrics(30.0 * scale, 200.0 / scale)},
            {"request_rate": 2.0, "max_concurrency": None, **_metrics(12.0 * scale, 80.0 / scale)},
        ],
    }


def _paper_serve() -> dict[str, Any]:
    return {
        "benchmark": "serve",
        "config": {"workload": {"requests": 3, "prompt_len": 256}, "ignore_eos": False},
        "runs": [
            {"deployment": d, "rate_per_s": rate, "metrics": _metrics(5.0 + rate, 100.0 * rate)}
            for d in ("dejavu-1P+1T", "baseline-colocated-2")
            for rate in (0.2, 0.4)
        ],
    }


def _chaos() -> dict[str, Any]:
    kinds = ["kill", "redis", "drain"]
    faults: list[dict[str, Any]] = [
        {"kind": kinds[i % 3], "at_s": 8.0 + 16 * i, "injected": True, "ready_again_s": 1.0 + i / 10,
         "recovery_s": 2.0 + i / 10}
        for i in range(6)
    ]  # fmt: skip
    faults[4]["recovery_s"] = None  # a redis fault not followed by an exact completion
    faults.append({"kind": "pause", "at_s": 104.0, "injected": False, "error": "RuntimeError('no topology')"})
    return {
        "args": {"interval": 16.0},
        "requests": {"completed_exact": 40, "completed_wrong": 0, "failed_with_error": 3, "hung": 0},
        "faults": faults,
        "outcomes_at_s": {"exact": [0.5 + 2.5 * i for i in range(40)], "failed": [9.0, 41.0, 73.5]},
    }


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.load()  # decodes every chunk: a truncated or corrupt file raises
        assert image.width > 200 and image.height > 200


def _write(tmp_path: Path, name: str, doc: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


# -- serve ------------------------------------------------------------------------------------------


def test_serve_plot_of_two_servers_is_a_png(tmp_path: Path) -> None:
    ours = serve_result(_serve_url("DejaVu"), "ours.json")
    theirs = serve_result(_serve_url("vLLM-CPU", 1.2), "vllm.json")
    assert [p.load for p in ours.points] == ["rate inf, conc 2", "rate 2"]
    assert ours.points[0].latency_ms["itl"] == {"median": 200.0, "p90": 300.0, "p99": 400.0}
    out = tmp_path / "compare.png"
    plot_serve([ours, theirs], out, "4 x 12 -> 3")
    _assert_png(out)


def test_serve_plot_as_svg(tmp_path: Path) -> None:
    out = tmp_path / "one.svg"
    plot_serve([serve_result(_serve_url("DejaVu"), "ours.json")], out, "one system")
    assert "<svg" in out.read_text()[:2000]


def test_paper_experiment_result_gives_one_system_per_deployment(tmp_path: Path) -> None:
    result = serve_result(_paper_serve(), "serve.json")
    assert result.systems == ["dejavu-1P+1T", "baseline-colocated-2"]
    assert [p.load for p in result.points[:2]] == ["rate 0.2", "rate 0.4"]
    plot_serve([result], tmp_path / "percentiles.png", "paper")
    plot_rates(_paper_serve(), tmp_path / "rates.png", "paper")
    _assert_png(tmp_path / "percentiles.png")
    _assert_png(tmp_path / "rates.png")


def test_the_paper_experiment_writes_both_plots_beside_its_json(tmp_path: Path) -> None:
    args = argparse.Namespace(trace=None, dataset=None, prompt_len=256, requests=3, out=tmp_path / "serve.json")
    written = bench_serve.write_plots(_paper_serve(), args)
    assert written == [tmp_path / "serve.png", tmp_path / "serve-percentiles.png"]
    for path in written:
        _assert_png(path)
    args.trace = tmp_path / "trace.csv"  # a replayed trace has no rates: only the percentiles
    (tmp_path / "serve-percentiles.png").unlink()
    assert bench_serve.write_plots(_paper_serve(), args) == [tmp_path / "serve-percentiles.png"]


def test_unrecorded_percentiles_are_left_out_and_older_results_lack_p90(tmp_path: Path) -> None:
    doc = _serve_url("DejaVu")
    for run in doc["runs"]:
        for name in ("ttft", "tpot", "itl"):
            del run[f"p90_{name}_ms"]
            run[f"p99_{name}_ms"] = None
    result = serve_result(doc, "old.json")
    assert result.points[0].latency_ms["ttft"] == {"median": 200.0, "p90": None, "p99": None}
    plot_serve([result], tmp_path / "old.png", "figures of a run without p90")
    _assert_png(tmp_path / "old.png")


def test_a_load_measured_twice_is_numbered() -> None:
    doc = _serve_url("DejaVu")
    doc["runs"].append(copy.deepcopy(doc["runs"][0]))
    assert [p.load for p in serve_result(doc, "x.json").points][-1] == "rate inf, conc 2 #2"


def test_the_same_label_in_two_files_is_told_apart(tmp_path: Path) -> None:
    a = _write(tmp_path, "before.json", _serve_url("http://127.0.0.1:8000"))
    b = _write(tmp_path, "after.json", _serve_url("http://127.0.0.1:8000", 1.1))
    assert bench_plot.main(["serve", str(a), str(b), "--out", str(tmp_path / "ab.png")]) == 0
    _assert_png(tmp_path / "ab.png")


def _broken(change) -> dict[str, Any]:
    doc = _serve_url("DejaVu")
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"benchmark": "engine"}, "not a serve result"),
        (_broken(lambda d: d.pop("runs")), "missing 'runs'"),
        (_broken(lambda d: d.update(runs=[])), "no runs to plot"),
        (_broken(lambda d: d["runs"].append("run")), "runs[2]: expected an object"),
        (_broken(lambda d: d["runs"][0].update(output_throughput="fast")), "runs[0]: 'output_throughput'"),
        (_broken(lambda d: d["runs"][1].update(output_throughput=True)), "runs[1]: 'output_throughput'"),
        (_broken(lambda d: d["runs"][0].pop("median_ttft_ms")), "missing 'median_ttft_ms'"),
        (_broken(lambda d: d["runs"][0].update(p99_itl_ms="slow")), "'p99_itl_ms'"),
        (_broken(lambda d: d["runs"][0].update(request_rate="fast")), "'request_rate'"),
        (_broken(lambda d: d["runs"][0].update(max_concurrency=1.5)), "'max_concurrency'"),
        (_broken(lambda d: d["config"].update(label=None, base_url=None)), "naming the system"),
        (_broken(lambda d: d.update(config=[])), "'config' must be dict"),
    ],
)
def test_malformed_serve_results_are_refused(tmp_path: Path, doc: dict, message: str) -> None:
    with pytest.raises(ResultError, match=r"bad\.json") as refused:
        serve_result(doc, "bad.json")
    assert message in str(refused.value)


def test_different_workloads_or_benchmarks_are_not_compared(tmp_path: Path) -> None:
    other = _serve_url("vLLM-CPU")
    other["config"]["workload"]["input_len"] = 256
    out = tmp_path / "never.png"
    with pytest.raises(ResultError, match="another workload"):
        plot_serve([serve_result(_serve_url("DejaVu"), "a.json"), serve_result(other, "b.json")], out, "x")
    with pytest.raises(ResultError, match="serve result"):
        plot_serve([serve_result(_serve_url("DejaVu"), "a.json"), serve_result(_paper_serve(), "p.json")], out, "x")
    with pytest.raises(ResultError, match=r"png or \.svg"):
        plot_serve([serve_result(_serve_url("DejaVu"), "a.json")], tmp_path / "plot.pdf", "x")
    with pytest.raises(ResultError, match="paper's experiment"):
        plot_rates(_serve_url("DejaVu"), out, "x")
    assert not out.exists() and not (tmp_path / "plot.pdf").exists()


def test_unreadable_files_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ResultError, match="cannot read"):
        load_result(tmp_path / "missing.json")
    with pytest.raises(ResultError, match=r"text\.json: expected a JSON object, found str"):
        load_result(_write(tmp_path, "text.json", "x"))
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(ResultError, match=r"garbage\.json: not JSON"):
        read_serve(tmp_path / "garbage.json")
    with pytest.raises(ResultError, match="expected a JSON object, found list"):
        read_serve(_write(tmp_path, "list.json", [1, 2]))


# -- chaos ------------------------------------------------------------------------------------------


def test_chaos_timeline_is_a_png(tmp_path: Path) -> None:
    out = tmp_path / "chaos.png"
    plot_chaos(_chaos(), out, "chaos")
    _assert_png(out)


def test_recoveries_are_summarized_per_fault_kind() -> None:
    ranges = recovery_by_kind(read_faults(_chaos(), "chaos.json"))
    assert list(ranges) == ["kill", "redis", "drain"]  # pause was never injected
    assert kind_ranges_json(ranges) == {
        "kill": {"faults": 2, "ready_again_s": [1.0, 1.3], "recovery_s": [2.0, 2.3], "not_recovered": 0},
        "redis": {"faults": 2, "ready_again_s": [1.1, 1.4], "recovery_s": [2.1, 2.1], "not_recovered": 1},
        "drain": {"faults": 2, "ready_again_s": [1.2, 1.5], "recovery_s": [2.2, 2.5], "not_recovered": 0},
    }


def test_a_chaos_summary_without_per_fault_times_is_plotted(tmp_path: Path) -> None:
    doc = _chaos()
    summary = {
        "requests": doc["requests"],
        "recovery_by_kind": kind_ranges_json(recovery_by_kind(read_faults(doc, "chaos.json"))),
    }
    out = tmp_path / "summary.png"
    plot_chaos(json.loads(json.dumps(summary)), out, "figures of the last measured run")
    _assert_png(out)


def test_the_chaos_bench_records_when_requests_end_by_outcome() -> None:
    outcomes = bench_chaos.Outcomes()
    before = time.monotonic()
    for kind, detail in (("failed", "HTTP 503"), ("exact", None), ("exact", None), ("wrong", {"prompt": "p"})):
        outcomes.add(kind, detail)
    assert {kind: len(times) for kind, times in outcomes.ended_at.items()} == {"failed": 1, "exact": 2, "wrong": 1}
    assert all(before <= t <= time.monotonic() for times in outcomes.ended_at.values() for t in times)
    chaos = bench_chaos.Chaos(None, None, {}, argparse.Namespace(interval=5.0, seed=0), outcomes)
    assert 0 <= chaos.recovery_s(before, outcomes) <= time.monotonic() - before  # the first exact completion
    assert (outcomes.exact, outcomes.failed, outcomes.wrong, dict(outcomes.errors)) == (2, 1, 1, {"HTTP 503": 1})


def test_a_stream_its_client_left_is_counted_apart_and_the_timeline_stays_plottable(tmp_path: Path) -> None:
    outcomes = bench_chaos.Outcomes()
    outcomes.add("exact", mix="stream max_tokens")
    outcomes.add("disconnected", mix="stream max_tokens")
    assert (outcomes.exact, outcomes.disconnected) == (1, 1)
    assert set(outcomes.ended_at) == {"exact"}  # the plot knows exact, failed, wrong and hung only
    assert outcomes.by_mix == {"stream max_tokens exact": 1, "stream max_tokens disconnected": 1}
    doc = {**_chaos(), "outcomes_at_s": {kind: [1.0] * len(t) for kind, t in outcomes.ended_at.items()}}
    plot_chaos(doc, tmp_path / "chaos.png", "chaos")
    _assert_png(tmp_path / "chaos.png")


def test_the_chaos_traffic_mix_follows_its_shares() -> None:
    rng = random.Random(0)
    none = argparse.Namespace(non_streaming=0.0, no_max_tokens=0.0, disconnect=0.0, max_tokens=16)
    asks = [bench_chaos._ask(rng, none) for _ in range(200)]
    assert all(a.stream and a.max_tokens == 16 and a.leave_after is None for a in asks)
    every = argparse.Namespace(non_streaming=0.0, no_max_tokens=1.0, disconnect=1.0, max_tokens=16)
    asks = [bench_chaos._ask(rng, every) for _ in range(200)]
    assert all(a.max_tokens is None and a.leave_after in (1, 2, 3) for a in asks)
    whole = argparse.Namespace(non_streaming=1.0, no_max_tokens=0.5, disconnect=1.0, max_tokens=16)
    asks = [bench_chaos._ask(rng, whole) for _ in range(200)]
    assert all(not a.stream and a.leave_after is None for a in asks)  # only a stream can be left
    assert {a.max_tokens for a in asks} == {None, 16}


def test_memory_growth_is_per_process_and_only_for_the_same_process() -> None:
    warm = {
        "controller": {"pid": 1, "rss_mb": 100.0},
        "t0": {"pid": 2, "rss_mb": 200.0},
        "redis": {"pid": 3, "rss_mb": 10.0},
    }
    end = {
        "controller": {"pid": 1, "rss_mb": 105.0},
        "t0": {"pid": 9, "rss_mb": 100.0},  # killed and restarted: another process
        "redis": {"pid": 3, "rss_mb": None},  # its reading failed
        "spare0": {"pid": 4, "rss_mb": 50.0},  # not read at the warm-up
    }
    assert bench_chaos._growth(warm, end) == {
        "controller": 5.0,
        "t0": "restarted",
        "redis": "gone",
        "spare0": "restarted",
    }


def test_an_unknown_fault_is_refused_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match="unknown faults \\['cut'\\]"):
        bench_chaos.main(["--faults", "kill,cut"])


def _broken_chaos(change) -> dict[str, Any]:
    doc = _chaos()
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"requests": {}}, "neither 'faults' nor 'recovery_by_kind'"),
        (_broken_chaos(lambda d: d["faults"][0].pop("at_s")), "faults[0]: 'at_s'"),
        (_broken_chaos(lambda d: d["faults"][1].update(ready_again_s="soon")), "faults[1]: 'ready_again_s'"),
        (_broken_chaos(lambda d: d["faults"][2].update(injected="yes")), "'injected' must be bool"),
        (_broken_chaos(lambda d: d.update(faults=[])), "no faults to plot"),
        (_broken_chaos(lambda d: d.pop("requests")), "missing 'requests'"),
        (_broken_chaos(lambda d: d["requests"].update(hung=None)), "'hung' must be int"),
        (_broken_chaos(lambda d: d["outcomes_at_s"].update(lost=[1.0])), "unknown outcome 'lost'"),
        (_broken_chaos(lambda d: d["outcomes_at_s"].update(exact=[1.0, "x"])), "outcomes_at_s['exact']"),
        (
            {"requests": _chaos()["requests"], "recovery_by_kind": {"kill": {"faults": 2, "ready_again_s": [3, 1]}}},
            "min 3.0 is above max 1.0",
        ),
        (
            {"requests": _chaos()["requests"], "recovery_by_kind": {"kill": {"faults": 1, "not_recovered": 2}}},
            "'not_recovered' must be an integer from 0 to 1",
        ),
    ],
)
def test_malformed_chaos_results_are_refused(tmp_path: Path, doc: dict, message: str) -> None:
    out = tmp_path / "never.png"
    with pytest.raises(ResultError, match=r"chaos\.json") as refused:
        plot_chaos(doc, out, "x", "chaos.json")
    assert message in str(refused.value)
    assert not out.exists()


# -- the commands -----------------------------------------------------------------------------------


def test_bench_plot_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours = _write(tmp_path, "ours.json", _serve_url("DejaVu"))
    theirs = _write(tmp_path, "vllm.json", _serve_url("vLLM-CPU", 1.2))
    assert bench_plot.main(["serve", str(ours), str(theirs)]) == 0
    _assert_png(tmp_path / "ours-compare.png")  # default: beside the first file
    chaos = _write(tmp_path, "chaos.json", _chaos())
    assert bench_plot.main(["chaos", str(chaos), "--out", str(tmp_path / "c.svg")]) == 0
    assert "<svg" in (tmp_path / "c.svg").read_text()[:2000]
    other = _serve_url("vLLM-CPU")
    other["config"]["workload"]["seed"] = 1
    assert bench_plot.main(["serve", str(ours), str(_write(tmp_path, "seed1.json", other))]) == 2
    assert "another workload" in capsys.readouterr().err
    assert bench_plot.main(["chaos", str(ours), "--out", str(tmp_path / "nope.png")]) == 2
    assert "not a chaos result" in capsys.readouterr().err and not (tmp_path / "nope.png").exists()
    with pytest.raises(SystemExit):
        bench_plot.main(["chaos", str(chaos), str(chaos)])


def test_bench_serve_compares_with_another_servers_result(fake: FakeServer, tmp_path: Path) -> None:
    tok = str(_tiny_tokenizer(tmp_path / "tok"))
    base = ["--base-url", fake.url, "--tokenizer", tok, "--num-prompts", "2", "--input-len", "12", "--output-len", "3"]
    first = tmp_path / "first.json"
    assert bench_serve.main([*base, "--ignore-eos", "--label", "first", "--out", str(first)]) == 0
    second = tmp_path / "second.json"
    assert (
        bench_serve.main([*base, "--ignore-eos", "--label", "second", "--compare", str(first), "--out", str(second)])
        == 0
    )
    _assert_png(second.with_suffix(".png"))
    fake.reset()
    with pytest.raises(SystemExit) as refused:  # another workload (no --ignore-eos): refused before any request
        bench_serve.main([*base, "--compare", str(first), "--out", str(tmp_path / "third.json")])
    assert refused.value.code == 2 and fake.bodies == []
    with pytest.raises(SystemExit):
        bench_serve.main([*base, "--ignore-eos", "--compare", str(tmp_path / "missing.json")])
    assert fake.bodies == []
