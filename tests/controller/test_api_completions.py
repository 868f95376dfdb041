"""POST /v1/completions through the app (in-process, real tokenizer, scripted backend)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dejavu_common.tokenizer import Tokenizer

from .conftest import MODEL, REPLY, ScriptedBackend, sse_payloads


def test_completion_returns_whole_reply_with_usage(client: TestClient, backend: ScriptedBackend, tokenizer: Tokenizer):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Tell me a story", "max_tokens": 100})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    [choice] = body["choices"]
    assert choice == {"text": REPLY, "index": 0, "logprobs": None, "finish_reason": "stop"}
    prompt_ids = tokenizer.encode("Tell me a story")
    reply_tokens = len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": reply_tokens,
        "total_tokens": len(prompt_ids) + reply_tokens,
    }
    [request] = backend.requests
    assert list(request.prompt_token_ids) == prompt_ids
    assert request.request_id == body["id"]
    assert backend.finished == {body["id"]} and not backend.cancelled


def test_sampling_parameters_reach_the_backend(client: TestClient, backend: ScriptedBackend):
    payload = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 1234,
        "stop": ["zzz", "qqq"],
    }
    assert client.post("/v1/completions", json=payload).status_code == 200
    request = backend.requests[0]
    params = request.sampling
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, request.stop) == (
        7,
        0.5,
        0.9,
        20,
        1234,
        ("zzz", "qqq"),
    )


def test_defaults_follow_openai(client: TestClient, backend: ScriptedBackend):
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "top_k": -1}).status_code == 200
    request = backend.requests[0]
    params = request.sampling
    assert params.max_tokens == 16  # OpenAI's default for completions
    assert (params.temperature, params.top_p, params.top_k, params.seed, request.stop) == (1.0, 1.0, 0, None, ())


def test_max_tokens_cuts_with_finish_reason_length(client: TestClient, tokenizer: Tokenizer):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5}).json()
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == tokenizer.decode(reply_ids[:5])
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("stop", ["42", ["nothing-like-it", "answer"]])
def test_stop_string_ends_the_request_and_cancels_the_backend(
    client: TestClient, backend: ScriptedBackend, stop: str | list[str]
):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stop": stop}).json()
    first = stop if isinstance(stop, str) else stop[1]
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == REPLY[: REPLY.index(first)]
    assert backend.cancelled == {body["id"]}  # the gateway closed the iterator before the backend's finish
    assert backend.active == 0
    assert body["usage"]["completion_tokens"] < len(backend.script(backend.requests[0]))


def test_prompt_as_token_ids(client: TestClient, backend: ScriptedBackend):
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}).status_code == 200
    assert [list(r.prompt_token_ids) for r in backend.requests] == [[5, 6, 7], [5, 6, 7]]


def test_streaming_chunks_concatenate_to_the_reply(client: TestClient, backend: ScriptedBackend):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert len(chunks) > 5  # one chunk per token, not one at the end
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert backend.finished == {chunks[0]["id"]}


def test_streaming_with_usage_and_stop(client: TestClient, backend: ScriptedBackend, tokenizer: Tokenizer):
    payload = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 100,
        "stream": True,
        "stop": "DejaVu",
        "stream_options": {"include_usage": True},
    }
    payloads = sse_payloads(client.post("/v1/completions", json=payload).text)
    assert payloads[-1] == "[DONE]"
    *chunks, usage_chunk = payloads[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY[: REPLY.index("DejaVu")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode("Hi"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert backend.cancelled == {chunks[0]["id"]}
