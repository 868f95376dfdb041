"""The seam between the REST gateway and the serving runtime.

The HTTP layer (``dejavu_controller.api``) validates and tokenizes requests, then talks only to a
:class:`Backend`. The real backend schedules microbatches onto the worker pipelines through
Redis; tests may use an in-process one. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from dejavu_common.messages import FinishReason, Logprob, SamplingSpec

__all__ = [
    "Backend",
    "BackendStats",
    "FinishReason",
    "GenerationRequest",
    "Logprob",
    "NotReadyError",
    "QueueFullError",
    "SamplingSpec",
    "TokenEvent",
]


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request: its sampling spec (the one the workers sample with; its seed is
    drawn at admission where the client gave none) and its stop strings, which the gateway matches on
    the text it streams."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request: the new token ids (usually one), and the finish reason once. Where the
    request asked for log probabilities (``SamplingSpec.logprobs``), ``logprobs`` has one entry per token
    id; ``prompt_logprobs`` (``SamplingSpec.prompt_logprobs``) comes with the first token, one entry per
    prompt position (None for the first). A REFUSED finish says why in ``refusal``."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[Logprob, ...] = ()
    prompt_logprobs: tuple[Logprob | None, ...] | None = None
    refusal: str | None = None


@dataclass
class BackendStats:
    queue_depth: int = 0
    workers: dict[str, str] = field(default_factory=dict)  # worker id -> state
    kv_held: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker id -> (KV bytes, microbatches)
    # How long dispatched requests have had no token and no error while the pipeline is up, once that is
    # past the controller's stall limit (None: not stalled; see ``dejavu_controller.progress``).
    stalled_s: float | None = None


class QueueFullError(Exception):
    """The admission queue is at its bound; the API answers 503 with Retry-After."""

    def __init__(self, retry_after_s: float = 1.0) -> None:
        super().__init__("the request queue is full")
        self.retry_after_s = retry_after_s


class NotReadyError(Exception):
    """No complete pipeline is registered; the API answers 503."""


class Backend(Protocol):
    """What the gateway needs from the serving runtime.

    ``await generate(request)`` admits the request (raising :class:`QueueFullError` or
    :class:`NotReadyError` at once) and returns an iterator of the request's events in order, each
    token exactly once, ending with an event whose ``finish_reason`` is set. Stop strings are the
    caller's business (they need text); the caller ends a request early by closing the iterator
    (``aclose``), which cancels it and frees its slot.
    """

    def is_ready(self) -> bool: ...

    def stats(self) -> BackendStats: ...

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...
