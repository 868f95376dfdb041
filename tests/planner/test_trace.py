"""Trace files and synthetic generators."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from dejavu_planner.trace import Trace, lmsys_like_trace, uniform_trace
from dejavu_planner.workload import Workload


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_trace_file_round_trip(tmp_path: Path, suffix: str) -> None:
    trace = lmsys_like_trace(50, 300, rate_per_s=2.0, seed=5)
    path = tmp_path / f"t{suffix}"
    trace.save(path)
    assert Trace.load(path) == trace


def test_csv_sorted_on_load_and_validated(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,new_tokens\n2.0,10,3\n1.0,20,4\n")
    trace = Trace.load(path)
    assert [r.arrival_s for r in trace.requests] == [1.0, 2.0]
    assert [r.rid for r in trace.requests] == [0, 1]
    path.write_text("when,prompt_len,new_tokens\n1,2,3\n")
    with pytest.raises(ValueError, match="header"):
        Trace.load(path)
    path.write_text("arrival_s,prompt_len,new_tokens\n1,2,0\n")
    with pytest.raises(ValueError):
        Trace.load(path)


def test_lmsys_like_lengths_are_skewed_and_bounded() -> None:
    trace = lmsys_like_trace(4000, 1000, median_new=150, sigma=0.9, max_new=1024, seed=1)
    lengths = [r.new_tokens for r in trace.requests]
    assert min(lengths) >= 1 and max(lengths) <= 1024
    assert statistics.median(lengths) == pytest.approx(150, rel=0.08)
    assert statistics.mean(lengths) > 1.3 * statistics.median(lengths)  # long right tail
    assert all(r.arrival_s == 0 for r in trace.requests)  # a backlog by default


def test_poisson_arrivals_have_the_requested_rate() -> None:
    trace = uniform_trace(4000, 10, 5, rate_per_s=4.0, seed=2)
    span = trace.requests[-1].arrival_s
    assert len(trace) / span == pytest.approx(4.0, rel=0.08)


def test_workload_from_trace() -> None:
    trace = Trace.of([(0, 10, 3), (0, 20, 5), (1, 5, 1)])
    w = Workload.from_trace(trace)
    assert (w.prompt_len, w.mean_new_tokens, w.max_new_tokens) == (20, 3.0, 5)
    assert w.token_steps == 2.0  # N excludes the token the prompt yields


def test_grouped_lengths_repeat_within_each_group() -> None:
    trace = lmsys_like_trace(10, 100, group=4, seed=3)
    lengths = [r.new_tokens for r in trace.requests]
    assert lengths[0:4] == [lengths[0]] * 4 and lengths[4:8] == [lengths[4]] * 4 and lengths[8:] == [lengths[8]] * 2
    assert len(set(lengths)) > 1
