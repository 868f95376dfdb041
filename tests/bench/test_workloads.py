"""``dejavu bench serve``'s prefix-sharing workloads: the prefix-repetition dataset, multi-turn chats
against the fake server (conftest) whose histories carry the server's real answers, and the
prefix-cache hit rates scraped from real Prometheus expositions (a worker's own metrics server, and
prometheus-client counters named as vLLM names them)."""

from __future__ import annotations

import itertools
import json
import math
import socket
from collections import Counter as Tally
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks import bench_serve
from benchmarks.conversations import ConversationRunner, MultiTurnDataset, later_turns, per_turn
from benchmarks.dataset import PrefixRepetitionDataset, TokenPrompts
from benchmarks.loadgen import ClientConfig, LoadGenerator, PromptBuilder, Status
from benchmarks.prefix_cache import CacheReport, Scraper, parse, scrape
from dejavu_worker.metrics import PrefixCacheStats, StageSnapshot, WorkerMetrics

from .conftest import FIRST_S, MODEL, FakeServer, fake_answer
from .test_serve_url import _tiny_tokenizer

# -- the prefix-repetition dataset -------------------------------------------------------------------


def test_prefix_repetition_deals_every_prefix_and_is_seeded() -> None:
    data = PrefixRepetitionDataset(num_prompts=11, num_prefixes=3, prefix_len=40, suffix_len=7, output_len=5, seed=2)
    dealt = data.prefix_of()
    assert sorted(Tally(dealt).values()) == [3, 4, 4] and dealt == data.prefix_of()
    assert dealt != PrefixRepetitionDataset(11, 3, 40, 7, 5, seed=3).prefix_of()  # the seed shuffles the deal
    trace = data.trace(math.inf)
    assert [(r.arrival_s, r.prompt_len, r.new_tokens) for r in trace.requests] == [(0.0, 47, 5)] * 11
    assert [r.arrival_s for r in data.trace(2.0).requests] == sorted(r.arrival_s for r in data.trace(2.0).requests)


def test_prefix_repetition_prompts_repeat_their_prefix_and_differ_after_it() -> None:
    data = PrefixRepetitionDataset(12, 2, 32, 8, 4, seed=1)
    ids = TokenPrompts(range(100, 400), seed=1)
    prompts = [data.prompt(ids, rid) for rid in range(12)]
    assert all(len(p) == 40 for p in prompts)
    by_prefix: dict[int, list[list[int]]] = {}
    for which, prompt in zip(data.prefix_of(), prompts, strict=True):
        by_prefix.setdefault(which, []).append(prompt)
    assert sorted(by_prefix) == [0, 1] and all(len(group) == 6 for group in by_prefix.values())
    heads = {which: {tuple(p[:32]) for p in group} for which, group in by_prefix.items()}
    assert all(len(h) == 1 for h in heads.values()) and heads[0] != heads[1]  # one prefix per group, two groups
    assert len({tuple(p[32:]) for p in prompts}) == 12  # every suffix its own
    assert prompts == [PrefixRepetitionDataset(12, 2, 32, 8, 4, seed=1).prompt(ids, r) for r in range(12)]


