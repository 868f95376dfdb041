"""Sampling controls, log probabilities and ``n`` through the official openai client against a real uvicorn
server over the scripted backend (which reports known log probabilities: ``conftest.scripted_logprobs``)."""

from __future__ import annotations

import openai
import pytest

from dejavu_controller.backend import FinishReason

from .conftest import API_KEY, MODEL, REPLY, LiveServer, ScriptedBackend

DEADLINE_S = 30.0


@pytest.fixture
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)


def token_texts(backend: ScriptedBackend, ids: list[int]) -> list[str]:
    return [backend.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_sampling_controls_reach_the_backend(oai: openai.OpenAI, backend: ScriptedBackend):
    oai.completions.create(
        model=MODEL,
        prompt="Tell me",
        max_tokens=20,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": -100, "3": 2.5},
        seed=11,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4, "stop_token_ids": [9, 5], "top_k": 8, "min_p": 0.1},
    )
    spec = backend.requests[0].sampling
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (0.5, -0.25, 1.2)
    assert spec.logit_bias == ((3, 2.5), (7, -100.0))
    assert (spec.min_tokens, spec.stop_token_ids, spec.top_k, spec.min_p, spec.seed) == (4, (9, 5), 8, 0.1, 11)
    assert spec.logprobs is None and spec.prompt_logprobs is None and not spec.raw_logprobs
    oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=1, extra_body={"logprobs_mode": "raw"})
    assert backend.requests[1].sampling.raw_logprobs
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"logprobs_mode": "logits"})


def test_sampling_controls_reach_the_backend_from_a_streamed_chat(oai: openai.OpenAI, backend: ScriptedBackend):
    chunks = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me"}],
        max_tokens=20,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": -100, "3": 2.5},
        seed=11,
        stream=True,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4, "stop_token_ids": [9, 5], "top_k": 8, "min_p": 0.1},
    )
    assert list(chunks)[-1].choices[0].finish_reason is not None
    spec = backend.requests[0].sampling
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (0.5, -0.25, 1.2)
    assert spec.logit_bias == ((3, 2.5), (7, -100.0))
    assert (spec.min_tokens, spec.stop_token_ids, spec.top_k, spec.min_p, spec.seed) == (4, (9, 5), 8, 0.1, 11)


def test_out_of_range_controls_are_openai_400s(oai: openai.OpenAI, backend: ScriptedBackend):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"min_tokens": 4})
    assert caught.value.body["param"] == "min_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logit_bias={"3": 150})
    assert caught.value.body["param"] == "logit_bias"  # type: ignore[index]
    assert backend.requests == []


def test_completion_logprobs(oai: openai.OpenAI, backend: ScriptedBackend):
    completion = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=5, logprobs=2)
    ids = backend.script(backend.requests[0])
    assert backend.requests[0].sampling.logprobs == 2 and backend.requests[0].sampling.prompt_logprobs is None
    lp = completion.choices[0].logprobs
    assert lp is not None
    texts = token_texts(backend, ids)
    assert lp.tokens == texts and "".join(texts) == completion.choices[0].text
    assert lp.token_logprobs == pytest.approx([-(i + 1) / 10 for i in range(5)])
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(5)]
    assert lp.top_logprobs is not None
    for i, top in enumerate(lp.top_logprobs):
        assert top[texts[i]] == pytest.approx(-(i + 1) / 10) and 1 <= len(top) <= 3


def test_streamed_completion_logprobs_equal_the_whole_answer(oai: openai.OpenAI):
    whole = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=12, logprobs=1).choices[0].logprobs
    chunks = list(oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=12, logprobs=1, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert whole is not None
    assert [t for p in parts for t in p.tokens or []] == whole.tokens
    assert [v for p in parts for v in p.token_logprobs or []] == whole.token_logprobs
    assert [o for p in parts for o in p.text_offset or []] == whole.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt(oai: openai.OpenAI, backend: ScriptedBackend):
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs, max_tokens 0.
    prompt = backend.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    for stream in (False, True):
        out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=stream)
        chunks = list(out) if stream else [out]
        choices = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in choices) == backend.tokenizer.decode(prompt, skip_special_tokens=False)
        assert choices[-1].finish_reason == "length"
        logprobs = [c.logprobs for c in choices if c.logprobs is not None]
        tokens = [t for lp in logprobs for t in lp.tokens or []]
        values = [v for lp in logprobs for v in lp.token_logprobs or []]
        assert tokens == token_texts(backend, prompt)  # the prompt only: the sampled token is not reported
        assert values[0] is None and values[1:] == pytest.approx([-p / 10 for p in range(1, len(prompt))])
        assert backend.requests[-1].sampling.prompt_logprobs == 1
    usage = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True).usage
    assert usage is not None and usage.completion_tokens == 0 and usage.prompt_tokens == len(prompt)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_echo_puts_the_prompt_before_the_completion(oai: openai.OpenAI):
    completion = oai.completions.create(model=MODEL, prompt="Tell me. ", max_tokens=3, echo=True, logprobs=0)
    choice = completion.choices[0]
    assert choice.text.startswith("Tell me. ") and len(choice.text) > len("Tell me. ")
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[-3:] == pytest.approx(
        [-0.1, -0.2, -0.3]
    )


def test_chat_logprobs_streamed_and_whole(oai: openai.OpenAI, backend: ScriptedBackend):
    messages = [{"role": "user", "content": "Say hi"}]
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2)
    assert backend.requests[0].sampling.logprobs == 2
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    ids = backend.script(backend.requests[0])
    texts = token_texts(backend, ids)
    assert content is not None and [e.token for e in content] == texts
    assert [e.logprob for e in content] == pytest.approx([-(i + 1) / 10 for i in range(6)])
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2 for e in content)
    assert [e.top_logprobs[0].token for e in content] == texts
    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content or [])  # type: ignore[union-attr]
    assert oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_n_choices_completions(oai: openai.OpenAI, backend: ScriptedBackend):
    completion = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=4, n=3, seed=5, temperature=1)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.text == completion.choices[0].text for c in completion.choices)  # the scripted reply
    seeds = [r.sampling.seed for r in backend.requests]
    assert seeds[0] == 5 and len(set(seeds)) == 3  # each choice its own seed stream; choice 0 is the n=1 request
    assert len({r.request_id for r in backend.requests}) == 3
    usage = completion.usage
    assert (
        usage is not None
        and usage.completion_tokens == 12
        and usage.prompt_tokens == len(backend.requests[0].prompt_token_ids)
    )
    again = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=4, n=3, seed=5, temperature=1)
    assert [r.sampling.seed for r in backend.requests[3:]] == seeds and again.choices[2].index == 2


def test_n_choices_streamed_chat(oai: openai.OpenAI, backend: ScriptedBackend):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        n=2,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    text: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
            if choice.logprobs is not None:
                logprobs[choice.index] += [e.logprob for e in choice.logprobs.content or []]
    assert text == {0: REPLY, 1: REPLY} and finishes == {0: "stop", 1: "stop"}
    n_tokens = len(backend.script(backend.requests[0]))
    assert logprobs[0] == logprobs[1] == pytest.approx([-(i + 1) / 10 for i in range(n_tokens)])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 2 * n_tokens


def test_a_failing_choice_fails_the_request(oai: openai.OpenAI, backend: ScriptedBackend):
    backend.fail_after = 2
    backend.fail_reason = FinishReason.ERROR
    with pytest.raises(openai.InternalServerError):
        oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, n=2)
    stream = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, n=2, stream=True)
    with pytest.raises(openai.APIError):
        list(stream)
    assert backend.active == 0
