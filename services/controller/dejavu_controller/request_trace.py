"""The spans of one request at the controller (``dejavu_common.tracing``).

- ``dejavu.request``: admission to the end (finished, failed or cancelled); the root of the request's
  trace, whose context travels to the workers in the request's row (``RowSpec.traceparent``). An event
  ``first_token`` marks the first token's arrival, an event ``repair`` each repair the request lived through.
- ``dejavu.queue``: admission to dispatch (its microbatch written to Redis).
- ``dejavu.first_token``: dispatch to the first token's arrival at the controller (the prompt pipeline's
  part, KV stream included).

Repairs have a span of their own (``dejavu.repair``, see :func:`start_repair`), linked to every request
it covers. Made only when tracing is on and the request is sampled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from opentelemetry.trace import Span, Status, StatusCode

from dejavu_common import tracing
from dejavu_common.messages import FinishReason, SamplingSpec


class RequestTrace:
    """The open spans of one traced request; every method is cheap and idempotent where it ends a span."""

    def __init__(self, root: Span) -> None:
        self.root = root
        self.traceparent = tracing.traceparent(root)
        self.queue: Span | None = tracing.start("dejavu.queue", root)
        self.first_token: Span | None = None
        self.finish: FinishReason | None = None

    @classmethod
    def start(cls, request_id: str, prompt_tokens: int, sampling: SamplingSpec) -> RequestTrace | None:
        """The trace of a request being admitted; None when tracing is off or the request is not sampled."""
        if not tracing.enabled():
            return None
        root = tracing.start(
            "dejavu.request",
            attributes={
                tracing.REQUEST_ID: request_id,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.usage.input_tokens": prompt_tokens,
            },
        )
        return cls(root) if root.is_recording() else None

    def dispatched(self, mb_id: int, row: int | None, epoch: int) -> None:
        """Its microbatch is written (the first time: a re-run after a repair is the repair's event)."""
        if self.queue is None:
            return
        self.root.set_attributes({tracing.MICROBATCH: mb_id, tracing.ROW: row if row is not None else -1})
        self.queue.end()
        self.queue = None
        self.first_token = tracing.start("dejavu.first_token", self.root, {"dejavu.epoch": epoch})

    def delivered(self, step: int, finish: FinishReason | None) -> None:
        """A step's token (or finish) reached the request."""
        if finish is not None:
            self.finish = finish
        if self.first_token is not None:
            self.first_token.end()
            self.first_token = None
            self.root.add_event("first_token", {"dejavu.step": step})

    def repaired(self, epoch: int, outcome: str, replaced: Iterable[int]) -> None:
        """A repair at ``epoch`` covers the request: ``outcome`` is resume, rerun or dropped."""
        self.root.add_event(
            "repair", {"dejavu.epoch": epoch, "dejavu.repair.outcome": outcome, "dejavu.repair.stages": list(replaced)}
        )

    def ended(self, status: str, output_tokens: int) -> None:
        """The request is over (``status``: its final status); ends every span still open."""
        for span in (self.queue, self.first_token):
            if span is not None:
                span.end()
        self.queue = self.first_token = None
        self.root.set_attributes({"dejavu.status": status, "gen_ai.usage.output_tokens": output_tokens})
        if self.finish is not None:
            self.root.set_attribute("gen_ai.response.finish_reasons", [self.finish.value])
        if status in ("failed", "refused"):
            self.root.set_status(Status(StatusCode.ERROR, "the request failed"))
        self.root.end()


def start_repair(epoch: int, replaced: dict[int, str], traces: Iterable[RequestTrace]) -> Span:
    """The span of one repair (detection to its end), linked to the request spans it covers (the no-op span
    when tracing is off)."""
    if not tracing.enabled():
        return tracing.start("dejavu.repair")
    links = [t.root.get_span_context() for t in traces]
    return tracing.start(
        "dejavu.repair",
        attributes={"dejavu.epoch": epoch, "dejavu.repair.stages": sorted(replaced)},
        links=links,
    )


def end_repair(span: Span, task: asyncio.Task) -> None:
    """Done callback of a repair's task: end its span (an error status when the repair failed)."""
    if not task.cancelled() and task.exception() is not None:
        span.set_status(Status(StatusCode.ERROR, repr(task.exception())))
    elif task.cancelled():
        span.set_attribute("dejavu.repair.cancelled", True)
    span.end()
