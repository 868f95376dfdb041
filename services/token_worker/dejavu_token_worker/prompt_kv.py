"""The prompt KV a token stage receives from the prompt pipeline (disaggregated).

The prompt pipeline streams each layer's KV of a prompt to the token stage holding the layer as it is computed. A
receiver thread per epoch (:func:`receive_prompt_kv`) reads it once the epoch's repair decided what resumes (a
re-run prompt's first layers can arrive before the resume point is read, and releasing the re-run microbatch's stale
cache then would throw those fresh cells away with it) and hands each message addressed to its stage to the stage's
books: a cohort stage's microbatch caches (:func:`cohort_placer`), or a request-scheduled stage's
:class:`~dejavu_token_worker.arrivals.PromptArrivals`, which keep it until the request has blocks. A message that is
not the stage's, or that does not fit, is dropped (logged), and the receiver serves the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dejavu_common import tracing
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.tracing import RowSpans
from dejavu_token_worker.runner import FinishedMicrobatch, StageRunner
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.microbatch import MicrobatchState
from dejavulib.endpoint import Message
from dejavulib.errors import DejaVuLibError, ProtocolError
from dejavulib.streaming import region_of

log = logging.getLogger("dejavu.token_worker")


def receive_prompt_kv(
    endpoint: DataEndpoint,
    stop: threading.Event,
    recovered: threading.Event,
    index: int,
    place: Callable[[Message], None],
) -> None:
    """Hand ``place`` each prompt KV message that reaches token stage ``index``, from when ``recovered`` is set
    until ``stop`` is; one addressed to another stage, or that ``place`` refuses (raising), is dropped (logged)."""
    while not recovered.wait(0.1):
        if stop.is_set():
            return
    while not stop.is_set():
        message = endpoint.recv_message(Channel.KV_PROMPT, timeout_s=0.1)
        if message is None:
            continue
        try:
            if message.header.user != index:
                raise ProtocolError(f"prompt KV for token stage {message.header.user} arrived at stage {index}")
            place(message)
        except (ValueError, KeyError, IndexError, RuntimeError, DeadlineExceeded, DejaVuLibError) as exc:
            log.error("dropped a prompt KV message: %s", exc)


def cohort_placer(runner: StageRunner, index: int) -> Callable[[Message], None]:
    """What places a message into its microbatch's cache on cohort token stage ``index`` (``runner``'s), as it
    arrives; a microbatch that finished already takes nothing. When traced, each microbatch's prompt KV ends a
    ``dejavu.kv_stream`` span once complete (:func:`trace_prompt_kv`)."""
    # When traced, when each microbatch's first prompt KV arrived (time.time_ns()), until it is complete.
    arriving: dict[int, int] | None = {} if tracing.enabled() else None

    def place(message: Message) -> None:
        region = region_of(message.header)
        try:
            state = runner.state(region.microbatch)
        except FinishedMicrobatch:
            return  # late prompt KV of a microbatch that already finished
        if arriving is not None and not state.complete.is_set():
            arriving.setdefault(state.mb_id, time.time_ns())
        state.place(region, message)
        state.add_prompt_cells(region.layers, region.rows)
        if arriving is not None and state.complete.is_set() and state.mb_id in arriving:
            trace_prompt_kv(state, index, arriving.pop(state.mb_id))

    return place


def trace_prompt_kv(state: MicrobatchState, stage: int, first_ns: int) -> None:
    """The ``dejavu.kv_stream`` span of each traced row of ``state``: its prompt KV arriving at this token stage,
    from the first message to the last."""
    attributes = {tracing.STAGE: stage, "dejavu.kv_cells": state.expected_cells}
    spans = RowSpans.start("dejavu.kv_stream", state.spec.rows, attributes, start_ns=first_ns, mb_id=state.mb_id)
    if spans is not None:
        spans.end()
