"""The controller's spans of a request (dejavu_controller.request_trace) through the real PipelineBackend on a
real Redis: the request's root span, its queueing and first-token spans, the trace context written into the
microbatch spec the workers read, and a worker span continuing that trace."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dejavu_common import keys, tracing
from dejavu_common.messages import FinishReason, MicrobatchSpec, StageAssignment, TokenStep, Topology
from dejavu_common.settings import Settings
from dejavu_common.tracing import RowSpans
from dejavu_controller.backend import GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend
from tests.controller.entry_writer import publish, stage_holder


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider)
    yield memory
    tracing.install(None)


async def _serve_one(redis_url: str, traced_worker: bool) -> tuple[list[int], MicrobatchSpec]:
    """Admit one request, dispatch it, play a worker (a span under the spec's context, when
    ``traced_worker``) that publishes two tokens, and read the request to its end."""
    r = aioredis.Redis.from_url(redis_url)
    backend = PipelineBackend(Settings(), r, n_layers=6)
    backend._ready = True
    events = await backend.generate(GenerationRequest("req-1", (1, 2, 3), SamplingSpec(max_tokens=2)))
    assert await backend._form_and_write()
    (mb_id,) = backend._stream_ids
    spec = MicrobatchSpec.decode(await r.get(keys.microbatch(mb_id)))
    if traced_worker:
        spans = RowSpans.start("dejavu.prompt", spec.rows, {tracing.STAGE: 0}, mb_id=mb_id)
        assert spans is not None
        spans.end()
    writer = await stage_holder(r, backend)
    for step, finish in ((0, None), (1, FinishReason.LENGTH)):
        await publish(r, writer, TokenStep(mb_id=mb_id, step=step, tokens=(40 + step,), finished=(finish,)))
    await backend._relay_once()
    tokens = [t async for ev in events for t in ev.token_ids]
    await r.aclose()
    return tokens, spec


def test_one_request_is_one_trace_from_admission_to_its_last_token(
    redis_url: str, exporter: InMemorySpanExporter
) -> None:
    tokens, spec = asyncio.run(asyncio.wait_for(_serve_one(redis_url, traced_worker=True), 30))
    assert tokens == [40, 41]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"dejavu.request", "dejavu.queue", "dejavu.first_token", "dejavu.prompt"}
    root = spans["dejavu.request"]
    assert root.parent is None
    assert spec.rows[0].traceparent == f"00-{root.context.trace_id:032x}-{root.context.span_id:016x}-01"
    for name in ("dejavu.queue", "dejavu.first_token", "dejavu.prompt"):
        assert spans[name].context.trace_id == root.context.trace_id, name
        assert spans[name].parent is not None and spans[name].parent.span_id == root.context.span_id, name
    # queueing ends at dispatch, where waiting for the first token begins
    assert spans["dejavu.queue"].end_time <= spans["dejavu.first_token"].start_time
    assert [e.name for e in root.events] == ["first_token"]
    assert root.attributes["dejavu.status"] == "finished"
    assert root.attributes["gen_ai.usage.output_tokens"] == 2
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("length",)


def test_untraced_requests_put_no_context_on_the_wire(redis_url: str) -> None:
    tokens, spec = asyncio.run(asyncio.wait_for(_serve_one(redis_url, traced_worker=False), 30))
    assert tokens == [40, 41]
    assert spec.rows[0].traceparent is None


def _topology(epoch: int, holders: list[str]) -> Topology:
    return Topology(
        epoch=epoch,
        mode="disaggregated",
        n_layers=6,
        prompt_stages=(StageAssignment(worker_id="p0", stage=0, layers=(0, 6)),),
        token_stages=tuple(
            StageAssignment(worker_id=w, stage=i, layers=(3 * i, 3 * i + 3)) for i, w in enumerate(holders)
        ),
        prompt_microbatch=4,
        token_microbatch=4,
    )


def test_each_repair_a_request_lives_through_is_on_its_trace(redis_url: str, exporter: InMemorySpanExporter) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        base = Settings()
        settings = base.model_copy(update={"controller": base.controller.model_copy(update={"token_depth": 2})})
        backend = PipelineBackend(settings, r, n_layers=6)
        backend._ready = True

        async def repair_run(topology, replaced, resumable, not_started, redispatch, detected_at, metrics, dropped):
            pass

        backend.repair.run = repair_run
        events = await backend.generate(GenerationRequest("req-1", (1, 2, 3), SamplingSpec(max_tokens=4)))
        (mb,) = backend.scheduler.form(now=1e9)
        for epoch, resumes in ((2, False), (3, True)):
            old, new = _topology(epoch - 1, ["t0", "t1"]), _topology(epoch, ["s0", "t1"])
            backend._start_repair(new, backend._plan_repair(old, new, ["t0"]))
            await backend._repair_task
            if not resumes:  # its first token arrives between the repairs: the second one resumes it
                mb.requests[0].deliver(0, 7, None)
                mb.started_rows.add(0)
        assert (await anext(events)).token_ids == (7,)
        await events.aclose()  # the client goes away
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "dejavu.request"]
    repairs = [dict(e.attributes) for e in root.events if e.name == "repair"]
    assert [(e["dejavu.epoch"], e["dejavu.repair.outcome"], tuple(e["dejavu.repair.stages"])) for e in repairs] == [
        (2, "rerun", (0,)),
        (3, "resume", (0,)),
    ]
    repair_spans = [s for s in spans if s.name == "dejavu.repair"]
    assert [s.attributes["dejavu.epoch"] for s in repair_spans] == [2, 3]
    for span in repair_spans:  # a trace of its own, linked to the request it covers
        assert [link.context.span_id for link in span.links] == [root.context.span_id]
    assert root.attributes["dejavu.status"] == "cancelled"
