"""The load generator against a fake OpenAI-compatible streaming server with known delays (conftest).

The checks are of the client's bookkeeping and arithmetic: the bounds the sleeps guarantee, and
generous upper bounds only to catch a wrong formula, never to judge speed.
"""

from __future__ import annotations

import json
import socket
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.dataset import arrival_times
from benchmarks.loadgen import ClientConfig, LoadGenerator, PromptBuilder, RequestRecord, Status
from benchmarks.metrics import RunMetrics, percentile
from dejavu_planner.trace import Request as TraceRequest
from dejavu_planner.trace import Trace

from .conftest import FIRST_S, MODEL, TOKEN_S

SLACK_S = 2.0  # generous: scheduling noise on a loaded 2-core machine, never a speed judgement


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A listening socket that never accepts: connections open (kernel backlog), no answer ever comes."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def run(url: str, rows: list[tuple[float, int, int]], prompts: list[str], **config) -> list[RequestRecord]:
    trace = Trace.of(rows)
    generator = LoadGenerator(ClientConfig(url, MODEL, **config), lambda r: prompts[r.rid])
    return generator.run_sync(trace)


def test_records_match_the_servers_known_delays(fake_url: str) -> None:
    rows = [(0.0, 8, 10), (0.05, 8, 5), (0.1, 8, 1)]
    records = run(fake_url, rows, ["a", "b", "c"])
    for record, (_, _, n) in zip(records, rows, strict=True):
        assert record.status is Status.OK, record.error
        assert record.generated == n and len(record.chunk_times_s) == n
        assert record.finish_reason == "length" and record.http_status == 200
        assert FIRST_S * 0.9 <= record.ttft_s <= FIRST_S + SLACK_S
        floor = FIRST_S + TOKEN_S * (n - 1)
        assert floor * 0.9 <= record.e2e_s <= floor + SLACK_S
        assert record.normalized_latency_s == pytest.approx(record.e2e_s / n)
        assert list(record.chunk_times_s) == sorted(record.chunk_times_s)
        assert record.send_s <= record.chunk_times_s[0] and record.chunk_times_s[-1] <= record.end_s
    many = records[0]
    assert TOKEN_S * 0.9 <= many.tpot_s <= TOKEN_S + SLACK_S
    assert many.tpot_s == pytest.approx((many.e2e_s - many.ttft_s) / 9)
    assert len(many.itl_s) == 9 and all(gap >= TOKEN_S * 0.9 for gap in many.itl_s)
    assert records[2].tpot_s is None and records[2].itl_s == ()  # one token: nothing after the first

    metrics = RunMetrics.of(records)
    assert (metrics.requests, metrics.completed, metrics.failed, metrics.timeouts) == (3, 3, 0, 0)
    assert metrics.total_output_tokens == 16 == metrics.requested_output_tokens
    assert metrics.total_input_tokens == 3  # the fake server reports one prompt token per text prompt
    duration = max(r.end_s for r in records) - min(r.send_s for r in records)
    assert metrics.duration_s == pytest.approx(duration)
    assert metrics.output_throughput == pytest.approx(16 / duration)
    assert metrics.total_token_throughput == pytest.approx(19 / duration)
    assert metrics.request_throughput == pytest.approx(3 / duration)
    assert metrics.normalized_latency_s.median == pytest.approx(records[1].normalized_latency_s)
    assert (metrics.ttft_s.count, metrics.tpot_s.count, metrics.itl_s.count) == (3, 2, 13)


def test_generated_count_falls_back_to_chunks_without_usage(fake_url: str) -> None:
    (record,) = run(fake_url, [(0.0, 8, 4)], ["no-usage"])
    assert record.status is Status.OK
    assert record.generated == 4 == len(record.chunk_times_s)


def test_errors_are_recorded_not_raised(fake_url: str) -> None:
    busy, broken = run(fake_url, [(0.0, 8, 5), (0.0, 8, 5)], ["busy", "broken"])
    assert busy.status is Status.HTTP_ERROR and busy.http_status == 503 and "queue full" in busy.error
    assert broken.status is Status.STREAM_ERROR and "worker lost" in broken.error
    assert len(broken.chunk_times_s) == 2
    metrics = RunMetrics.of([busy, broken])
    assert (metrics.completed, metrics.failed, metrics.total_output_tokens) == (0, 2, 0)
    assert metrics.normalized_latency_s.median is None


