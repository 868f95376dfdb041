"""One request's run on the backend, as a stream of text deltas.

:class:`Generation` drives ``backend.generate``: it detokenizes incrementally, applies stop strings,
enforces the request deadline, records latency metrics and, however it ends (finished, stop string,
client gone, error), closes the backend iterator exactly once so the backend frees the slot.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import anyio

from dejavu_common.tokenizer import IncrementalDetokenizer, Tokenizer
from dejavu_controller.backend import Backend, FinishReason, GenerationRequest, Logprob, TokenEvent

from .errors import GatewayTimeoutError, InvalidRequestError, ServerError, ServiceUnavailableError
from .metrics import GatewayMetrics, Outcome

log = logging.getLogger(__name__)

# How long closing the backend iterator may take (it may have to tell a worker to drop the request).
_CLOSE_DEADLINE_S = 10.0


@dataclass(frozen=True)
class TextDelta:
    """New text of a request; ``finish_reason`` is set on the last delta only (STOP or LENGTH). ``token_ids``
    are the tokens behind it (a token whose text is held back, an incomplete character or a possible stop
    string's start, comes with the next delta that carries text), with their log probabilities where the
    request asked (``logprobs``, one per token id); ``prompt_logprobs`` comes with the first delta."""

    text: str
    finish_reason: FinishReason | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprob, ...] = ()
    prompt_logprobs: tuple[Logprob | None, ...] | None = None


@dataclass(frozen=True)
class Completion:
    """The whole answer of a non-streaming request (its tokens and log probabilities as in :class:`TextDelta`)."""

    text: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprob, ...] = ()
    prompt_logprobs: tuple[Logprob | None, ...] | None = None


class Generation:
    """Runs one :class:`GenerationRequest`; single use, driven by one task at a time.

    Call :meth:`start` first: it raises the backend's admission errors (``QueueFullError``,
    ``NotReadyError``) before any response is sent. Then consume :meth:`deltas` (or call
    :meth:`collect`). ``deltas`` ends after the delta carrying the finish reason; an ERROR or
    CANCELLED finish from the backend raises :class:`ServerError` / :class:`ServiceUnavailableError`,
    and a missed deadline :class:`GatewayTimeoutError`. Cancelling the consuming task, or
    :meth:`close`, cancels the request in the backend.
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        request: GenerationRequest,
        timeout_s: float,
    ) -> None:
        self.request = request
        self._backend = backend
        self._metrics = metrics
        self._detokenizer: IncrementalDetokenizer = tokenizer.detokenizer(request.stop)
        self._admitted_at = time.monotonic()
        self._deadline = self._admitted_at + timeout_s
        self._events: AsyncIterator[TokenEvent] | None = None
        self._first: TokenEvent | None = None
        self._last_event_at: float | None = None
        self._outcome: Outcome | None = None
        self.completion_tokens = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def started(self) -> bool:
        return self._first is not None

    async def start(self) -> None:
        """Submit the request and wait for its first event (admission errors propagate). A request the last
        stage refuses (its grammar does not compile) raises :class:`InvalidRequestError` here, before any
        response is sent (a 400)."""
        try:
            events = self._backend.generate(self.request)
            # An ``async def generate`` that returns the iterator raises admission errors when awaited.
            self._events = await events if inspect.isawaitable(events) else events
            self._first = first = await self._next_event()
            if first is not None and first.finish_reason is FinishReason.REFUSED:
                self._first = None
                raise self._refused(first)
        except BaseException:
            await self.close()
            raise
        self._metrics.prompt_tokens.inc(self.prompt_tokens)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Text deltas until the finish; always closes the backend iterator when it ends."""
        if self._first is None:
            raise RuntimeError("Generation.start() must succeed before deltas()")
        try:
            event: TokenEvent | None = self._first
            held = _Held()  # tokens whose text has not been released yet
            while event is not None:
                delta = held.take(self._absorb(event))
                if delta.text or delta.finish_reason is not None:
                    yield delta
                    held = _Held()
                if delta.finish_reason is not None:
                    return
                event = await self._next_event()
            raise ServerError("the backend ended the request without a finish reason", code="backend_protocol")
        except (Exception, asyncio.CancelledError, GeneratorExit) as exc:
            self._finish(
                Outcome.CANCELLED if isinstance(exc, asyncio.CancelledError | GeneratorExit) else Outcome.FAILED
            )
            raise
        finally:
            await self.close()

    async def collect(self) -> Completion:
        """Start (if needed) and gather the whole answer."""
        if self._first is None:
            await self.start()
        parts: list[str] = []
        ids: list[int] = []
        logprobs: list[Logprob] = []
        prompt: tuple[Logprob | None, ...] | None = None
        async for delta in self.deltas():
            parts.append(delta.text)
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
            prompt = prompt if delta.prompt_logprobs is None else delta.prompt_logprobs
            if delta.finish_reason is not None:
                return Completion("".join(parts), delta.finish_reason, tuple(ids), tuple(logprobs), prompt)
        raise ServerError("the request ended without a finish reason", code="backend_protocol")

    async def close(self) -> None:
        """Close the backend iterator (idempotent); cancels the request if it has not finished.

        Shielded, so it also completes while the calling task is being cancelled.
        """
        events, self._events = self._events, None
        if events is None:
            return
        with anyio.move_on_after(_CLOSE_DEADLINE_S, shield=True):
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _next_event(self) -> TokenEvent | None:
        """The backend's next event within the request deadline; ``None`` if the iterator ended."""
        assert self._events is not None
        try:
            async with asyncio.timeout_at(self._loop_deadline()):
                return await anext(self._events)
        except StopAsyncIteration:
            return None
        except TimeoutError as exc:
            raise GatewayTimeoutError("the request ran past its deadline", code="request_timeout") from exc

    def _loop_deadline(self) -> float:
        """``self._deadline`` (time.monotonic) on the event loop's clock."""
        loop = asyncio.get_running_loop()
        return loop.time() + (self._deadline - time.monotonic())

    def _absorb(self, event: TokenEvent) -> TextDelta:
        """Turn one backend event into a delta; records token latencies and the finish."""
        if event.token_ids:  # an empty event (a bare finish) is not a token: no latency sample
            self._record_timing(len(event.token_ids))
        text: list[str] = []
        for i, token_id in enumerate(event.token_ids):
            self.completion_tokens += 1
            text.append(self._detokenizer.push(token_id))
            if self._detokenizer.stopped:  # a stop string: end here, the backend is cancelled on close
                kept = replace(event, token_ids=event.token_ids[: i + 1], logprobs=event.logprobs[: i + 1])
                return self._finished("".join(text), FinishReason.STOP, kept)
        reason = event.finish_reason
        if reason is None:
            return TextDelta("".join(text), None, event.token_ids, event.logprobs, event.prompt_logprobs)
        if reason is FinishReason.ERROR:
            raise ServerError("the serving runtime failed this request", code="generation_failed")
        if reason is FinishReason.CANCELLED:
            raise ServiceUnavailableError("the serving runtime cancelled this request", code="cancelled_by_server")
        if reason is FinishReason.REFUSED:
            raise self._refused(event)
        text.append(self._detokenizer.flush())
        return self._finished("".join(text), reason, event)

    def _refused(self, event: TokenEvent) -> InvalidRequestError:
        grammar = self.request.sampling.grammar
        what = f"{grammar.kind.value} grammar" if grammar is not None else "request"
        reason = event.refusal or "no reason given"
        return InvalidRequestError(f"the grammar engine cannot compile this {what}: {reason}", code="invalid_grammar")

    def _record_timing(self, new_tokens: int) -> None:
        now = time.monotonic()
        if self._last_event_at is None:
            self._metrics.time_to_first_token.observe(now - self._admitted_at)
        else:
            self._metrics.inter_token_latency.observe(now - self._last_event_at)
        self._last_event_at = now
        self._metrics.generated_tokens.inc(new_tokens)

    def _finished(self, text: str, reason: FinishReason, event: TokenEvent) -> TextDelta:
        self._metrics.e2e_latency.observe(time.monotonic() - self._admitted_at)
        self._finish(Outcome.STOP if reason is FinishReason.STOP else Outcome.LENGTH)
        return TextDelta(text, reason, event.token_ids, event.logprobs, event.prompt_logprobs)

    def _finish(self, outcome: Outcome) -> None:
        """Count the request's outcome once (only requests that started are counted here)."""
        if self._outcome is None and self.started:
            self._outcome = outcome
            self._metrics.count_outcome(outcome)


@dataclass
class _Held:
    """Tokens (and log probabilities) of deltas not yet yielded: their text is held back."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: tuple[Logprob | None, ...] | None = None

    def take(self, delta: TextDelta) -> TextDelta:
        """``delta`` with the held tokens before its own (and holds them all, in case it is held back too)."""
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return replace(
            delta, token_ids=tuple(self.token_ids), logprobs=tuple(self.logprobs), prompt_logprobs=self.prompt_logprobs
        )
