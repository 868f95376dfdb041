"""Request traces across real processes: each process (controller, prompt worker, token worker) writes its
spans as JSON lines (``tracing.file``); one request's spans form one trace, every worker span a child of the
controller's request span, with the expected names from each service."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from dejavu_common.settings import Mode

from .cluster import cluster_settings, logs, running

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

# What each deployment's processes record of one request (span name -> service).
DISAGGREGATED = {
    "dejavu.request": "dejavu-controller",
    "dejavu.queue": "dejavu-controller",
    "dejavu.first_token": "dejavu-controller",
    "dejavu.prompt": "dejavu-prompt-worker",
    "dejavu.kv_stream": "dejavu-token-worker",
    "dejavu.decode": "dejavu-token-worker",
}
COLOCATED = {
    "dejavu.request": "dejavu-controller",
    "dejavu.queue": "dejavu-controller",
    "dejavu.first_token": "dejavu-controller",
    "dejavu.prompt": "dejavu-token-worker",
    "dejavu.decode": "dejavu-token-worker",
}


def _spans_of(path: Path, request_id: str, expected: int, timeout_s: float = 30.0) -> list[dict]:
    """The spans of ``request_id``'s trace in ``path``, once ``expected`` of them are there (each process
    exports in batches, a fraction of a second after a span ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        roots = [
            s
            for s in spans
            if s["name"] == "dejavu.request" and s["attributes"]["dejavu.request_id"].startswith(request_id)
        ]
        if roots:
            trace_id = roots[0]["context"]["trace_id"]
            mine = [s for s in spans if s["context"]["trace_id"] == trace_id]
            if len(mine) >= expected or time.monotonic() > deadline:
                return mine
        elif time.monotonic() > deadline:
            return []
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("deployment", "expected"),
    [
        pytest.param(dict(prompt_depth=1, token_depth=1), DISAGGREGATED, id="1P+1T"),
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1, token_microbatch=2), COLOCATED, id="colocated-1"),
    ],
)
def test_one_request_is_one_trace_across_the_processes(
    redis_url: str, model: Path, tmp_path: Path, deployment: dict, expected: dict[str, str]
) -> None:
    path = tmp_path / "spans.jsonl"
    settings = cluster_settings(redis_url, model, tracing={"file": path}, **deployment)
    with running(settings) as launcher:
        body = {"model": settings.model.name, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        response = httpx.post(launcher.api_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        request_id = response.json()["id"]
        spans = _spans_of(path, request_id, len(expected))
        assert spans, f"no trace of {request_id} in {path}\n{logs(launcher)}"
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == sorted(expected), [s["name"] for s in spans]
    assert len(spans) == len(expected), [s["name"] for s in spans]  # one of each: nothing per token or pass
    root = by_name["dejavu.request"]
    assert root["parent_id"] is None
    for name, service in expected.items():
        span = by_name[name]
        assert span["resource"]["attributes"]["service.name"] == service, name
        if name != "dejavu.request":
            assert span["parent_id"] == root["context"]["span_id"], name
    assert [e["name"] for e in root["events"]] == ["first_token"]
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6
    decode = by_name["dejavu.decode"]
    assert decode["attributes"]["dejavu.request_id"] == root["attributes"]["dejavu.request_id"]
    assert by_name["dejavu.prompt"]["start_time"] <= decode["start_time"]
