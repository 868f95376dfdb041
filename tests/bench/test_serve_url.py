"""``dejavu bench serve --base-url``: metrics arithmetic on a scripted timeline, the random token-id
dataset, the concurrency bound, and the whole command against the fake server (conftest)."""

from __future__ import annotations

import json
import math
import socket
import statistics
from pathlib import Path

import pytest
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from benchmarks import bench_serve
from benchmarks.dataset import OutputDist, RandomDataset, TokenPrompts, arrival_times, token_pool, uniform_lengths
from benchmarks.loadgen import ClientConfig, LoadGenerator, RequestRecord, Status
from benchmarks.metrics import SLO, RunMetrics, report
from dejavu_planner.trace import Request as TraceRequest
from dejavu_planner.trace import Trace

from .conftest import MODEL, FakeServer

# -- metrics on a scripted timeline ----------------------------------------------------------------


def _record(rid: int, send: float, chunks: tuple[float, ...], end: float, n: int, prompt: int | None) -> RequestRecord:
    return RequestRecord(
        TraceRequest(rid, send, 30, n), Status.OK, send, chunks, end, n, "length", prompt_tokens=prompt
    )


TIMELINE = [
    _record(0, 0.0, (0.5, 0.6, 0.8, 1.0), 1.0, 4, 10),  # ttft 0.5, e2el 1.0, tpot 0.5/3, itl 0.1 0.2 0.2
    _record(1, 0.2, (1.2, 1.3), 1.4, 2, 20),  # ttft 1.0, e2el 1.2, tpot 0.2, itl 0.1
    _record(2, 0.4, (0.6,), 0.7, 1, None),  # ttft 0.2, e2el 0.3, no tpot, no itl; input from the request (30)
    RequestRecord(TraceRequest(3, 0.5, 30, 4), Status.HTTP_ERROR, 0.5, (), 0.5, 0, http_status=503, error="busy"),
]


def test_metrics_arithmetic_on_a_scripted_timeline() -> None:
    m = RunMetrics.of(TIMELINE)
    assert (m.requests, m.completed, m.failed, m.timeouts) == (4, 3, 1, 0)
    assert m.duration_s == pytest.approx(1.4)  # first send (0.0) to last end (1.4)
    assert (m.total_input_tokens, m.total_output_tokens, m.requested_output_tokens) == (60, 7, 11)
    assert m.request_throughput == pytest.approx(3 / 1.4)
    assert m.output_throughput == pytest.approx(7 / 1.4)
    assert m.total_token_throughput == pytest.approx(67 / 1.4)
    assert m.request_goodput is None
    assert (m.ttft_s.mean, m.ttft_s.median, m.ttft_s.p99) == pytest.approx((1.7 / 3, 0.5, 0.5 + 0.5 * 0.98))
    tpots = (0.5 / 3, 0.2)
    assert (m.tpot_s.mean, m.tpot_s.median) == pytest.approx((statistics.fmean(tpots), statistics.fmean(tpots)))
    assert m.tpot_s.p99 == pytest.approx(tpots[0] + (tpots[1] - tpots[0]) * 0.99) and m.tpot_s.count == 2
    assert (m.itl_s.mean, m.itl_s.median, m.itl_s.p99, m.itl_s.count) == pytest.approx((0.15, 0.15, 0.2, 4))
    assert (m.e2el_s.median, m.normalized_latency_s.median) == pytest.approx((1.0, 0.3))


def test_goodput_counts_requests_meeting_every_slo() -> None:
    assert RunMetrics.of(TIMELINE, SLO(ttft_ms=600)).request_goodput == pytest.approx(2 / 1.4)
    assert RunMetrics.of(TIMELINE, SLO(ttft_ms=600, tpot_ms=180)).request_goodput == pytest.approx(2 / 1.4)
    # TPOTs 166.7 and 200 ms miss 150; the one-token request has no TPOT and meets any TPOT bound.
    assert RunMetrics.of(TIMELINE, SLO(tpot_ms=150)).request_goodput == pytest.approx(1 / 1.4)
    assert RunMetrics.of(TIMELINE, SLO(tpot_ms=201)).request_goodput == pytest.approx(3 / 1.4)
    assert RunMetrics.of(TIMELINE, SLO(ttft_ms=600, tpot_ms=150)).request_goodput == pytest.approx(1 / 1.4)
    assert RunMetrics.of(TIMELINE, SLO(e2el_ms=999)).request_goodput == pytest.approx(1 / 1.4)
    assert RunMetrics.of(TIMELINE, SLO(e2el_ms=5000)).request_goodput == pytest.approx(3 / 1.4)  # never the failed


