"""The whole system through HTTP: real Redis, real worker processes, real UCX, the real default model.

Greedy outputs through the API must equal the staged engine run in one process, one request at a
time, for disaggregated and colocated deployments whose prompt and token pipelines differ in depth
and microbatch size. The official ``openai`` client is the HTTP client.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from openai import OpenAI

from dejavu_common.settings import Mode

from .cluster import cluster_settings, logs, running
from .reference import Reference

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived a",
]


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model)


def _client(launcher) -> OpenAI:
    return OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)


def _jobs(n: int) -> list[tuple[str, int]]:
    """``n`` requests of different prompt lengths and token budgets."""
    return [(PROMPTS[i % len(PROMPTS)] + " and" * (i // len(PROMPTS)), 3 + (i * 5) % 14) for i in range(n)]


def _complete_all(client: OpenAI, name: str, jobs: list[tuple[str, int]]):
    def one(job):
        prompt, n = job
        r = client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0)
        return r.choices[0].text, r.usage, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def _check_outputs(launcher, settings, reference: Reference, n_requests: int) -> None:
    client = _client(launcher)
    jobs = _jobs(n_requests)
    for (prompt, n), (text, usage, finish) in zip(jobs, _complete_all(client, settings.model.name, jobs), strict=True):
        assert text == reference.text(prompt, n), f"{prompt!r}\n{logs(launcher)}"
        assert usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        assert usage.completion_tokens <= n and finish in ("stop", "length")
    # Streaming chat applies the chat template and yields the same text as the engine's chat mode.
    stream = client.chat.completions.create(
        model=settings.model.name,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference.text("Say hello.", 12, chat=True)
    # ignore_eos (vLLM's extension): the model's answer ends by EOS within 40 tokens; ignoring it, the
    # request runs to max_tokens with the same tokens as the engine ignoring EOS.
    for ignore_eos, finish in ((False, "stop"), (True, "length")):
        r = client.chat.completions.create(
            model=settings.model.name,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": ignore_eos},
        )
        assert r.choices[0].finish_reason == finish
        assert r.choices[0].message.content == reference.text("Say hello.", 40, chat=True, ignore_eos=ignore_eos)
    assert r.usage.completion_tokens == 40


def test_disaggregated_1p_2t_sixteen_concurrent_requests_and_bad_input(redis_url, model, reference) -> None:
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=2, prompt_microbatch=4, token_microbatch=4
    )
    with running(settings) as launcher:
        _check_outputs(launcher, settings, reference, 16)
        url = launcher.api_url + "/v1/completions"
        bad = [
            (b"{not json", 400),
            (b'{"model": "nope", "prompt": "x", "max_tokens": 4}', 404),
            (b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 0}', 400),
            (b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 1000000}', 400),
            (b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 4, "n": 17}', 400),
        ]
        for body, status in bad:
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == status, (body, r.text)
            assert set(r.json()["error"]) >= {"message", "type"}
        # The system keeps serving afterwards.
        ((text, _, _),) = _complete_all(_client(launcher), settings.model.name, [(PROMPTS[0], 5)])
        assert text == reference.text(PROMPTS[0], 5)


@pytest.mark.parametrize(
    "deployment",
    [
        pytest.param(dict(prompt_depth=2, token_depth=3, prompt_microbatch=2, token_microbatch=4), id="2P+3T"),
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=2, token_microbatch=2), id="colocated-2"),
        # One stage over a paged pool: requests arriving while others stream are prefilled in the passes that
        # decode them (mixed passes).
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1, token_microbatch=2), id="colocated-1"),
    ],
)
def test_split_merge_and_colocated_deployments(deployment, redis_url, model, reference) -> None:
    settings = cluster_settings(redis_url, model, **deployment)
    with running(settings) as launcher:
        _check_outputs(launcher, settings, reference, 6)
        if deployment.get("token_depth") == 1:  # a colocated one-stage pipeline schedules requests
            assert "request scheduling: a paged pool" in logs(launcher, tail=None)


def _mixed_jobs(n: int) -> list[tuple[str, int]]:
    """``n`` requests whose prompt lengths differ a lot (2 to ~60 tokens) and whose budgets differ too."""
    return [(PROMPTS[i % len(PROMPTS)] + " and" * ((7 * i) % 23), 2 + (i * 5) % 11) for i in range(n)]


@pytest.mark.parametrize(
    "deployment",
    [
        # A prompt task of 4 rows feeds two token microbatches of 2, each padded to its own longest prompt.
        pytest.param(dict(prompt_depth=1, token_depth=2, prompt_microbatch=4, token_microbatch=2), id="1P+2T"),
        # Tasks of 3 rows straddle token microbatches of 2: pieces of one task land in different microbatches;
        # the token stages keep KV in paged pools of 4-position blocks (prompt KV, replicas and decode
        # steps all cross block boundaries).
        pytest.param(
            dict(prompt_depth=2, token_depth=3, prompt_microbatch=3, token_microbatch=2, kv_block_size=4),
            id="2P+3T-paged",
        ),
    ],
)
def test_prompt_tasks_feeding_token_microbatches_of_different_prompt_lengths(
    deployment, redis_url, model, reference
) -> None:
    deployment = dict(deployment)
    block_size = deployment.pop("kv_block_size", 0)
    settings = cluster_settings(redis_url, model, **deployment)
    settings.engine.kv_block_size = block_size
    with running(settings) as launcher:
        jobs = _mixed_jobs(12)
        got = _complete_all(_client(launcher), settings.model.name, jobs)
        for (prompt, n), (text, _usage, _finish) in zip(jobs, got, strict=True):
            assert text == reference.text(prompt, n), f"{prompt!r}\n{logs(launcher)}"
        assert "dropped a prompt KV chunk" not in logs(launcher, tail=None)


def test_paged_pools_too_small_for_the_microbatches_in_flight_preempt_and_lose_nothing(
    redis_url, model, reference
) -> None:
    """1P + 2T batching microbatch cohorts (``engine.request_scheduling`` off, as swapping runs), KV in pools of 40
    blocks of 4 positions per token stage: three microbatches of two 40-token answers need up to 84 blocks a stage
    at their longest. Stages move the caches of microbatches outside a pass to host memory when the pass needs
    room (and stage 0 sets the latest-joined member of a cohort aside when its own members cannot fit); preempted
    microbatches come back when computed again: every answer is transformers', and none fails."""
    deployment = dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2)
    settings = cluster_settings(redis_url, model, **deployment)
    settings.engine.request_scheduling = False
    log_text = _answers_from_small_pools(settings, reference)
    assert "moved to host memory" in log_text, log_text[-3000:]  # preempted, and lost nothing


