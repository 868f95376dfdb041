"""``ignore_eos`` (vLLM's extension): accepted by both endpoints and carried to the workers' SamplingSpec."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.backend import GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend

from .conftest import MODEL, REPLY, ScriptedBackend, sse_payloads


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [5, 6, 7]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_ignore_eos_is_accepted_and_reaches_the_backend(
    client: TestClient, backend: ScriptedBackend, path: str, body: dict
) -> None:
    for flag in (True, False):
        response = client.post(path, json={"model": MODEL, "max_tokens": 4, "ignore_eos": flag, **body})
        assert response.status_code == 200, response.text
    assert client.post(path, json={"model": MODEL, "max_tokens": 4, **body}).status_code == 200
    assert [r.sampling.ignore_eos for r in backend.requests] == [True, False, False]


def test_ignore_eos_must_be_a_boolean(client: TestClient, backend: ScriptedBackend) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "ignore_eos": "maybe"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "ignore_eos"
    assert not backend.requests


def test_streamed_usage_counts_tokens_past_eos(client: TestClient, backend: ScriptedBackend, tokenizer: Tokenizer):
    """The gateway's stream does not end at an EOS token itself: the backend decides when a request ends."""
    reply = len(tokenizer.encode(REPLY, add_special_tokens=False))
    payload = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": reply + 1,  # the scripted reply, then its EOS
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_payloads(client.post("/v1/completions", json=payload).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == reply + 1


def test_the_pipeline_backend_puts_ignore_eos_on_the_wire(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(Settings(), r, n_layers=6)
        backend._ready = True
        streams = [
            await backend.generate(GenerationRequest(f"r{flag}", (1, 2), SamplingSpec(max_tokens=4, ignore_eos=flag)))
            for flag in (True, False)
        ]
        assert [req.sampling.ignore_eos for req in backend.scheduler.waiting] == [True, False]
        for stream in streams:
            await stream.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
