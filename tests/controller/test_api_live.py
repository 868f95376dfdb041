"""The gateway behind a real uvicorn server: the official openai client, and client disconnects."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import API_KEY, MODEL, REPLY, LiveServer, ScriptedBackend

DEADLINE_S = 30.0


@pytest.fixture
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)


def test_openai_client_completions(oai: openai.OpenAI, backend: ScriptedBackend):
    completion = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=100, temperature=0, seed=7)
    assert completion.choices[0].text == REPLY
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == len(
        backend.script(backend.requests[0])
    )
    assert backend.requests[0].sampling.seed == 7


def test_openai_client_streams_completions_with_stop(oai: openai.OpenAI):
    stream = oai.completions.create(model=MODEL, prompt="Tell me", max_tokens=100, stream=True, stop=["answer"])
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks) == REPLY[: REPLY.index("answer")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_chat(oai: openai.OpenAI):
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=6, top_p=0.5
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.role == "assistant"
    assert REPLY.startswith(reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.completion_tokens == 6


def test_openai_client_streams_chat_with_usage(oai: openai.OpenAI):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Say hi"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 5},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens


def test_openai_client_models_and_errors(live_server: LiveServer, oai: openai.OpenAI, backend: ScriptedBackend):
    assert [model.id for model in oai.models.list()] == [MODEL]
    wrong = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="sk-wrong", timeout=DEADLINE_S, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="context length"):
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=10_000)
    backend.queue_bound = 0
    with pytest.raises(openai.APIStatusError) as overloaded:
        oai.completions.create(model=MODEL, prompt="Hi")
    assert overloaded.value.status_code == 503
    assert overloaded.value.response.headers["retry-after"] == "3"


def test_stream_disconnect_cancels_the_backend_request(live_server: LiveServer, backend: ScriptedBackend):
    backend.token_delay_s = 0.2  # the whole reply would take ~5 s; the client leaves after one token
    payload = {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(base_url=live_server.url, timeout=DEADLINE_S) as http,
        http.stream("POST", "/v1/completions", json=payload, headers=headers) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first.removeprefix("data: "))["id"]
    # Leaving the block closed the connection mid-stream.
    assert backend.closed_event.wait(DEADLINE_S)
    assert backend.cancelled == {request_id}
    assert backend.finished == set() and backend.active == 0


def test_non_streaming_disconnect_cancels_the_backend_request(live_server: LiveServer, backend: ScriptedBackend):
    backend.token_delay_s = 0.2
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 100}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=DEADLINE_S) as sock:
        sock.sendall(head + body)
        assert backend.midway_event.wait(DEADLINE_S)  # past admission: the gateway is collecting tokens
    assert backend.closed_event.wait(DEADLINE_S)
    assert len(backend.cancelled) == 1 and backend.finished == set() and backend.active == 0


def test_server_keeps_serving_after_disconnects(live_server: LiveServer, backend: ScriptedBackend, oai: openai.OpenAI):
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=DEADLINE_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # truncated body
    assert oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"


def test_concurrent_streams_each_get_their_own_tokens(oai: openai.OpenAI, backend: ScriptedBackend):
    backend.token_delay_s = 0.01  # interleave the requests on the server's event loop

    def ask(i: int) -> tuple[str, str | None]:
        stream = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], stream=True, max_tokens=10 + i
        )
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert all(reason == "length" for _, reason in answers)
    assert all(REPLY.startswith(text) for text, _ in answers)
    assert len({text for text, _ in answers}) == 4  # each cut at its own max_tokens
    assert len(backend.finished) == 4 and backend.active == 0


@pytest.mark.parametrize("keep_alive_s", [0.5, 30.0])
def test_an_idle_connection_is_kept_for_the_keep_alive_period(settings, backend: ScriptedBackend, keep_alive_s) -> None:
    """A client pool reuses a connection that sat idle between requests. uvicorn's own default (5 s) closes
    it first, and a request sent at that moment gets 'server disconnected without a response' (seen in
    the chat soak test); the gateway keeps idle connections for ``controller.keep_alive_s`` (75 s)."""
    controller = settings.controller.model_copy(update={"keep_alive_s": keep_alive_s})
    server = LiveServer(settings.model_copy(update={"controller": controller}), backend)
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE_S)
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        sock = conn.sock
        time.sleep(1.5)  # idle: longer than the short setting, far shorter than the long one
        try:
            conn.request("GET", "/health")
            again = conn.getresponse()
            again.read()
            served = again.status == 200 and conn.sock is sock  # on the same connection, not a new one
        except (http.client.RemoteDisconnected, ConnectionError):
            served = False
        conn.close()
        assert served == (keep_alive_s > 1.5)
    finally:
        server.stop()
