"""``POST /v1/completions``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dejavu_controller.api import dispatch, sse
from dejavu_controller.api.admission import admit, check_model, check_token_ids, encode_text, new_request_id
from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.generation import TextDelta
from dejavu_controller.api.schemas.common import Usage
from dejavu_controller.api.schemas.completion import (
    DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(
    body: CompletionRequest, request: Request, gateway: GatewayDep
) -> CompletionResponse | StreamingResponse:
    """Complete a prompt (text or token ids); ``stream: true`` answers with server-sent events."""
    check_model(gateway, body.model)
    if isinstance(body.prompt, str):
        prompt_ids = await encode_text(gateway, body.prompt, "prompt")
    else:
        prompt_ids = list(body.prompt)
        check_token_ids(gateway, prompt_ids, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    generation_request = admit(gateway, new_request_id("cmpl"), prompt_ids, body, max_tokens, "prompt")
    generation = gateway.generation(generation_request)
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
        return CompletionChunk(
            id=generation_request.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage
        )

    def usage() -> Usage:
        return Usage.of(generation.prompt_tokens, generation.completion_tokens)

    if body.stream:
        await dispatch.start(request, generation)

        def chunks_of(delta: TextDelta) -> list[CompletionChunk]:
            reason = delta.finish_reason.value if delta.finish_reason is not None else None
            return [chunk([CompletionChoice(text=delta.text, finish_reason=reason)])]

        events = dispatch.event_stream(
            generation, (), chunks_of, (lambda: chunk([], usage())) if body.include_usage else None
        )
        # The background close covers a client gone before the stream's first chunk (the generator never ran).
        return StreamingResponse(
            events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS, background=BackgroundTask(generation.close)
        )

    completion = await dispatch.complete(request, generation)
    return CompletionResponse(
        id=generation_request.request_id,
        created=created,
        model=gateway.model_name,
        choices=[CompletionChoice(text=completion.text, finish_reason=completion.finish_reason.value)],
        usage=usage(),
    )