@pytest.mark.parametrize("bad", [(2, 3, 8, 8, 4), (4, 0, 8, 8, 4), (4, 2, 0, 8, 4), (4, 2, 8, -1, 4), (4, 2, 8, 8, 0)])
def test_prefix_repetition_refuses_impossible_shapes(bad: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        PrefixRepetitionDataset(*bad)


def test_bench_serve_prefix_repetition_at_a_url(fake: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    argv = [
        "--base-url", fake.url, "--model", MODEL, "--tokenizer", str(_tiny_tokenizer(tmp_path / "tok")),
        "--dataset", "prefix-repetition", "--num-prompts", "6", "--num-prefixes", "2", "--prefix-len", "8",
        "--suffix-len", "3", "--output-len", "2", "--num-warmups", "0", "--out", str(out),
    ]  # fmt: skip
    assert bench_serve.main(argv) == 0
    prompts = [b["prompt"] for b in fake.bodies]
    assert len(prompts) == 6 and all(len(p) == 11 and all(3 <= i < 12 for i in p) for p in prompts)
    assert sorted(Tally(tuple(p[:8]) for p in prompts).values()) == [3, 3]  # two prefixes, three requests each
    assert len({tuple(p[8:]) for p in prompts}) == 6
    [run] = json.loads(out.read_text())["runs"]
    assert run["completed"] == 6 and run["total_input_tokens"] == 66
    assert json.loads(out.read_text())["config"]["workload"]["dataset"] == "prefix-repetition"
    assert run["prefix_cache"]["sources"] == {} and "404" in run["prefix_cache"]["absent"]  # the fake has none


def test_bench_serve_refuses_impossible_datasets(tmp_path: Path) -> None:
    tok = str(_tiny_tokenizer(tmp_path / "tok"))
    url = ["--base-url", "http://127.0.0.1:9", "--tokenizer", tok]
    for bad in (
        ["--dataset", "prefix-repetition", "--num-prompts", "4", "--num-prefixes", "5"],
        ["--dataset", "multi-turn", "--num-turns", "0"],
        ["--dataset", "multi-turn", "--think-time-s", "-1"],
        ["--dataset", "prefix-repetition", "--trace", "t.csv"],
    ):
        with pytest.raises(SystemExit) as exited:
            bench_serve.main([*url, *bad])
        assert exited.value.code == 2
    spawned = ["--model-folder", str(tmp_path / "tok"), "--dataset", "prefix-repetition"]
    with pytest.raises(SystemExit) as exited:  # 6 requests cannot cover the 10 default prefixes
        bench_serve.parse_args(spawned)
    assert exited.value.code == 2
    assert bench_serve.parse_args([*spawned, "--num-prefixes", "3"]).dataset.num_prefixes == 3


# -- multi-turn chats --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from dejavu_common.settings import Settings
    from dejavu_common.tokenizer import Tokenizer
    from dejavu_engine.checkpoint import ensure_default_model

    return Tokenizer.from_pretrained(ensure_default_model(Settings()))


@pytest.mark.model
def test_user_messages_have_the_asked_tokens_and_are_seeded(tokenizer) -> None:
    data = MultiTurnDataset(num_conversations=3, num_turns=4, user_len=37, output_len=5, seed=4)
    builder = PromptBuilder(tokenizer, seed=4)
    messages = [data.user_message(builder, c, t) for c in range(3) for t in range(1, 5)]
    assert all(len(tokenizer.encode(m)) == 37 for m in messages)
    assert len(set(messages)) == 12
    assert messages == [
        data.user_message(PromptBuilder(tokenizer, seed=4), c, t) for c in range(3) for t in (1, 2, 3, 4)
    ]
    assert messages[0] != MultiTurnDataset(3, 4, 37, 5, seed=5).user_message(PromptBuilder(tokenizer, seed=5), 0, 1)


@pytest.mark.model
def test_each_turn_resends_the_history_with_the_servers_real_answers(fake: FakeServer, tokenizer) -> None:
    data = MultiTurnDataset(num_conversations=3, num_turns=3, user_len=12, output_len=3, think_time_s=0.2, seed=1)
    turns = ConversationRunner(LoadGenerator(ClientConfig(fake.url, MODEL)), data, tokenizer).run_sync(math.inf)
    assert [(t.conversation, t.turn) for t in turns] == [(c, n) for c in range(3) for n in (1, 2, 3)]
    assert all(t.record.ok for t in turns) and len(fake.bodies) == 9
    bodies = {tuple(json.dumps(m) for m in b["messages"]): b for b in fake.bodies}
    builder = PromptBuilder(tokenizer, seed=1)
    for conversation in range(3):
        mine = [t for t in turns if t.conversation == conversation]
        for earlier, later in itertools.pairwise(mine):
            sent = bodies[tuple(json.dumps(m) for m in earlier.messages)]
            answer = "".join(fake_answer(sent))
            assert earlier.record.text == answer
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert later.messages[len(earlier.messages)] == {"role": "assistant", "content": answer}
            assert later.record.send_s >= earlier.record.end_s + 0.2  # after the answer and the think time
        users = [m["content"] for m in mine[-1].messages if m["role"] == "user"]
        assert users == [data.user_message(builder, conversation, n) for n in (1, 2, 3)]
        assert [m["role"] for m in mine[-1].messages] == ["user", "assistant", "user", "assistant", "user"]
    for t in turns:  # the opening role chunk is no token: the first comes after the fake's first delay
        assert t.record.ttft_s >= FIRST_S and t.record.generated == 3 and len(t.record.chunk_times_s) == 3
        assert t.record.request.prompt_len == len(tokenizer.apply_chat_template(list(t.messages)))
    summaries = per_turn(turns)
    assert [(s.turn, s.requests, s.completed) for s in summaries] == [(1, 3, 3), (2, 3, 3), (3, 3, 3)]
    assert summaries[0].mean_input_tokens < summaries[1].mean_input_tokens < summaries[2].mean_input_tokens
    later = later_turns(turns)
    assert (later.requests, later.ttft_s.count) == (6, 6)


@pytest.mark.model
def test_a_failed_turn_ends_its_conversation(fake: FakeServer, tokenizer) -> None:
    data = MultiTurnDataset(num_conversations=2, num_turns=3, user_len=4, output_len=2)
    generator = LoadGenerator(ClientConfig(fake.url, "fail-turn-2"))
    turns = ConversationRunner(generator, data, tokenizer).run_sync(math.inf)
    assert [t.record.status for t in turns] == [Status.OK, Status.HTTP_ERROR, Status.NOT_SENT] * 2
    assert turns[2].record.error == "turn 2 failed (http_error)" and len(fake.bodies) == 4


@pytest.mark.model
def test_bench_serve_multi_turn_at_a_url(fake: FakeServer, tmp_path: Path, capsys, tokenizer) -> None:
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import ensure_default_model

    out = tmp_path / "chat.json"
    argv = [
        "--base-url", fake.url, "--model", MODEL, "--tokenizer", str(ensure_default_model(Settings())),
        "--dataset", "multi-turn", "--num-conversations", "2", "--num-turns", "2", "--user-len", "6",
        "--output-len", "2", "--max-concurrency", "1", "--out", str(out),
    ]  # fmt: skip
    assert bench_serve.main(argv) == 0
    assert fake.max_in_flight == 1
    [run] = json.loads(out.read_text())["runs"]
    assert run["completed"] == 4 and [t["turn"] for t in run["per_turn"]] == [1, 2]
    assert run["later_turns"]["completed"] == 2 and run["per_turn"][0]["median_ttft_ms"] >= FIRST_S * 1000
    printed = capsys.readouterr().out
    assert "Turn 2 median TTFT (ms, 2/2):" in printed and "Later turns / turn 1" in printed


# -- prefix-cache hit rates ----------------------------------------------------------------------------


def _vllm_exposition(queries: dict[str, float], hits: dict[str, float]) -> bytes:
    """Prometheus text as vLLM's engine writes its prefix-cache counters, one label set per engine."""
    registry = CollectorRegistry()
    q = Counter("vllm:prefix_cache_queries", "Prefix cache queries.", ["model_name", "engine"], registry=registry)
    h = Counter("vllm:prefix_cache_hits", "Prefix cache hits.", ["model_name", "engine"], registry=registry)
    for engine, value in queries.items():
        q.labels(MODEL, engine).inc(value)
    for engine, value in hits.items():
        h.labels(MODEL, engine).inc(value)
    return generate_latest(registry)


def test_vllm_counters_are_summed_over_engines() -> None:
    found = parse(_vllm_exposition({"0": 300, "1": 100}, {"0": 120, "1": 30}).decode())
    assert set(found) == {"vllm"} and (found["vllm"].queried_tokens, found["vllm"].hit_tokens) == (400, 150)
    assert parse("# HELP other x\n# TYPE other counter\nother_total 3\n") == {}
    with pytest.raises(ValueError):
        parse("not prometheus {{{")


def test_hit_rates_between_two_scrapes_of_a_workers_metrics_and_a_vllm_server(fake: FakeServer) -> None:
    stats = {"now": PrefixCacheStats(query_tokens=100, hit_tokens=10, shared_blocks=0, cached_free_blocks=0)}
    worker = WorkerMetrics("w0", "token")
    worker.watch(lambda: StageSnapshot(prefix_cache=stats["now"]), dict)
    port = worker.serve("127.0.0.1", 0)
    try:
        urls = [f"http://127.0.0.1:{port}/metrics", f"{fake.url}/metrics"]
        fake.metrics = _vllm_exposition({"0": 50}, {"0": 0})
        scraper = Scraper(urls[:1], discover=lambda: urls[1:])
        before = scraper.scrape()
        stats["now"] = PrefixCacheStats(query_tokens=612, hit_tokens=394, shared_blocks=3, cached_free_blocks=1)
        fake.metrics = _vllm_exposition({"0": 150}, {"0": 75})
        after = scraper.scrape()
    finally:
        worker.close()
    report = CacheReport.between(before, after)
    assert report.absent is None and report.urls == tuple(urls)
    assert {r.source: (r.queried_tokens, r.hit_tokens) for r in report.rates} == {
        "dejavu": (512, 384),
        "vllm": (100, 75),
    }
    assert [r.rate for r in report.rates] == [0.75, 0.75]
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["sources"]["dejavu"] == {"queried_tokens": 512, "hit_tokens": 384, "hit_rate": 0.75}
    assert "Hit rate (dejavu):                       75.00%" in "\n".join(report.lines())


def test_absent_counters_are_reported_as_absent(fake: FakeServer) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"  # nothing listens once the block ends
    fake.metrics = b"# HELP other x\n# TYPE other counter\nother_total 3\n"
    report = CacheReport.between(scrape([f"{fake.url}/metrics", closed]), scrape([f"{fake.url}/metrics", closed]))
    assert report.rates == () and "no dejavu_prefix_cache_queries_tokens_total" in report.absent
    assert closed in report.absent and "ConnectError" in report.absent
    assert report.to_json()["sources"] == {} and report.lines()[-1].startswith("absent: ")
    assert "no metrics URL" in CacheReport.between(scrape([]), scrape([])).absent
    backwards = CacheReport.between(
        scrape_of(_vllm_exposition({"0": 90}, {"0": 9})), scrape_of(_vllm_exposition({"0": 10}, {"0": 1}))
    )
    assert backwards.rates == () and "went backwards" in backwards.absent


def scrape_of(text: bytes):
    """A scrape that found ``text`` at one made-up URL."""
    from benchmarks.prefix_cache import Scrape

    return Scrape(("http://127.0.0.1:9/metrics",), parse(text.decode()))


def test_a_registry_that_cannot_be_read_loses_only_the_workers(fake: FakeServer) -> None:
    fake.metrics = _vllm_exposition({"0": 1}, {"0": 1})

    def broken() -> list[str]:
        raise OSError("no registry")

    result = Scraper([f"{fake.url}/metrics"], discover=broken).scrape()
    assert "vllm" in result.counters and "no registry" in result.errors["workers"]
