"""A fake OpenAI-compatible streaming server with known delays, for the load generator's tests.

FastAPI + uvicorn in a thread of the test process. ``POST /v1/completions`` streams ``max_tokens``
chunks: the first after ``FIRST_S``, the others ``TOKEN_S`` apart, then a usage chunk if asked
(``prompt_tokens``: the number of ids of a token-id prompt, 1 for a text). A text prompt selects a
behaviour: ``busy`` answers 503, ``broken`` sends an error event after two tokens, ``no-usage``
omits the usage chunk. The server records every request body and the most requests it had in flight.
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
from fastapi.responses import JSONResponse, StreamingResponse

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

    def reset(self) -> None:
        self.bodies.clear()
        self.in_flight = self.max_in_flight = 0


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
