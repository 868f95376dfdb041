"""A request's life inside the controller; the request owns its state."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from dejavu_common.messages import Logprob, RowSpec, SamplingSpec
from dejavu_controller.backend import FinishReason, TokenEvent
from dejavu_controller.request_trace import RequestTrace


class RequestStatus(str, enum.Enum):
    QUEUED = "queued"  # admitted, waiting for a microbatch
    SCHEDULED = "scheduled"  # part of a microbatch sent to the prompt pipeline (back to QUEUED if its write failed)
    DECODING = "decoding"  # first token seen
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


_LEGAL: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: frozenset({RequestStatus.SCHEDULED, RequestStatus.CANCELLED, RequestStatus.FAILED}),
    RequestStatus.SCHEDULED: frozenset(
        {
            RequestStatus.QUEUED,
            RequestStatus.DECODING,
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        }
    ),
    RequestStatus.DECODING: frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED}),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.CANCELLED: frozenset(),
    RequestStatus.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Request:
    """One generation request: its tokens, status, and where its KV lives (microbatch and row)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.QUEUED
    output_ids: list[int] = field(default_factory=list)
    mb_id: int | None = None
    row: int | None = None
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    last_step: int = -1  # the newest step delivered: steps <= last_step are duplicates
    diverged_at: int | None = None  # the step where a re-run's token differed from the one delivered
    trace: RequestTrace | None = field(default=None, repr=False)  # its spans, when traced (request_trace)

    @property
    def done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)

    def transition(self, new: RequestStatus) -> None:
        if new not in _LEGAL[self.status]:
            raise IllegalTransition(f"request {self.request_id}: {self.status.value} -> {new.value}")
        self.status = new

    def unschedule(self) -> None:
        """Back to the queue: its microbatch was never written to Redis, so no worker ever saw it."""
        self.transition(RequestStatus.QUEUED)
        self.mb_id = self.row = None

    def row_spec(self) -> RowSpec:
        traceparent = self.trace.traceparent if self.trace is not None else None
        return RowSpec(
            request_id=self.request_id, prompt_ids=self.prompt_ids, sampling=self.sampling, traceparent=traceparent
        )

    def deliver(
        self,
        step: int,
        token: int,
        finish: FinishReason | None,
        logprob: Logprob | None = None,
        prompt_logprobs: tuple[Logprob | None, ...] | None = None,
        refusal: str | None = None,
    ) -> bool:
        """Record step ``step``'s token (with its log probabilities, and the prompt's, where the request
        asked; with why it was refused, for a REFUSED finish) once; returns False for a duplicate (a resumed
        step). An error finish is never a duplicate:
        a microbatch re-run or resumed behind its last delivered step can still fail there (at its prompt,
        step 0), and its request must then fail, not wait.

        A duplicate whose token differs from the one delivered at that step comes from a re-run that did not
        reproduce what the client already has (regenerated from its prompt after its replicas were lost): the
        request fails there (:attr:`diverged_at`; returns True), so an answer is never spliced from two runs."""
        if self.done:
            return False
        if step <= self.last_step and not (finish is FinishReason.ERROR and token < 0):
            if token >= 0 and step < len(self.output_ids) and self.output_ids[step] != token:
                self.diverged_at = step
                self.fail()
                return True
            return False
        if token < 0 and finish is None:
            return False  # this entry carries nothing for this row (another prompt piece, or already done)
        self.last_step = max(self.last_step, step)
        if self.status is RequestStatus.SCHEDULED:
            self.transition(RequestStatus.DECODING)
        ids: tuple[int, ...] = ()
        logprobs: tuple[Logprob, ...] = ()
        if token >= 0:
            self.output_ids.append(token)
            ids = (token,)
            logprobs = (logprob,) if logprob is not None else ()
        if finish is not None:
            self.transition(RequestStatus.FAILED if finish is FinishReason.ERROR else RequestStatus.FINISHED)
        self.events.put_nowait(TokenEvent(ids, finish, logprobs, prompt_logprobs if token >= 0 else None, refusal))
        return True

    def fail(self) -> None:
        if not self.done:
            self.transition(RequestStatus.FAILED)
            self.events.put_nowait(TokenEvent(token_ids=(), finish_reason=FinishReason.ERROR))
