"""A fake OpenAI-compatible streaming server with known delays, for the load generator's tests.

FastAPI + uvicorn in a thread of the test process. ``POST /v1/completions`` streams ``max_tokens``
chunks: the first after ``FIRST_S``, the others ``TOKEN_S`` apart, then a usage chunk if asked
(``prompt_tokens``: the number of ids of a token-id prompt, 1 for a text). A text prompt selects a
behaviour: ``busy`` answers 503, ``broken`` sends an error event after two tokens, ``no-usage``
omits the usage chunk. ``POST /v1/chat/completions`` streams as OpenAI does: an opening chunk with the
role and no text at once, then ``max_tokens`` content chunks timed as above (their text is
:func:`fake_answer` of the request), a closing chunk with the finish reason, the usage; the model
``fail-turn-2`` answers 503 to a chat of three messages (a conversation's second turn). ``GET /metrics``
serves ``FakeServer.metrics`` (404 while it is None). The server records every request body and the
most requests it had in flight.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

FIRST_S = 0.3
TOKEN_S = 0.05
MODEL = "fake-model"


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclass
class FakeServer:
    """The running fake: its URL and what it saw (reset before each test that reads it)."""

    url: str = ""
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    metrics: bytes | None = None

    def reset(self) -> None:
        self.bodies.clear()
        self.in_flight = self.max_in_flight = 0
        self.metrics = None


def fake_answer(body: dict) -> list[str]:
    """The content pieces the fake streams for a chat request: they name the chat's length and its last
    user message's first word, so an answer can be told from any other."""
    last = body["messages"][-1]["content"].split()[0]
    return [f" {last}#{len(body['messages'])}.{i}" for i in range(body["max_tokens"])]


def fake_app(seen: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.bodies.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt == "busy":
            error = {"message": "queue full", "type": "server_error", "param": None, "code": "queue_full"}
            return JSONResponse({"error": error}, status_code=503)
        with_usage = body.get("stream_options", {}).get("include_usage") and prompt != "no-usage"
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 1

        async def events() -> AsyncIterator[bytes]:
            seen.in_flight += 1
            seen.max_in_flight = max(seen.max_in_flight, seen.in_flight)
            try:
                await asyncio.sleep(FIRST_S)
                for i in range(n):
                    if i:
                        await asyncio.sleep(TOKEN_S)
                    if prompt == "broken" and i == 2:
                        yield _sse({"error": {"message": "worker lost", "code": "generation_failed"}})
                        yield b"data: [DONE]\n\n"
                        return
                    finish = "length" if i == n - 1 else None
                    yield _sse({"object": "text_completion", "choices": [{"text": " t", "finish_reason": finish}]})
                if with_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                    yield _sse({"object": "text_completion", "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            finally:
                seen.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.bodies.append(body)
        if body["model"] == "fail-turn-2" and len(body["messages"]) == 3:
            error = {"message": "queue full", "type": "server_error", "param": None, "code": "queue_full"}
            return JSONResponse({"error": error}, status_code=503)
        pieces = fake_answer(body)
        prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return _sse({"object": "chat.completion.chunk", "choices": [{"delta": delta, "finish_reason": finish}]})

        async def events() -> AsyncIterator[bytes]:
            seen.in_flight += 1
            seen.max_in_flight = max(seen.max_in_flight, seen.in_flight)
            try:
                yield chunk({"role": "assistant", "content": ""})
                await asyncio.sleep(FIRST_S)
                for i, piece in enumerate(pieces):
                    if i:
                        await asyncio.sleep(TOKEN_S)
                    yield chunk({"content": piece})
                yield chunk({}, "length")
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces)}
                yield _sse({"object": "chat.completion.chunk", "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            finally:
                seen.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        if seen.metrics is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return Response(seen.metrics, media_type="text/plain; version=0.0.4")

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    """The fake server on a free port, served by uvicorn in a thread; stopped after the module."""
    seen = FakeServer()
    config = uvicorn.Config(fake_app(seen), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake server did not start")
        time.sleep(0.02)
    seen.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield seen
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    """The module's fake server with its records cleared."""
    fake_server.reset()
    return fake_server


@pytest.fixture
def fake_url(fake: FakeServer) -> str:
    return fake.url
