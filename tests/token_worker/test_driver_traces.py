"""Token stage 0's spans (dejavu_token_worker.traces) through the driver's scripted pipeline: one
``dejavu.decode`` span per traced row, under the request's span, ended when that row finishes; none per pass."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dejavu_common import tracing
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_token_worker.driver import Driver
from dejavu_token_worker.runner import Position

from .test_driver import Pipeline, Ready


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider)
    yield memory
    tracing.install(None)


def test_one_decode_span_per_row_ends_when_the_row_finishes(exporter: InMemorySpanExporter) -> None:
    root = tracing.start("dejavu.request")
    traced = RowSpec(
        request_id="r1", prompt_ids=(1, 2), sampling=SamplingSpec(max_tokens=50), traceparent=tracing.traceparent(root)
    )
    untraced = RowSpec(request_id="r2", prompt_ids=(1, 2), sampling=SamplingSpec(max_tokens=50))
    spec = MicrobatchSpec(mb_id=1, rows=(traced, traced, untraced), prompt_len=2, max_len=52)
    pipeline = Pipeline(1, {1: 5}, {1: spec}, row_finish={1: {0: 2}})  # row 0 finishes at step 2, the rest at 5
    driver = Driver(pipeline, pipeline, None, "t0", Position(0, 1, None, "t0", False), Ready(pipeline, [(1, 0)]), 1.0)  # type: ignore[arg-type]
    rounds = iter(range(10_000))
    driver.run(lambda: pipeline.released == [1] or next(rounds) >= 9_999)
    root.end()
    assert len(pipeline.passes) == 5
    decode = [s for s in exporter.get_finished_spans() if s.name == "dejavu.decode"]
    assert sorted((s.attributes[tracing.ROW], s.attributes["dejavu.last_step"]) for s in decode) == [(0, 2), (1, 5)]
    for span in decode:
        assert span.context.trace_id == root.get_span_context().trace_id
        assert span.parent is not None and span.parent.span_id == root.get_span_context().span_id
        assert span.attributes["dejavu.step"] == 1 and not span.attributes["dejavu.resumed"]


def test_a_new_epoch_ends_the_spans_of_its_members(exporter: InMemorySpanExporter) -> None:
    root = tracing.start("dejavu.request")
    row = RowSpec(
        request_id="r1", prompt_ids=(1,), sampling=SamplingSpec(max_tokens=50), traceparent=tracing.traceparent(root)
    )
    spec = MicrobatchSpec(mb_id=1, rows=(row,), prompt_len=1, max_len=51)
    pipeline = Pipeline(1, {1: 50}, {1: spec})
    driver = Driver(pipeline, pipeline, None, "t0", Position(0, 1, None, "t0", False), Ready(pipeline, [(1, 0)]), 1.0)  # type: ignore[arg-type]
    driver.run(lambda: len(pipeline.passes) >= 3)
    assert not exporter.get_finished_spans()  # still decoding
    driver.end_traces()
    (span,) = exporter.get_finished_spans()
    assert span.name == "dejavu.decode" and span.attributes["dejavu.last_step"] == 4
