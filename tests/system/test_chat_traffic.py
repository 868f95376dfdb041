"""Ordinary chat traffic, no fault injected: nothing fails, nothing is repaired, every request is answered.

Rounds of concurrent chat requests as a new user sends them (greedy, no ``max_tokens``, short user
messages of different lengths, with and without stop strings) on 1 prompt + 2 token workers with
replication on and a spare, for ``DEJAVU_CHAT_SOAK_S`` seconds (default 150). Afterwards the topology
is still at its first epoch (no repair ever started) and every worker process is the one that started.
The same message gets the same answer whichever requests it was batched with.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest
import redis
from openai import OpenAI

from dejavu_common import keys
from dejavu_common.settings import Replication, Settings
from dejavu_engine.checkpoint import ensure_default_model

from .cluster import cluster_settings, logs, running

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

MESSAGES = [
    "Hi!",
    "What is 2 + 2?",
    "Name a colour.",
    "What is the capital of Italy?",
    "Give me a synonym for happy.",
    "Is the sun a star? Answer in one sentence.",
    "Tell me one fact about cats.",
    "Translate 'good morning' into French.",
    "What do bees make?",
    "Write one sentence about the sea, the wind and the boats that sail on it at dawn.",
]
SOAK_S = float(os.environ.get("DEJAVU_CHAT_SOAK_S", "150"))
ROUND = 8


def _ask(client: OpenAI, name: str, message: str, stop: list[str] | None) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": message}], temperature=0, stop=stop
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_rounds_of_chat_requests_without_max_tokens_need_no_repair(redis_url) -> None:
    model = ensure_default_model(Settings())
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=2, recovery={"replication": Replication.MEMORY}
    )
    with running(settings, spares=1) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=300, max_retries=0)
        answers: dict[tuple[str, bool], set[str]] = {}
        end, sent, i = time.monotonic() + SOAK_S, 0, 0
        with concurrent.futures.ThreadPoolExecutor(ROUND) as pool:
            while time.monotonic() < end:
                jobs = [(MESSAGES[(i + k) % len(MESSAGES)], (i + k) % 2 == 0) for k in range(ROUND)]
                i += 3  # each round batches the messages with different companions
                futures = [pool.submit(_ask, client, settings.model.name, m, ["."] if s else None) for m, s in jobs]
                for (message, stopped), fut in zip(jobs, futures, strict=True):
                    text, finish = fut.result()
                    assert finish in ("stop", "length"), (message, finish)
                    answers.setdefault((message, stopped), set()).add(text)
                sent += ROUND
        print(f"{sent} chat requests answered in {SOAK_S:.0f} s")
        assert sent >= 2 * ROUND
        varying = {k: v for k, v in answers.items() if len(v) > 1}
        assert not varying, f"answers depend on batch companions: {varying}"
        r = redis.Redis.from_url(redis_url)
        assert int(r.get(keys.EPOCH) or 0) == 1, f"the pipeline was repaired without a fault\n{logs(launcher)}"
        for name in ("p0", "t0", "t1"):
            assert launcher.child(name).proc.poll() is None, f"{name} exited\n{logs(launcher)}"
        whole = logs(launcher, tail=None)
        assert "dropped a prompt KV chunk" not in whole and "failing its requests" not in whole
