"""A request's events carry the log probabilities its token stream carries, each step once: a step re-executed
after a recovery (a duplicate) is dropped with its numbers, so the client sees what was computed first."""

from __future__ import annotations

from dejavu_common.messages import Logprob, SamplingSpec
from dejavu_controller.backend import FinishReason
from dejavu_controller.request import Request, RequestStatus


def test_deliver_carries_log_probabilities_once_per_step() -> None:
    req = Request("r", (1, 2, 3), SamplingSpec(max_tokens=3, logprobs=1, prompt_logprobs=0, seed=1))
    req.transition(RequestStatus.SCHEDULED)
    first = Logprob(logprob=-0.25, top=((7, -0.25),))
    prompt = (None, Logprob(logprob=-1.5), Logprob(logprob=-2.5))
    assert req.deliver(0, 7, None, first, prompt)
    assert not req.deliver(0, 7, None, Logprob(logprob=-0.3), prompt)  # a resumed duplicate
    assert req.deliver(1, 8, FinishReason.LENGTH, Logprob(logprob=-0.5))
    events = [req.events.get_nowait() for _ in range(req.events.qsize())]
    assert [e.token_ids for e in events] == [(7,), (8,)]
    assert [e.logprobs for e in events] == [(first,), (Logprob(logprob=-0.5),)]
    assert events[0].prompt_logprobs == prompt and events[1].prompt_logprobs is None
    assert events[1].finish_reason is FinishReason.LENGTH


def test_a_finish_without_a_token_carries_no_log_probabilities() -> None:
    req = Request("r", (1,), SamplingSpec(max_tokens=3, logprobs=1, seed=1))
    req.transition(RequestStatus.SCHEDULED)
    assert req.deliver(0, -1, FinishReason.ERROR, None, None)
    event = req.events.get_nowait()
    assert event.token_ids == () and event.logprobs == () and event.prompt_logprobs is None
