"""POST /v1/chat/completions: chat template, response and chunk formats."""

from __future__ import annotations

from fastapi.testclient import TestClient

from dejavu_common.tokenizer import Tokenizer

from .conftest import MODEL, REPLY, ScriptedBackend, sse_payloads

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]},
]


def test_chat_applies_the_template_and_answers(client: TestClient, backend: ScriptedBackend, tokenizer: Tokenizer):
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "refusal": None}
    assert choice["finish_reason"] == "stop"
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Say hello."}]
    )
    assert list(backend.requests[0].prompt_token_ids) == expected
    assert body["usage"]["prompt_tokens"] == len(expected)
    # Chat defaults to the room left in the context.
    assert backend.requests[0].sampling.max_tokens == 256 - len(expected)


def test_developer_role_is_a_system_message(client: TestClient, backend: ScriptedBackend, tokenizer: Tokenizer):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code == 200
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, messages[1]])
    assert list(backend.requests[0].prompt_token_ids) == expected


def test_max_completion_tokens_wins_over_max_tokens(client: TestClient, backend: ScriptedBackend):
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3}
    body = client.post("/v1/chat/completions", json=payload).json()
    assert backend.requests[0].sampling.max_tokens == 3
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_chat_stream_has_openai_chunk_shape(client: TestClient, backend: ScriptedBackend):
    payload = {"model": MODEL, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_payloads(client.post("/v1/chat/completions", json=payload).text)
    assert payloads[-1] == "[DONE]"
    *chunks, usage_chunk = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    middle = chunks[1:-1]
    assert all(
        set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None for c in middle
    )
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == REPLY
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(
        backend.script(backend.requests[0])
    )


def test_chat_stream_stop_string(client: TestClient, backend: ScriptedBackend):
    payload = {"model": MODEL, "messages": MESSAGES, "stream": True, "stop": ["speaking"]}
    chunks = sse_payloads(client.post("/v1/chat/completions", json=payload).text)[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == REPLY[: REPLY.index("speaking")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert backend.cancelled == {chunks[0]["id"]} and backend.active == 0
