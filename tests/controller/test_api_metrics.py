"""GET /metrics: latency histograms, outcomes, tokens, KV bytes fed by the backend, worker states."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dejavu_controller.api.metrics import GatewayMetrics, KVStream

from .conftest import MODEL, ScriptedBackend


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_requests_tokens_and_latencies(client: TestClient, backend: ScriptedBackend):
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}).json()
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 3})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 0})
    backend.queue_bound = 0
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    client.get("/ready")  # probes are not counted as requests
    samples = scrape(client)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    generated = 4 + len(backend.script(backend.requests[1])) + 3
    assert value("dejavu_generated_tokens_total") == generated
    assert value("dejavu_prompt_tokens_total") == 3 * ok["usage"]["prompt_tokens"]
    assert value("dejavu_requests_total", outcome="length") == 2
    assert value("dejavu_requests_total", outcome="stop") == 1
    assert value("dejavu_requests_total", outcome="rejected") == 1
    assert value("dejavu_requests_total", outcome="overloaded") == 1
    assert value("dejavu_time_to_first_token_seconds_count") == 3
    assert value("dejavu_e2e_request_latency_seconds_count") == 3
    assert value("dejavu_inter_token_latency_seconds_count") == generated - 3
    assert value("dejavu_kv_bytes_streamed_total", purpose="prompt_to_token") == generated * backend.kv_bytes_per_token
    assert value("dejavu_worker_state", state="serving", worker="token-0") == 1
    assert value("dejavu_queue_depth") == 0
    assert value("dejavu_backend_ready") == 1


def test_each_app_has_its_own_registry():
    first, second = GatewayMetrics(), GatewayMetrics()
    first.runtime.add_kv_bytes(10, KVStream.REPLICATION)
    assert b'purpose="replication"} 10.0' in first.render()
    assert b"replication" not in second.render()
    with pytest.raises(ValueError):
        first.runtime.add_kv_bytes(-1)
