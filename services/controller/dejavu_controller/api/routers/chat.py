"""``POST /v1/chat/completions``: the prompt is the model's chat template applied to the messages."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dejavu_controller.api import dispatch, sse
from dejavu_controller.api.admission import admit, check_model, encode_chat, new_request_id
from dejavu_controller.api.choices import TokenTexts, chat_logprobs, choice_requests
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
    ChoiceLogprobs,
)
from dejavu_controller.api.schemas.common import Usage

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, gateway: GatewayDep
) -> ChatCompletionResponse | StreamingResponse:
    """Answer a conversation; ``stream: true`` answers with server-sent events. ``n`` choices run as ``n``
    sequences; ``logprobs`` reports each token's log probability (and ``top_logprobs`` likeliest ones')."""
    check_model(gateway, body.model)
    prompt_ids = await encode_chat(gateway, [m.as_template_message() for m in body.messages])
    top = body.logprobs_top
    base = admit(gateway, new_request_id("chatcmpl"), prompt_ids, body, body.token_limit, "messages", top)
    generations = [gateway.generation(r) for r in choice_requests(base, body.n)]
    created = int(time.time())
    texts = TokenTexts(gateway.tokenizer)

    def logprobs_of(delta: TextDelta) -> ChoiceLogprobs | None:
        return chat_logprobs(texts, delta.token_ids, delta.logprobs) if top is not None else None

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=base.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage
        )

    def usage() -> Usage:  # the prompt counts once, as OpenAI counts it
        return Usage.of(generations[0].prompt_tokens, sum(g.completion_tokens for g in generations))

    if body.stream:
        await dispatch.start_all(request, generations)

        def chunks_of(index: int, delta: TextDelta) -> list[ChatCompletionChunk]:
            chunks = []
            if delta.text or (top is not None and delta.token_ids):  # a token whose text is empty has logprobs
                content = ChatDelta(content=delta.text)
                chunks.append(chunk([ChatChunkChoice(index=index, delta=content, logprobs=logprobs_of(delta))]))
            if delta.finish_reason is not None:  # OpenAI ends with an empty delta carrying the reason
                end = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=delta.finish_reason.value)
                chunks.append(chunk([end]))
            return chunks

        opening = [
            chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(len(generations))
        ]
        events = dispatch.event_stream(
            generations, opening, chunks_of, (lambda: chunk([], usage())) if body.include_usage else None
        )

        async def close() -> None:
            await dispatch.close(generations)

        # The background close covers a client gone before the stream's first chunk (the generator never ran).
        return StreamingResponse(
            events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS, background=BackgroundTask(close)
        )

    completions = await dispatch.complete(request, generations)
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=done.text),
            logprobs=logprobs_of(TextDelta(done.text, done.finish_reason, done.token_ids, done.logprobs)),
            finish_reason=done.finish_reason.value,
        )
        for index, done in enumerate(completions)
    ]
    return ChatCompletionResponse(
        id=base.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage()
    )
