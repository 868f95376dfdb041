"""The whole system through HTTP: real Redis, real worker processes, real UCX, the real default model.

Greedy outputs through the API must equal the staged engine run in one process (``dejavu generate``'s
Python API), for disaggregated and colocated deployments whose prompt and token pipelines differ in
depth and microbatch size.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from openai import OpenAI

from dejavu_common.settings import Mode, Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_engine.generate import generate
from .cluster import cluster_settings, logs, running

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived a",
]


@pytest.fixture(scope="module")
def model():
    return ensure_default_model(Settings())


@pytest.fixture(scope="module")
def reference(model):
    """Greedy text of each prompt from the in-process engine, for a few max_tokens values."""
    cache: dict[tuple[str, int, bool], str] = {}

    def ref(prompt: str, max_tokens: int, chat: bool = False) -> str:
        key = (prompt, max_tokens, chat)
        if key not in cache:
            cache[key] = generate(prompt, chat=chat, max_tokens=max_tokens, model=model).text
        return cache[key]

    return ref


def _client(launcher) -> OpenAI:
    return OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=120, max_retries=0)


DEPLOYMENTS = {
    "1P+2T": dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2),
    "2P+3T split/merge": dict(prompt_depth=2, token_depth=3, prompt_microbatch=2, token_microbatch=4),
    "colocated 2-stage": dict(mode=Mode.COLOCATED, token_depth=2, token_microbatch=2),
}


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_greedy_outputs_equal_the_engine(name, redis_url, model, reference) -> None:
    settings = cluster_settings(redis_url, model, **DEPLOYMENTS[name])
    with running(settings) as launcher:
        client = _client(launcher)
        jobs = [(p, 6 + 3 * i) for i, p in enumerate(PROMPTS)]

        def complete(job):
            prompt, n = job
            r = client.completions.create(model=settings.model.name, prompt=prompt, max_tokens=n, temperature=0)
            return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(complete, jobs))
        for (prompt, n), (text, used, finish) in zip(jobs, results, strict=True):
            assert text == reference(prompt, n), f"{name}: {prompt!r}\n{logs(launcher)}"
            assert used <= n and finish in ("stop", "length")

        # Streaming chat applies the chat template and yields the same text as the engine's chat mode.
        stream = client.chat.completions.create(
            model=settings.model.name,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == reference("Say hello.", 12, chat=True)


def test_sixteen_concurrent_requests_of_different_lengths(redis_url, model, reference) -> None:
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=2, prompt_microbatch=4, token_microbatch=4
    )
    tok = Tokenizer.from_pretrained(model)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' and' * (i % 4)}" for i in range(16)]
    budgets = [3 + (i * 5) % 14 for i in range(16)]
    with running(settings) as launcher:
        client = _client(launcher)

        def complete(i: int):
            return client.completions.create(
                model=settings.model.name, prompt=prompts[i], max_tokens=budgets[i], temperature=0
            )

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(complete, range(16)))
        for i, r in enumerate(results):
            assert r.choices[0].text == reference(prompts[i], budgets[i]), logs(launcher)
            assert r.usage.prompt_tokens == len(tok.encode(prompts[i]))
