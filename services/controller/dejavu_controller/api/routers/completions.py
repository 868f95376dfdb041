"""``POST /v1/completions``."""

from __future__ import annotations

import time
from typing import cast

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import dispatch, sse
from dejavu_controller.api.admission import admit, check_model, check_token_ids, encode_text, new_request_id
from dejavu_controller.api.choices import CompletionLogprobsBuilder, TokenTexts, choice_requests
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
)
from dejavu_controller.backend import FinishReason, Logprob

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(
    body: CompletionRequest, request: Request, gateway: GatewayDep
) -> CompletionResponse | StreamingResponse:
    """Complete a prompt (text or token ids); ``stream: true`` answers with server-sent events.

    ``n`` choices run as ``n`` sequences. ``echo`` puts the prompt before each choice's text (with its log
    probabilities when ``logprobs`` is set); ``max_tokens: 0`` (with ``echo``) generates nothing: the
    workers still sample one token, which is not reported, and the finish reason is ``length``.
    """
    check_model(gateway, body.model)
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError(
            "`max_tokens` 0 generates nothing: it is only allowed with `echo`", param="max_tokens"
        )
    if isinstance(body.prompt, str):
        prompt_ids = await encode_text(gateway, body.prompt, "prompt")
        prompt_text = body.prompt
    else:
        prompt_ids = list(cast(list[int], body.prompt))  # the schema's validator leaves text or token ids
        check_token_ids(gateway, prompt_ids, "prompt")
        prompt_text = await anyio.to_thread.run_sync(_decode_all, gateway.tokenizer, prompt_ids) if body.echo else ""
    echo_only = body.max_tokens == 0
    max_tokens = 1 if echo_only else body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    prompt_logprobs = body.logprobs if body.echo else None
    base = admit(
        gateway, new_request_id("cmpl"), prompt_ids, body, max_tokens, "prompt", body.logprobs, prompt_logprobs
    )
    generations = [gateway.generation(r) for r in choice_requests(base, body.n)]
    created = int(time.time())
    texts = TokenTexts(gateway.tokenizer)
    builders = [CompletionLogprobsBuilder(texts) for _ in generations]
    echoed = [False] * len(generations)

    def choice(index: int, delta: TextDelta) -> CompletionChoice | None:
        """Choice ``index``'s part of ``delta`` (the echoed prompt first), or None when it has nothing."""
        text = ""
        ids: list[int] = []
        logprobs: list[Logprob | None] = []
        if body.echo and not echoed[index]:
            echoed[index] = True
            text, ids = prompt_text, list(prompt_ids)
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
        return CompletionChunk(
            id=base.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage
        )

    def usage() -> Usage:
        generated = 0 if echo_only else sum(g.completion_tokens for g in generations)
        return Usage.of(generations[0].prompt_tokens, generated)  # the prompt counts once, as OpenAI counts it

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
    return CompletionResponse(
        id=base.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage()
    )


def _decode_all(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of a prompt given as token ids, special tokens included (what ``echo`` repeats)."""
    return tokenizer.decode(ids, skip_special_tokens=False)
