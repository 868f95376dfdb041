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
from dejavu_controller.api.tool_calls import Piece, ToolCallReader
from dejavu_controller.api.tools import template_messages, template_tools, tool_grammar
from dejavu_controller.backend import FinishReason

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, gateway: GatewayDep
) -> ChatCompletionResponse | StreamingResponse:
    """Answer a conversation; ``stream: true`` answers with server-sent events. ``n`` choices run as ``n``
    sequences; ``logprobs`` reports each token's log probability (and ``top_logprobs`` likeliest ones').
    With ``tools``, each choice's reply is read into ``tool_calls`` (``dejavu_controller.api.tool_calls``); a
    streamed call comes as OpenAI's deltas (the name, then the arguments' text as it is generated), and a
    choice that calls tools finishes with ``tool_calls`` (the token limit's ``length`` where it cut a call)."""
    check_model(gateway, body.model)
    native_tools = gateway.tokenizer.template_takes_tools
    messages = template_messages(body, native_tools)
    prompt_ids = await encode_chat(gateway, messages, tools=template_tools(body) if native_tools else None)
    top = body.logprobs_top
    base = admit(
        gateway,
        new_request_id("chatcmpl"),
        prompt_ids,
        body,
        body.token_limit,
        "messages",
        top,
        tool_grammar=tool_grammar(body),
    )
    generations = [gateway.generation(r) for r in choice_requests(base, body.n)]
    created = int(time.time())
    texts = TokenTexts(gateway.tokenizer)
    readers = [ToolCallReader(body) for _ in generations]

    def finish_reason(index: int, reason: FinishReason) -> str:
        reader = readers[index]
        return "tool_calls" if reader.calls and not reader.cut else reason.value

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
            reader = readers[index]
            pieces = reader.push(delta.text)
            if delta.finish_reason is not None:
                pieces += reader.finish()
            logprobs = logprobs_of(delta)
            if not pieces and top is not None and delta.token_ids:  # a token whose text is empty or held back
                pieces = [""]
            chunks = []
            for k, piece in enumerate(pieces):  # the delta's logprobs go with its first chunk
                choice = ChatChunkChoice(index=index, delta=_delta(piece), logprobs=logprobs if k == 0 else None)
                chunks.append(chunk([choice]))
            if delta.finish_reason is not None:  # OpenAI ends with an empty delta carrying the reason
                reason = finish_reason(index, delta.finish_reason)
                chunks.append(chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)]))
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
    choices = []
    for index, done in enumerate(completions):
        reader = readers[index]
        pieces = reader.push(done.text) + reader.finish()
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        message = AssistantMessage(
            content=None if reader.calls and not content.strip() else content, tool_calls=reader.calls or None
        )
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=logprobs_of(TextDelta(done.text, done.finish_reason, done.token_ids, done.logprobs)),
                finish_reason=finish_reason(index, done.finish_reason),
            )
        )
    return ChatCompletionResponse(
        id=base.request_id, created=created, model=gateway.model_name, choices=choices, usage=usage()
    )


def _delta(piece: Piece) -> ChatDelta:
    """A piece of a reply as a stream delta: content, or one delta of a tool call."""
    return ChatDelta(content=piece) if isinstance(piece, str) else ChatDelta(tool_calls=[piece])