def _answers_from_small_pools(settings, reference: Reference, host_bytes: int | None = None) -> str:
    """Six 40-token answers from token stages whose paged pools hold 40 blocks of 4 positions each: every
    answer is transformers' and none fails. Returns the deployment's logs."""
    settings.engine.kv_block_size = 4
    layers = 30 // settings.controller.token_depth
    settings.engine.kv_pool_bytes = 40 * (2 * layers * 3 * 4 * 64 * 4)  # blocks: K and V, 3 heads of 64 a layer
    settings.engine.kv_host_bytes = host_bytes
    settings.engine.max_recomputes = 10_000  # this test is about recompute losing nothing, not its cap
    with running(settings) as launcher:
        jobs = [(PROMPTS[i % len(PROMPTS)], 40) for i in range(6)]
        got = _complete_all(_client(launcher), settings.model.name, jobs)
        for (prompt, n), (text, _usage, _finish) in zip(jobs, got, strict=True):
            assert text == reference.text(prompt, n), f"{prompt!r}\n{logs(launcher)}"
        log_text = logs(launcher, tail=None)
    assert "PoolExhausted" not in log_text and "failing its requests" not in log_text
    return log_text


@pytest.mark.parametrize(
    "deployment",
    [
        pytest.param(dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2), id="1P+2T"),
        pytest.param(
            dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2, request_scheduling=False),
            id="1P+2T-cohorts",
        ),
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1, token_microbatch=2), id="colocated"),
    ],
)
def test_with_no_host_memory_for_preempted_caches_stage_0_recomputes_them_and_loses_nothing(
    deployment, redis_url, model, reference
) -> None:
    """As above, but no stage may keep a preempted cache in host memory (``kv_host_bytes`` of 1 byte): each
    discards the KV of the microbatches it preempts. Stage 0 brings each back through one prefill pass of its
    prompt and every token it generated, through every stage (the others drop and rewrite theirs); a later
    stage that discarded one leaves it out of the next step and hands it back to stage 0 to recompute.
    Every answer is still transformers', token for token. A request-scheduled pipeline (the default) preempts by
    recompute alone: stage 0's policy gives the request's blocks back and computes its prompt and tokens again."""
    deployment = dict(deployment)
    cohorts = deployment.pop("request_scheduling", True) is False
    settings = cluster_settings(redis_url, model, **deployment)
    settings.engine.request_scheduling = not cohorts
    log_text = _answers_from_small_pools(settings, reference, host_bytes=1)
    assert "to be recomputed" in log_text, log_text[-3000:]
    if cohorts:
        assert "recomputing microbatch" in log_text, log_text[-3000:]
    assert "moved to host memory" not in log_text  # stage 1 discards too
