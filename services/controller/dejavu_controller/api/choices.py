"""What the endpoints share about a request's choices: one backend request per choice (``n`` of each prompt
of a completions batch), and the log probabilities of their tokens in OpenAI's two shapes (legacy
completions, chat)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import lru_cache

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.backend import GenerationRequest, Logprob

from .errors import ServerError
from .schemas.chat import ChoiceLogprobs, TokenLogprob, TopLogprob
from .schemas.completion import CompletionLogprobs


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The backend requests of ``n`` choices of ``request``: each its own sequence (its own row and KV),
    with its own seed stream (:meth:`SamplingSpec.for_choice`); one choice is ``request`` itself."""
    if n == 1:
        return [request]
    return [
        dataclasses.replace(request, request_id=f"{request.request_id}-{i}", sampling=request.sampling.for_choice(i))
        for i in range(n)
    ]


def batch_requests(prompts: Sequence[GenerationRequest], n: int) -> list[GenerationRequest]:
    """The backend requests of ``n`` choices of each of ``prompts`` (the requests of one HTTP request's
    prompts, under its request id), in choice order: prompt ``i``'s choice ``j`` is choice ``i * n + j``, with
    the request id ``<id>-<choice>`` and choice ``j``'s seed stream, so each prompt samples as it would alone;
    one prompt's are :func:`choice_requests`."""
    if len(prompts) == 1:
        return choice_requests(prompts[0], n)
    return [
        dataclasses.replace(
            prompt, request_id=f"{prompt.request_id}-{i * n + j}", sampling=prompt.sampling.for_choice(j)
        )
        for i, prompt in enumerate(prompts)
        for j in range(n)
    ]


class TokenTexts:
    """Each token's own text, as log probabilities name it (special tokens included; a token that is part of
    a character decodes to U+FFFD, as in vLLM), cached per token id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._text = lru_cache(maxsize=65_536)(lambda token: tokenizer.decode([token], skip_special_tokens=False))

    def __call__(self, token: int) -> str:
        return self._text(token)


def _paired(token_ids: Sequence[int], logprobs: Sequence[Logprob | None]) -> zip[tuple[int, Logprob | None]]:
    if len(token_ids) != len(logprobs):
        raise ServerError("the backend returned tokens without their log probabilities", code="backend_protocol")
    return zip(token_ids, logprobs, strict=True)


class CompletionLogprobsBuilder:
    """Builds one choice's legacy ``logprobs`` objects, chunk by chunk: ``text_offset`` counts on from the
    tokens already reported (from the start of the choice's text, the echoed prompt included)."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0

    def build(self, token_ids: Sequence[int], logprobs: Sequence[Logprob | None]) -> CompletionLogprobs:
        """Entries of ``token_ids``; a None log probability (the prompt's first token) reports None."""
        out = CompletionLogprobs()
        for token, lp in _paired(token_ids, logprobs):
            text = self._texts(token)
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            self._offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(lp.logprob)
            top = {self._texts(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)  # the chosen token is always reported (OpenAI: up to logprobs + 1)
            out.top_logprobs.append(top)
        return out


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[Logprob | None]) -> ChoiceLogprobs:
    """Chat's ``logprobs`` of ``token_ids``: per token its text, bytes, log probability and the likeliest
    tokens' (``top_logprobs`` of them)."""

    def top(token: int, value: float) -> TopLogprob:
        text = texts(token)
        return TopLogprob(token=text, logprob=value, bytes=list(text.encode()))

    content = []
    for token, lp in _paired(token_ids, logprobs):
        if lp is None:
            raise ServerError("the backend returned a token without its log probability", code="backend_protocol")
        entry = top(token, lp.logprob)
        content.append(TokenLogprob(**entry.model_dump(), top_logprobs=[top(t, v) for t, v in lp.top]))
    return ChoiceLogprobs(content=content)
