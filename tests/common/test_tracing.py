"""Request traces (dejavu_common.tracing): off and free by default; a span's context crosses a message and
the worker's span continues the same trace under the right parent; the JSON-lines exporter."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN
from pydantic import ValidationError

from dejavu_common import tracing
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_common.settings import Settings, TracingSettings
from dejavu_common.tracing import RowSpans


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider)
    yield memory
    tracing.install(None)


def _row(request_id: str, traceparent: str | None) -> RowSpec:
    return RowSpec(
        request_id=request_id, prompt_ids=(1, 2), sampling=SamplingSpec(max_tokens=2), traceparent=traceparent
    )


def test_off_by_default_imports_no_sdk_and_makes_nothing() -> None:
    code = (
        "import sys\n"
        "from dejavu_common import tracing\n"
        "from dejavu_common.settings import Settings\n"
        "assert tracing.configure(Settings().tracing, 'x') is False\n"
        "assert not tracing.enabled()\n"
        "assert tracing.start('s', '00-' + 'a' * 32 + '-' + 'b' * 16 + '-01') is tracing.INVALID_SPAN\n"
        "assert not any(m.startswith('opentelemetry.sdk') for m in sys.modules), 'the SDK was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"PATH": ""})
    assert RowSpans.start("dejavu.prompt", [_row("a", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")]) is None


def test_the_trace_context_crosses_the_microbatch_spec(exporter: InMemorySpanExporter) -> None:
    root = tracing.start("dejavu.request")  # the controller's span of the request
    parent = tracing.traceparent(root)
    assert parent is not None
    spec = MicrobatchSpec(mb_id=7, rows=(_row("a", parent), _row("b", None)), prompt_len=2, max_len=4)
    received = MicrobatchSpec.decode(spec.encode())  # through Redis, as JSON
    spans = RowSpans.start("dejavu.prompt", received.rows, {tracing.STAGE: 0}, mb_id=received.mb_id)
    assert spans is not None and set(spans.spans) == {0}  # the untraced row has no span
    spans.event("first_token")
    spans.end()
    root.end()
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    worker, controller = by_name["dejavu.prompt"], by_name["dejavu.request"]
    assert worker.context.trace_id == controller.context.trace_id
    assert worker.parent is not None and worker.parent.span_id == controller.context.span_id
    assert worker.attributes[tracing.REQUEST_ID] == "a" and worker.attributes[tracing.MICROBATCH] == 7
    assert [e.name for e in worker.events] == ["first_token"]


def test_row_spans_end_row_by_row_and_fail(exporter: InMemorySpanExporter) -> None:
    root = tracing.start("dejavu.request")
    rows = [_row(f"r{i}", tracing.traceparent(root)) for i in range(3)]
    spans = RowSpans.start("dejavu.decode", rows, only=(0, 2), mb_id=1)
    assert spans is not None and set(spans.spans) == {0, 2}
    spans.end_except(live=(2,))
    assert [s.attributes[tracing.ROW] for s in exporter.get_finished_spans()] == [0]
    spans.fail(RuntimeError("boom"))
    spans.end()  # idempotent
    finished = exporter.get_finished_spans()
    assert len(finished) == 2 and not finished[1].status.is_ok


def test_untraced_rows_keep_their_wire_format_and_bad_contexts_are_refused() -> None:
    untraced = _row("a", None)
    assert b"traceparent" not in untraced.encode()  # what readers without the field accept
    assert RowSpec.decode(untraced.encode()) == untraced
    with pytest.raises(ValidationError):
        _row("a", "not-a-traceparent")
    with pytest.raises(ValidationError):
        _row("a", "00-" + "A" * 32 + "-" + "b" * 16 + "-01")


def test_a_malformed_context_is_not_continued(exporter: InMemorySpanExporter) -> None:
    assert tracing.start("dejavu.prompt", "00-" + "0" * 32 + "-" + "b" * 16 + "-01") is INVALID_SPAN  # zero trace id


def test_unsampled_requests_carry_no_context() -> None:
    provider_settings = TracingSettings(file=Path("/dev/null"), sample_ratio=0.0)
    assert tracing.configure(provider_settings, "dejavu-test")
    try:
        root = tracing.start("dejavu.request")
        assert not root.is_recording()
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_the_file_exporter_writes_one_json_span_per_line(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    assert tracing.configure(TracingSettings(file=path), "dejavu-test", "w-1")
    root = tracing.start("dejavu.request", attributes={tracing.REQUEST_ID: "r"})
    tracing.start("dejavu.queue", root).end()
    root.end()
    tracing.shutdown()  # flushes the batch
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["dejavu.queue", "dejavu.request"]
    assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]
    assert spans[1]["resource"]["attributes"]["service.name"] == "dejavu-test"
    assert spans[1]["resource"]["attributes"]["service.instance.id"] == "w-1"


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJAVU_TRACING__OTLP_ENDPOINT", "http://collector:4318/v1/traces")
    settings = Settings().tracing
    assert settings.enabled and settings.otlp_endpoint == "http://collector:4318/v1/traces"
    monkeypatch.setenv("DEJAVU_TRACING__OTLP_ENDPOINT", "collector:4318")
    with pytest.raises(ValidationError):
        Settings()
    assert "DEJAVU_TRACING__FILE" in Settings(tracing=TracingSettings(file=Path("/tmp/x"))).to_env()
