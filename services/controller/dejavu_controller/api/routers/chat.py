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
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from dejavu_controller.api.schemas.common import Usage
from dejavu_controller.api.tools import ToolCallReader, template_messages, template_tools, tool_grammar
from dejavu_controller.backend import FinishReason

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, gateway: GatewayDep
) -> ChatCompletionResponse | StreamingResponse:
    """Answer a conversation; ``stream: true`` answers with server-sent events. ``n`` choices run as ``n``
    sequences; ``logprobs`` reports each token's log probability (and ``top_logprobs`` likeliest ones').
    With ``tools``, each choice's reply is read into ``tool_calls`` (``dejavu_controller.api.tools``); a
    streamed call comes whole in one delta, and a choice that calls tools finishes with ``tool_calls``."""
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
        return "tool_calls" if readers[index].calls else reason.value

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
            text, calls = reader.push(delta.text)
            if delta.finish_reason is not None:
                rest, more = reader.finish()
                text, calls = text + rest, calls + more
            chunks = []
            if text or (top is not None and delta.token_ids):  # a token whose text is empty has logprobs
                content = ChatDelta(content=text)
                chunks.append(chunk([ChatChunkChoice(index=index, delta=content, logprobs=logprobs_of(delta))]))
            first = len(reader.calls) - len(calls)
            for k, call in enumerate(calls):
                called = ChatDelta(tool_calls=[_call_delta(first + k, call)])
                chunks.append(chunk([ChatChunkChoice(index=index, delta=called)]))
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
        text, _ = reader.push(done.text)
        rest, _ = reader.finish()
        content = text + rest
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


def _call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    """A whole tool call as one stream delta."""
    return ToolCallDelta(
        index=index, id=call.id, function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments)
    )