def test_refused_connection_is_a_stream_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # closed again on leaving the block: nothing listens there
    (record,) = run(f"http://127.0.0.1:{port}", [(0.0, 8, 5)], ["a"])
    assert record.status is Status.STREAM_ERROR and "ConnectError" in record.error


def test_a_server_that_never_answers_gives_timeouts(silent_url: str) -> None:
    records = run(silent_url, [(0.0, 8, 5), (0.1, 8, 5)], ["a", "b"], request_timeout_s=0.5)
    for record in records:
        assert record.status is Status.TIMEOUT and record.chunk_times_s == ()
        assert record.e2e_s >= 0.5 * 0.9
    assert records[1].send_s < records[0].end_s  # open loop: the second is sent while the first still waits
    assert RunMetrics.of(records).timeouts == 2


def test_the_run_bound_stops_sends_and_streams(silent_url: str) -> None:
    records = run(silent_url, [(0.0, 8, 5), (30.0, 8, 5)], ["a", "b"], request_timeout_s=60, run_timeout_s=0.5)
    assert records[0].status is Status.TIMEOUT and records[0].end_s < 30
    assert records[1].status is Status.NOT_SENT and records[1].send_s is None
    metrics = RunMetrics.of(records)
    assert (metrics.failed, metrics.timeouts) == (2, 1)


def test_trace_replay_respects_arrival_times(fake_url: str, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    Trace.of([(1.2, 8, 2), (0.0, 8, 3), (0.4, 8, 1), (0.8, 8, 2)]).save(path)
    trace = Trace.load(path)
    records = LoadGenerator(ClientConfig(fake_url, MODEL), lambda r: "p").run_sync(trace)
    assert [r.request for r in records] == list(trace.requests)
    sends = [r.send_s for r in records]
    assert sends == sorted(sends)
    for record in records:
        assert record.status is Status.OK
        assert record.request.arrival_s <= record.send_s <= record.request.arrival_s + SLACK_S
        assert record.generated == record.request.new_tokens  # new_tokens is sent as max_tokens


def test_poisson_arrivals_are_seeded_with_the_right_mean() -> None:
    rate = 4.0
    times = arrival_times(20_000, rate, seed=7)
    assert times == arrival_times(20_000, rate, seed=7)
    assert times != arrival_times(20_000, rate, seed=8)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)


def test_percentiles_interpolate_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_metrics_of_synthetic_records() -> None:
    def record(rid: int, send: float, chunks: tuple[float, ...], end: float, n: int) -> RequestRecord:
        return RequestRecord(TraceRequest(rid, send, 10, n), Status.OK, send, chunks, end, n, "length")

    records = [
        record(0, 0.0, (1.0, 2.0, 3.0), 3.0, 3),  # e2e 3, normalized 1, ttft 1, tpot 1
        record(1, 1.0, (1.5, 2.0), 2.0, 2),  # e2e 1, normalized 0.5, ttft 0.5, tpot 0.5
        RequestRecord(TraceRequest(2, 2.0, 10, 4), Status.TIMEOUT, 2.0, (), 6.0, 0, error="deadline"),
    ]
    metrics = RunMetrics.of(records)
    assert metrics.duration_s == 6.0  # from the first send to the timed-out request's end
    assert metrics.total_output_tokens == 5 and metrics.output_throughput == pytest.approx(5 / 6)
    assert metrics.normalized_latency_s.median == pytest.approx(0.75)
    assert metrics.normalized_latency_s.p99 == pytest.approx(0.5 + 0.5 * 0.99)
    assert metrics.ttft_s.median == pytest.approx(0.75) and metrics.tpot_s.median == pytest.approx(0.75)
    assert (metrics.completed, metrics.failed, metrics.timeouts, metrics.requested_output_tokens) == (2, 1, 1, 9)
    assert json.loads(json.dumps(metrics.to_json()))["median_e2el_ms"] == pytest.approx(2000.0)


@pytest.mark.model
def test_prompts_have_exactly_the_asked_token_count() -> None:
    from dejavu_common.settings import Settings
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.checkpoint import ensure_default_model

    tokenizer = Tokenizer.from_pretrained(ensure_default_model(Settings()))
    builder = PromptBuilder(tokenizer, seed=3)
    for n in (1, 17, 1000):
        assert len(tokenizer.encode(builder.text(n, key=5))) == n
    assert builder.text(64, key=1) == builder.text(64, key=1)
    assert builder.text(64, key=1) != builder.text(64, key=2)