def test_json_and_report_use_vllms_names() -> None:
    slo = SLO.parse(["ttft:600", "tpot:180"])
    m = RunMetrics.of(TIMELINE, slo)
    out = json.loads(json.dumps(m.to_json()))
    assert out["duration"] == pytest.approx(1.4) and out["completed"] == 3 and out["failed"] == 1
    assert out["request_goodput"] == pytest.approx(2 / 1.4)
    assert out["mean_ttft_ms"] == pytest.approx(1700 / 3) and out["p99_itl_ms"] == pytest.approx(200)
    assert out["median_tpot_ms"] == pytest.approx(1000 * statistics.fmean((0.5 / 3, 0.2)))
    assert {"output_throughput", "total_token_throughput", "median_e2el_ms", "total_input_tokens"} <= set(out)
    text = report(m, "Serving Benchmark Result", slo)
    for line in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 ITL (ms):"):
        assert line in text
    assert "Goodput SLOs (ms): ttft:600 tpot:180" in text and "Request goodput (req/s):" in text
    assert "Median TTFT (ms):                        500.00" in text


@pytest.mark.parametrize("bad", [[], ["ttft"], ["ttfb:5"], ["ttft:x"], ["ttft:-1"], ["ttft:inf"], ["ttft:1", "ttft:2"]])
def test_bad_slos_are_refused(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        SLO.parse(bad)


# -- the dataset -----------------------------------------------------------------------------------


def _tiny_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer: ids 0-2 special (added), 3-11 ordinary words; eos named in the config."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", *"abcdefghi"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return folder


def test_token_pool_leaves_out_special_tokens(tmp_path: Path) -> None:
    folder = _tiny_tokenizer(tmp_path / "tok")
    assert token_pool(folder) == list(range(3, 12)) == token_pool(folder / "tokenizer.json")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        token_pool(tmp_path)


def test_prompts_are_seeded_token_ids_of_the_asked_length() -> None:
    prompts = TokenPrompts(range(100, 200), seed=3)
    ids = prompts.ids(256, key=5)
    assert len(ids) == 256 and all(100 <= i < 200 for i in ids)
    assert ids == TokenPrompts(range(100, 200), seed=3).ids(256, key=5)
    assert ids != prompts.ids(256, key=6) and ids != TokenPrompts(range(100, 200), seed=4).ids(256, key=5)


def test_lengths_fixed_spread_and_lmsys() -> None:
    fixed = RandomDataset(16, 256, 128, seed=1)
    assert fixed.lengths() == [(256, 128)] * 16
    spread = RandomDataset(2000, 100, 50, range_ratio=0.5, seed=1).lengths()
    assert {n for n, _ in spread} <= set(range(50, 151)) and {n for _, n in spread} <= set(range(25, 76))
    assert min(n for n, _ in spread) == 50 and max(n for n, _ in spread) == 150  # both ends reached
    assert statistics.fmean(n for n, _ in spread) == pytest.approx(100, rel=0.05)
    skewed = RandomDataset(2000, 64, 100, output_dist=OutputDist.LMSYS, max_output_len=400, seed=2).lengths()
    outputs = sorted(n for _, n in skewed)
    assert outputs[len(outputs) // 2] == pytest.approx(100, rel=0.1) and max(outputs) == 400
    assert {n for n, _ in skewed} == {64}
    assert RandomDataset(2000, 64, 100, output_dist=OutputDist.LMSYS, seed=2).lengths() != fixed.lengths()
    with pytest.raises(ValueError):
        uniform_lengths(1, 10, 1.0, __import__("random").Random(0))
    with pytest.raises(ValueError):
        RandomDataset(4, 0, 10).lengths()


def test_arrivals_all_at_once_poisson_or_bursty() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    for burstiness in (1.0, 0.5, 4.0):
        times = arrival_times(20_000, 4.0, burstiness, seed=3)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
        # Gamma gaps of shape k: coefficient of variation 1 / sqrt(k) (1 for Poisson).
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness**-0.5, rel=0.08)
    for bad in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, *bad)


# -- the client's concurrency bound ----------------------------------------------------------------


