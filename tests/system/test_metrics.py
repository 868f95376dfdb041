"""Every worker of a real deployment serves its Prometheus metrics on a port of its own (``worker.metrics_port``
0: a free one), publishes the URL in its registry record, and `dejavu admin status --json` lists it; after a
round of requests each worker's endpoint shows the passes it ran and the data-plane traffic it carried."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dejavu_cli.main import main as dejavu

from .cluster import cluster_settings, logs, running
from .test_failures import Round

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> tuple[set[str], Samples]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    parsed = list(text_string_to_metric_families(text))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parsed for s in f.samples}
    return {f.name for f in parsed}, samples


def _total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_every_worker_serves_its_metrics_and_admin_status_lists_the_urls(redis_url, model, capsys) -> None:
    settings = cluster_settings(
        redis_url,
        model,
        prompt_depth=1,
        token_depth=2,
        prompt_microbatch=2,
        token_microbatch=2,
        worker={"metrics_port": 0},
    )
    with running(settings) as launcher:
        assert len(Round(launcher, settings).finish(timeout_s=120)) == 4

        capsys.readouterr()
        assert dejavu(["admin", "--redis-url", redis_url, "status", "--json"]) == 0
        workers = json.loads(capsys.readouterr().out)["workers"]
        assert len(workers) == 3 and all(w["metrics_url"] for w in workers.values()), workers
        by_stage = {(w["role"], w["stage"]["stage"]): w["metrics_url"] for w in workers.values()}

        names, prompt = _scrape(by_stage[("prompt", 0)])
        assert _total(prompt, "dejavu_stage_pass_seconds_count", kind="prefill") >= 1
        assert _total(prompt, "dejavu_stage_pass_tokens_sum", kind="prefill") >= 8  # 4 prompts of >= 2 tokens
        assert _total(prompt, "dejavu_dataplane_sent_bytes_total", channel="KV_PROMPT") > 0

        for stage in (0, 1):
            names, token = _scrape(by_stage[("token", stage)])
            assert _total(token, "dejavu_stage_index") == stage
            # 4 requests of 20 tokens in microbatches of 2: at least 19 decode steps of some microbatch.
            assert _total(token, "dejavu_stage_pass_seconds_count", kind="decode") >= 19, logs(launcher)
            assert _total(token, "dejavu_stage_pass_tokens_sum", kind="decode") >= 4 * 19
            assert _total(token, "dejavu_dataplane_received_bytes_total", channel="KV_PROMPT") > 0
            assert _total(token, "dejavu_dataplane_sent_bytes_total", channel="KV_REPLICA") > 0
            assert _total(token, "dejavu_dataplane_send_seconds_count", channel="KV_REPLICA") > 0
            assert {"dejavu_replication_lag_steps", "dejavu_replication_lag_bytes", "dejavu_replica_microbatches",
                    "dejavu_stage_microbatches", "dejavu_preemptions"} <= names  # fmt: skip
            assert _total(token, "dejavu_dataplane_corrupt_payloads_total") == 0
            if "dejavu_kv_pool_capacity_blocks" in names:  # a paged pool (native kernels built)
                used = _total(token, "dejavu_kv_pool_used_blocks", pool="stage")
                free = _total(token, "dejavu_kv_pool_free_blocks", pool="stage")
                assert used + free == _total(token, "dejavu_kv_pool_capacity_blocks", pool="stage")
        names, first = _scrape(by_stage[("token", 0)])
        assert {"dejavu_stage_running_rows", "dejavu_stage_waiting_rows"} <= names  # stage 0 schedules
        assert _total(first, "dejavu_stage_running_rows") == 0  # every request finished
