"""``POST /v1/chat/completions``: the prompt is the model's chat template applied to the messages."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dejavu_controller.api import dispatch, sse
from dejavu_controller.api.admission import admit, check_model, encode_chat, new_request_id
from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.generation import TextDelta
from dejavu_controller.api.schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
)
from dejavu_controller.api.schemas.common import Usage

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, gateway: GatewayDep
) -> ChatCompletionResponse | StreamingResponse:
    """Answer a conversation; ``stream: true`` answers with server-sent events."""
    check_model(gateway, body.model)
    prompt_ids = await encode_chat(gateway, [m.as_template_message() for m in body.messages])
    generation_request = admit(gateway, new_request_id("chatcmpl"), prompt_ids, body, body.token_limit, "messages")
    generation = gateway.generation(generation_request)
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=generation_request.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage
        )

    def usage() -> Usage:
        return Usage.of(generation.prompt_tokens, generation.completion_tokens)

    if body.stream:
        await dispatch.start(request, generation)

        def chunks_of(delta: TextDelta) -> list[ChatCompletionChunk]:
            chunks = [chunk([ChatChunkChoice(delta=ChatDelta(content=delta.text))])] if delta.text else []
            if delta.finish_reason is not None:  # OpenAI ends with an empty delta carrying the reason
                chunks.append(chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=delta.finish_reason.value)]))
            return chunks

        opening = [chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]
        events = dispatch.event_stream(
            generation, opening, chunks_of, (lambda: chunk([], usage())) if body.include_usage else None
        )
        # The background close covers a client gone before the stream's first chunk (the generator never ran).
        return StreamingResponse(
            events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS, background=BackgroundTask(generation.close)
        )

    completion = await dispatch.complete(request, generation)
    return ChatCompletionResponse(
        id=generation_request.request_id,
        created=created,
        model=gateway.model_name,
        choices=[
            ChatChoice(message=AssistantMessage(content=completion.text), finish_reason=completion.finish_reason.value)
        ],
        usage=usage(),
    )
