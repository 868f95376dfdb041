"""Bad input, overload and runtime failures: status codes and OpenAI-style error bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import create_app
from dejavu_controller.backend import FinishReason

from .conftest import API_KEY, MODEL, EagerBackend, ScriptedBackend, make_settings, sse_payloads

CHAT = [{"role": "user", "content": "Hi"}]


def assert_error(response: Any, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    [
        ({"model": "gpt-4", "prompt": "Hi"}, "model", "model_not_found"),
        ({"prompt": "Hi"}, "model", None),
        ({"model": MODEL}, "prompt", None),
        ({"model": MODEL, "prompt": ""}, "prompt", None),
        ({"model": MODEL, "prompt": []}, "prompt", None),
        ({"model": MODEL, "prompt": [1, -2]}, "prompt", None),
        ({"model": MODEL, "prompt": [1, 10**6]}, "prompt", None),
        ({"model": MODEL, "prompt": "Hi", "max_tokens": 0}, "max_tokens", None),
        ({"model": MODEL, "prompt": "Hi", "max_tokens": -3}, "max_tokens", None),
        ({"model": MODEL, "prompt": "Hi", "max_tokens": 256}, "max_tokens", "context_length_exceeded"),
        ({"model": MODEL, "prompt": "word " * 300}, "prompt", "context_length_exceeded"),
        ({"model": MODEL, "prompt": "Hi", "n": 0}, "n", None),
        ({"model": MODEL, "prompt": "Hi", "n": 17}, "n", None),
        ({"model": MODEL, "prompt": "Hi", "temperature": -0.1}, "temperature", None),
        ({"model": MODEL, "prompt": "Hi", "temperature": 2.5}, "temperature", None),
        ({"model": MODEL, "prompt": "Hi", "top_p": 0}, "top_p", None),
        ({"model": MODEL, "prompt": "Hi", "top_p": 1.5}, "top_p", None),
        ({"model": MODEL, "prompt": "Hi", "top_k": -2}, "top_k", None),
        ({"model": MODEL, "prompt": "Hi", "logprobs": 21}, "logprobs", None),
        ({"model": MODEL, "prompt": "Hi", "logprobs": -1}, "logprobs", None),
        ({"model": MODEL, "prompt": "Hi", "best_of": 3}, "best_of", None),
        ({"model": MODEL, "prompt": "Hi", "echo": "loud"}, "echo", None),
        ({"model": MODEL, "prompt": "Hi", "suffix": "end"}, "suffix", None),
        ({"model": MODEL, "prompt": "Hi", "presence_penalty": 2.5}, "presence_penalty", None),
        ({"model": MODEL, "prompt": "Hi", "frequency_penalty": -2.01}, "frequency_penalty", None),
        ({"model": MODEL, "prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty", None),
        ({"model": MODEL, "prompt": "Hi", "repetition_penalty": 2.5}, "repetition_penalty", None),
        ({"model": MODEL, "prompt": "Hi", "min_p": 1.5}, "min_p", None),
        ({"model": MODEL, "prompt": "Hi", "min_tokens": -1}, "min_tokens", None),
        ({"model": MODEL, "prompt": "Hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens", None),
        ({"model": MODEL, "prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias", None),
        ({"model": MODEL, "prompt": "Hi", "logit_bias": {"five": 1}}, "logit_bias", None),
        ({"model": MODEL, "prompt": "Hi", "logit_bias": {"²": 1}}, "logit_bias", None),
        ({"model": MODEL, "prompt": "Hi", "logit_bias": {"1000000": 1}}, "logit_bias", None),
        ({"model": MODEL, "prompt": "Hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", None),
        ({"model": MODEL, "prompt": "Hi", "stop_token_ids": [1000000]}, "stop_token_ids", None),
        ({"model": MODEL, "prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids", None),
        ({"model": MODEL, "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"model": MODEL, "prompt": "Hi", "stop": [""]}, "stop", None),
        ({"model": MODEL, "prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options", None),
        ({"model": MODEL, "prompt": "Hi", "temperature": "hot"}, "temperature", None),
        ({"model": MODEL, "prompt": {"text": "Hi"}}, "prompt", None),
        ({"model": MODEL, "prompt": "Hi", "stop": 5}, "stop", None),
    ],
)
def test_bad_completion_requests_are_400s(
    client: TestClient, backend: ScriptedBackend, payload: dict[str, Any], param: str, code: str | None
):
    status = 404 if code == "model_not_found" else 400
    error = assert_error(client.post("/v1/completions", json=payload), status, param, code)
    assert error["type"] == "invalid_request_error"
    assert backend.requests == []  # nothing bad reaches the runtime


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"model": MODEL, "messages": CHAT, "logprobs": "maybe"}, "logprobs"),
        ({"model": MODEL, "messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
        ({"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"model": MODEL, "messages": CHAT, "n": 17}, "n"),
        ({"model": MODEL, "messages": CHAT, "presence_penalty": -3}, "presence_penalty"),
        ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 1000}, "max_tokens"),
    ],
)
def test_bad_chat_requests_are_400s(client: TestClient, backend: ScriptedBackend, payload: dict[str, Any], param: str):
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert backend.requests == []


def test_malformed_json_is_a_400(client: TestClient):
    response = client.post("/v1/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
    assert_error(response, 400, None, "invalid_json")
    response = client.post("/v1/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert_error(response, 400)


def test_json_without_content_type_is_refused(client: TestClient, backend: ScriptedBackend):
    # Not a "simple" cross-origin request: a web page cannot make a browser send it without a CORS preflight.
    body = b'{"model": "%s", "prompt": "Hi"}' % MODEL.encode()
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        assert_error(client.post("/v1/completions", content=body, headers=headers), 415, None, "unsupported_media_type")
    assert backend.requests == []
    json_utf8 = {"Content-Type": "application/json; charset=utf-8"}
    assert client.post("/v1/completions", content=body, headers=json_utf8).status_code == 200


def test_unknown_route_and_method_use_the_error_body(client: TestClient):
    assert assert_error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert_error(client.get("/v1/completions"), 405)


def test_queue_full_is_503_with_retry_after(client: TestClient, backend: ScriptedBackend):
    backend.queue_bound = 0
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_error(response, 503, code="queue_full")
    assert response.headers["Retry-After"] == "3"  # 2.5 s rounded up to whole seconds
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "stream": True})
    assert_error(response, 503, code="queue_full")  # streaming requests fail before the stream starts


def test_not_ready_is_503(client: TestClient, backend: ScriptedBackend):
    backend.ready = False
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 503, code="not_ready")
    assert_error(client.get("/ready"), 503, code="not_ready")
    assert client.get("/health").json() == {"status": "ok"}
    backend.ready = True
    assert client.get("/ready").json() == {"status": "ready"}


def test_runtime_failure_is_500_and_the_server_survives(client: TestClient, backend: ScriptedBackend):
    backend.fail_after = 3
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 500, code="generation_failed")
    backend.fail_after = None
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code == 200


def test_runtime_cancellation_is_a_retryable_503(client: TestClient, backend: ScriptedBackend):
    backend.fail_after, backend.fail_reason = 2, FinishReason.CANCELLED
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert_error(response, 503, code="cancelled_by_server")


def test_failure_mid_stream_sends_an_error_event_then_done(client: TestClient, backend: ScriptedBackend):
    backend.fail_after = 3
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
    assert response.status_code == 200  # the status line went out with the first token
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["code"] == "generation_failed"
    assert len(payloads) == 3 + 2  # three token chunks, the error, [DONE]
    assert backend.active == 0


def test_backend_exception_is_a_500_not_a_crash(client: TestClient, backend: ScriptedBackend):
    def broken_script(request: Any) -> list[int]:
        raise RuntimeError("boom")

    backend.script = broken_script  # type: ignore[method-assign]
    error = assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 500)
    assert "boom" not in error["message"]  # internals are logged, not leaked
    assert client.get("/health").status_code == 200


def test_request_past_its_deadline_is_504_and_cancelled(
    tokenizer_dir: Path, backend: ScriptedBackend, tokenizer: Tokenizer
):
    settings = make_settings(tokenizer_dir)
    settings.controller.request_timeout_s = 0.3
    backend.token_delay_s = 0.1  # the reply needs ~3 s
    app = create_app(settings, backend.factory(), tokenizer=tokenizer)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as test:
        response = test.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100})
    assert_error(response, 504, code="request_timeout")
    assert len(backend.cancelled) == 1 and backend.active == 0


def test_backend_whose_generate_is_a_coroutine(tokenizer_dir: Path, tokenizer: Tokenizer):
    backend = EagerBackend(tokenizer)
    app = create_app(make_settings(tokenizer_dir), backend.factory(), tokenizer=tokenizer)
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as test:
        payload = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
        assert sse_payloads(test.post("/v1/completions", json=payload).text)[-1] == "[DONE]"
        assert test.post("/v1/completions", json={**payload, "stream": False}).json()["usage"]["completion_tokens"] == 3
        backend.queue_bound = 0
        assert_error(test.post("/v1/completions", json=payload), 503, code="queue_full")
        assert test.post("/v1/completions", json=payload).headers["Retry-After"] == "1"
    assert len(backend.finished) == 2 and not backend.cancelled
