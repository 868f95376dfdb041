"""Request traces: OpenTelemetry spans of a request across the controller and the workers.

The controller opens one span per request (``dejavu.request``) and hands its W3C ``traceparent`` to the
workers in the request's row of the microbatch spec (``RowSpec.traceparent``); every worker span of that
row is a child of it, so one request is one trace across processes. Spans are per request and stage, never
per token or per pass, and are made where a request changes phase (admitted, dispatched, prompt computed,
KV arrived, decoding ended), so the per-pass path only checks a ``None``.

Off unless ``tracing.otlp_endpoint`` or ``tracing.file`` is set (:func:`configure`): nothing of the SDK is
imported, :func:`enabled` is False, and :func:`start` returns the API's no-op span. On, each process has its
own service name and a batch span processor that exports from a background thread (OTLP over HTTP, and/or
JSON lines appended to a file). Tests install the SDK's in-memory exporter with :func:`install`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from dejavu_common.messages import RowSpec
    from dejavu_common.settings import TracingSettings

log = logging.getLogger("dejavu.tracing")

#: The instrumentation scope of every DejaVu span.
SCOPE = "dejavu"
#: Attribute names shared by the processes.
REQUEST_ID = "dejavu.request_id"
MICROBATCH = "dejavu.microbatch"
ROW = "dejavu.row"
STAGE = "dejavu.stage"

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # set while tracing is on in this process
_provider: TracerProvider | None = None


def enabled() -> bool:
    """Whether this process records spans (an exporter is configured or a test installed one)."""
    return _tracer is not None


def configure(settings: TracingSettings, service: str, instance: str | None = None) -> bool:
    """Turn tracing on in this process as ``settings`` say, under ``settings.service_name`` or ``service``
    (``instance``: the worker id, as ``service.instance.id``); returns whether it is on. With no exporter
    set, nothing is imported or installed. Sampling follows the parent's decision, and roots (the
    controller's request spans) are sampled at ``sample_ratio``."""
    if not settings.enabled:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes = {"service.name": settings.service_name or service}
    if instance is not None:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(
        resource=Resource.create(attributes), sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio))
    )
    if settings.otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    if settings.file is not None:
        exporter = cast("SpanExporter", JsonLinesExporter(settings.file))  # its interface, without the SDK at import
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    install(provider)
    log.info("tracing on: service %s, exporting to %s", attributes["service.name"],
             " and ".join(str(t) for t in (settings.otlp_endpoint, settings.file) if t is not None))  # fmt: skip
    return True


def install(provider: TracerProvider | None) -> None:
    """Record spans through ``provider`` in this process (None: tracing off again). The test hook: a provider
    with the SDK's in-memory exporter collects what this process records."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer(SCOPE) if provider is not None else None


def shutdown() -> None:
    """Export what is still buffered and stop (at the end of the process; the SDK also does it at exit)."""
    if _provider is not None:
        _provider.shutdown()
    install(None)


def start(
    name: str,
    parent: str | Span | None = None,
    attributes: Mapping[str, Any] | None = None,
    start_ns: int | None = None,
    links: Sequence[SpanContext] = (),
) -> Span:
    """A new span ``name``, child of ``parent`` (a span, or a W3C traceparent from a message; None: a root),
    started at ``start_ns`` (``time.time_ns()``; None: now). Off, or under a traceparent that does not parse,
    the no-op span (whose methods do nothing)."""
    if _tracer is None:
        return INVALID_SPAN
    if isinstance(parent, str):
        context = _PROPAGATOR.extract({"traceparent": parent})
        if not trace.get_current_span(context).get_span_context().is_valid:
            return INVALID_SPAN  # a malformed context: the worker's part is not traced
    elif parent is not None:
        context = trace.set_span_in_context(parent)
    else:
        context = None
    return _tracer.start_span(name, context, attributes=attributes, links=[Link(c) for c in links], start_time=start_ns)


def traceparent(span: Span) -> str | None:
    """The W3C traceparent of ``span`` for a message (None for the no-op span: nothing to continue)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags & TraceFlags.SAMPLED):02x}"


class RowSpans:
    """One open span per traced row of a microbatch (a request's part of a phase on this process), ended
    row by row or all at once; ending is idempotent."""

    def __init__(self, spans: dict[int, Span]) -> None:
        self.spans = spans

    @classmethod
    def start(
        cls,
        name: str,
        rows: Sequence[RowSpec],
        attributes: Mapping[str, Any] | None = None,
        only: Iterable[int] | None = None,
        start_ns: int | None = None,
        mb_id: int | None = None,
    ) -> RowSpans | None:
        """Spans ``name`` for ``rows`` (indices ``only``, or all), each a child of its row's traceparent, with
        the request id, and the microbatch and row when ``rows`` are microbatch ``mb_id``'s; None when tracing
        is off or no row is traced (callers keep None: nothing to do per pass)."""
        if _tracer is None:
            return None
        spans: dict[int, Span] = {}
        for r in range(len(rows)) if only is None else only:
            row = rows[r]
            if row.traceparent is None:
                continue
            own = (
                {REQUEST_ID: row.request_id}
                if mb_id is None
                else {REQUEST_ID: row.request_id, MICROBATCH: mb_id, ROW: r}
            )
            span = start(name, row.traceparent, own, start_ns)
            if span.is_recording():
                if attributes:
                    span.set_attributes(attributes)
                spans[r] = span
        return cls(spans) if spans else None

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        for span in self.spans.values():
            span.add_event(name, attributes)

    def end(self, rows: Iterable[int] | None = None, attributes: Mapping[str, Any] | None = None) -> None:
        """End the spans of ``rows`` (None: every one still open), with ``attributes`` set first."""
        for r in list(self.spans) if rows is None else [r for r in rows if r in self.spans]:
            span = self.spans.pop(r)
            if attributes:
                span.set_attributes(attributes)
            span.end()

    def end_except(self, live: Iterable[int], attributes: Mapping[str, Any] | None = None) -> None:
        """End the spans of the rows not in ``live`` (they finished)."""
        keep = set(live)
        self.end([r for r in self.spans if r not in keep], attributes)

    def fail(self, error: BaseException | str) -> None:
        """End every open span with an error status."""
        for span in self.spans.values():
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        self.end()


class JsonLinesExporter:
    """A span exporter appending each finished span as one line of the SDK's span JSON to ``path`` (one
    ``write`` per batch on a file opened for appending, so processes sharing the file do not interleave
    lines). For tests and debugging."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(json.loads(s.to_json(indent=None)), separators=(",", ":")) + "\n" for s in spans)
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, lines.encode())
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("could not write %d spans to %s: %s", len(spans), self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
