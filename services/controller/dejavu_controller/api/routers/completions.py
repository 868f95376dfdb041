"""``POST /v1/completions``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import dispatch, sse
from dejavu_controller.api.admission import admit, check_model, check_token_ids, encode_text, new_request_id
from dejavu_controller.api.choices import CompletionLogprobsBuilder, TokenTexts, batch_requests
from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.errors import InvalidRequestError
from dejavu_controller.api.generation import TextDelta
from dejavu_controller.api.schemas.common import Usage
from dejavu_controller.api.schemas.completion import (
    DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OnePrompt,
    prompt_param,
)
from dejavu_controller.api.state import Gateway
from dejavu_controller.backend import FinishReason, GenerationRequest, Logprob

router = APIRouter(tags=["completions"])


@dataclass(frozen=True)
class _Prompt:
    """One prompt of the request: its token ids and the text ``echo`` repeats (empty without ``echo`` for
    a prompt given as token ids)."""

    token_ids: list[int]
    text: str


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(
    body: CompletionRequest, request: Request, gateway: GatewayDep
) -> CompletionResponse | StreamingResponse:
    """Complete a prompt (text or token ids), or a batch of them; ``stream: true`` answers with server-sent
    events.

    Each prompt's ``n`` choices run as ``n`` sequences; prompt ``i``'s choice ``j`` has index ``i * n + j``,
    and every choice is admitted before any answer is sent (a refused one fails the whole request). A prompt
    the server cannot run fails the whole request (400) before anything runs. ``echo`` puts the choice's
    prompt before its text (with its log probabilities when ``logprobs`` is set); ``max_tokens: 0`` (with
    ``echo``) generates nothing: the workers still sample one token, which is not reported, and the finish
    reason is ``length``. Usage counts each prompt's tokens once, whatever ``n``.
    """
    check_model(gateway, body.model)
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError(
            "`max_tokens` 0 generates nothing: it is only allowed with `echo`", param="max_tokens"
        )
    echo_only = body.max_tokens == 0
    max_tokens = 1 if echo_only else body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    prompt_logprobs = body.logprobs if body.echo else None
    request_id = new_request_id("cmpl")
    prompts, requests = await _admit_all(gateway, body, request_id, max_tokens, prompt_logprobs)
    generations = [gateway.generation(r) for r in batch_requests(requests, body.n)]
    created = int(time.time())
    texts = TokenTexts(gateway.tokenizer)
    builders = [CompletionLogprobsBuilder(texts) for _ in generations]
    echoed = [False] * len(generations)

    def choice(index: int, delta: TextDelta) -> CompletionChoice | None:
        """Choice ``index``'s part of ``delta`` (its prompt echoed first), or None when it has nothing."""
        text = ""
        ids: list[int] = []
        logprobs: list[Logprob | None] = []
        if body.echo and not echoed[index]:
            echoed[index] = True
            prompt = prompts[index // body.n]
            text, ids = prompt.text, list(prompt.token_ids)
            logprobs = list(delta.prompt_logprobs or ())
        if not echo_only:
            text += delta.text
            ids += delta.token_ids
            logprobs += delta.logprobs
        reason = delta.finish_reason
        if reason is not None and echo_only:
            reason = FinishReason.LENGTH
        entries: CompletionLogprobs | None = None
        if body.logprobs is not None:
            entries = builders[index].build(ids, logprobs)
        if not text and not ids and reason is None:
            return None
        return CompletionChoice(
            text=text, index=index, logprobs=entries, finish_reason=reason.value if reason is not None else None
        )

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
        return CompletionChunk(id=request_id, created=created, model=gateway.model_name, choices=choices, usage=usage)

    def usage() -> Usage:
        generated = 0 if echo_only else sum(g.completion_tokens for g in generations)
        # Each prompt counts once, whatever ``n``, as OpenAI and vLLM count it.
        return Usage.of(sum(len(p.token_ids) for p in prompts), generated)

    if body.stream:
        await dispatch.start_all(request, generations)

        def chunks_of(index: int, delta: TextDelta) -> list[CompletionChunk]:
            part = choice(index, delta)
            return [chunk([part])] if part is not None else []

        events = dispatch.event_stream(
            generations, (), chunks_of, (lambda: chunk([], usage())) if body.include_usage else None
        )

        async def close() -> None:
            await dispatch.close(generations)

        # The background close covers a client gone before the stream's first chunk (the generator never ran).
        return StreamingResponse(
            events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS, background=BackgroundTask(close)
        )

    completions = await dispatch.complete(request, generations)
    choices = []
    for index, done in enumerate(completions):
        whole = TextDelta(done.text, done.finish_reason, done.token_ids, done.logprobs, done.prompt_logprobs)
        part = choice(index, whole)
        assert part is not None  # a finished choice always has its finish reason
        choices.append(part)
    return CompletionResponse(id=request_id, created=created, model=gateway.model_name, choices=choices, usage=usage())


async def _admit_all(
    gateway: Gateway, body: CompletionRequest, request_id: str, max_tokens: int, prompt_logprobs: int | None
) -> tuple[list[_Prompt], list[GenerationRequest]]:
    """Every prompt of ``body`` and its backend request (:func:`admit`, under ``request_id``), in order. The
    first prompt that cannot run raises its 400, naming it; nothing has reached the backend then."""
    count = len(body.prompts)
    prompts: list[_Prompt] = []
    requests: list[GenerationRequest] = []
    for index, given in enumerate(body.prompts):
        param = prompt_param(index, count)
        with _naming(param, count):
            prompt = await _prepare(gateway, given, param, body.echo)
            requests.append(
                admit(gateway, request_id, prompt.token_ids, body, max_tokens, param, body.logprobs, prompt_logprobs)
            )
        prompts.append(prompt)
    return prompts, requests


async def _prepare(gateway: Gateway, prompt: OnePrompt, param: str, echo: bool) -> _Prompt:
    """The token ids of ``prompt`` (400 for a text too long or an id outside the vocabulary, naming
    ``param``) and the text ``echo`` repeats."""
    if isinstance(prompt, str):
        return _Prompt(await encode_text(gateway, prompt, param), prompt)
    check_token_ids(gateway, prompt, param)
    text = await anyio.to_thread.run_sync(_decode_all, gateway.tokenizer, prompt) if echo else ""
    return _Prompt(list(prompt), text)


@contextmanager
def _naming(param: str, count: int) -> Iterator[None]:
    """Prefix the message of a 400 raised inside with ``param`` (``prompt[3]: ...``) when the request has
    several prompts, so the client learns which one failed whatever field the error names."""
    try:
        yield
    except InvalidRequestError as exc:
        if count == 1:
            raise
        raise InvalidRequestError(f"{param}: {exc.message}", param=exc.param, code=exc.code) from exc


def _decode_all(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of a prompt given as token ids, special tokens included (what ``echo`` repeats)."""
    return tokenizer.decode(ids, skip_special_tokens=False)