def test_max_concurrency_bounds_requests_in_flight(fake: FakeServer) -> None:
    trace = Trace.of([(0.0, 4, 3)] * 5)
    records = LoadGenerator(ClientConfig(fake.url, MODEL, max_concurrency=2), lambda r: [7, 8]).run_sync(trace)
    assert all(r.ok for r in records) and fake.max_in_flight == 2
    ends = sorted(r.end_s for r in records)
    for record in sorted(records, key=lambda r: r.send_s)[2:]:  # each later send waited for an end
        assert any(end <= record.send_s for end in ends)
    fake.reset()
    # No bound: all at once. Each lasts 2 s here, so a send delayed by a loaded host still finds the
    # others in flight (3 tokens, 0.15 s, once made the fifth start after the first had ended).
    long = Trace.of([(0.0, 4, 40)] * 5)
    LoadGenerator(ClientConfig(fake.url, MODEL), lambda r: [7, 8]).run_sync(long)
    assert fake.max_in_flight == 5
    with pytest.raises(ValueError):
        ClientConfig(fake.url, MODEL, max_concurrency=0)


def test_a_request_waiting_for_a_slot_past_the_run_bound_is_not_sent() -> None:
    with socket.create_server(("127.0.0.1", 0), backlog=16) as sock:  # accepts nothing, answers nothing
        config = ClientConfig(f"http://127.0.0.1:{sock.getsockname()[1]}", MODEL, max_concurrency=1, run_timeout_s=0.5)
        first, second = LoadGenerator(config, lambda r: [1]).run_sync(Trace.of([(0.0, 1, 2), (0.0, 1, 2)]))
    assert first.status is Status.TIMEOUT and second.status is Status.NOT_SENT


# -- the whole command -----------------------------------------------------------------------------


def test_bench_serve_against_a_url(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve-url.json"
    argv = [
        "--base-url", f"{fake.url}/v1", "--tokenizer", str(_tiny_tokenizer(tmp_path / "tok")),
        "--num-prompts", "4", "--input-len", "12", "--output-len", "3", "--ignore-eos",
        "--max-concurrency", "2", "1", "--goodput", "ttft:60000", "--seed", "5", "--out", str(out),
    ]  # fmt: skip
    assert bench_serve.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("Serving Benchmark Result") == 2 and "Maximum request concurrency: 2" in printed
    result = json.loads(out.read_text())
    assert result["config"]["model"] == MODEL  # discovered through GET /v1/models
    assert result["config"]["workload"]["input_len"] == 12 and result["config"]["ignore_eos"] is True
    assert [r["max_concurrency"] for r in result["runs"]] == [2, 1]
    for run in result["runs"]:
        assert run["request_rate"] == "inf" and (run["completed"], run["failed"]) == (4, 0)
        assert (run["total_input_tokens"], run["total_output_tokens"]) == (48, 12)
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # every TTFT under 60 s
        assert run["mean_ttft_ms"] >= 300 * 0.9 and len(run["records"]) == 4
        assert len(run["host_loadavg"]) == 3
    assert out.with_suffix(".png").stat().st_size > 0
    warmup, *measured = fake.bodies
    assert len(warmup["prompt"]) == 16 and len(measured) == 8
    for body in measured:
        assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 3
        assert len(body["prompt"]) == 12 and all(3 <= i < 12 for i in body["prompt"])
    assert sorted(b["prompt"] for b in measured[:4]) == sorted(b["prompt"] for b in measured[4:])  # same per run
    assert len({tuple(b["prompt"]) for b in measured}) == 4


def test_bench_serve_replays_a_trace_at_a_url(fake: FakeServer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    Trace.of([(0.0, 5, 2), (0.3, 7, 1)]).save(trace)
    out = tmp_path / "r.json"
    argv = ["--base-url", fake.url, "--model", MODEL, "--tokenizer", str(_tiny_tokenizer(tmp_path / "tok"))]
    assert bench_serve.main([*argv, "--trace", str(trace), "--num-warmups", "0", "--out", str(out)]) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["request_rate"] is None and run["total_input_tokens"] == 12 and run["total_output_tokens"] == 3
    assert [len(b["prompt"]) for b in fake.bodies] == [5, 7] and "ignore_eos" not in fake.bodies[0]
    assert run["records"][1]["send_s"] >= 0.3


def test_bench_serve_refuses_bad_options_and_reports_an_unreachable_server(tmp_path: Path, capsys) -> None:
    tok = str(_tiny_tokenizer(tmp_path / "tok"))
    for bad in (["--goodput", "ttfb:5"], ["--trace", "t.csv", "--request-rate", "2"], ["--max-concurrency", "0"]):
        with pytest.raises(SystemExit) as exited:
            bench_serve.main(["--base-url", "http://127.0.0.1:9", "--tokenizer", tok, *bad])
        assert exited.value.code == 2
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # closed on leaving the block: nothing listens there
    assert bench_serve.main(["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tok]) == 1
    assert "cannot list the models" in capsys.readouterr().out
