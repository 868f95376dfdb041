"""``/v1/completions`` with a batch of prompts (a list of texts or of token-id lists), as OpenAI and vLLM take
it: ``n`` choices per prompt, prompt ``i``'s choice ``j`` at index ``i * n + j``, usage counting each prompt
once; a bad prompt fails the whole request before anything runs, naming it; every choice is admitted together
or the request fails; a client gone cancels every choice. The scripted backend answers every request with
the same reply, so ``echo`` (each choice's own prompt first) tells the choices' prompts apart. The last test
runs the official openai client against the real stack and the real model."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from dejavu_common.settings import Mode, Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.backend import FinishReason

from .conftest import API_KEY, MODEL, REPLY, LiveServer, ScriptedBackend, sse_payloads

DEADLINE_S = 30.0
PROMPTS = ["Tell me", "Say hello", "The answer is"]


@pytest.fixture
def oai(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)


def reply_tokens(backend: ScriptedBackend, max_tokens: int) -> int:
    """How many tokens the scripted reply has when cut at ``max_tokens``."""
    eos = [min(backend.tokenizer.eos_token_ids)] if backend.end_with_eos else []
    return min(len(backend.tokenizer.encode(backend.reply, add_special_tokens=False) + eos), max_tokens)


def wait_until_idle(backend: ScriptedBackend) -> None:
    """Until the backend runs nothing (each closed request has left ``active``), within the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while backend.active and time.monotonic() < deadline:
        time.sleep(0.02)


def test_each_prompt_gets_n_choices_in_prompt_major_order(
    oai: openai.OpenAI, backend: ScriptedBackend, tokenizer: Tokenizer
):
    completion = oai.completions.create(
        model=MODEL, prompt=PROMPTS[:2], max_tokens=4, n=2, seed=5, temperature=1, echo=True
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    tail = tokenizer.decode(tokenizer.encode(REPLY, add_special_tokens=False)[:4])
    assert [c.text for c in completion.choices] == [PROMPTS[0] + tail] * 2 + [PROMPTS[1] + tail] * 2
    assert all(c.finish_reason == "length" for c in completion.choices)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    assert [list(r.prompt_token_ids) for r in backend.requests] == [prompt_ids[k // 2] for k in range(4)]
    # Each choice its own backend request named by its index; each prompt samples as it would alone.
    assert [r.request_id for r in backend.requests] == [f"{completion.id}-{k}" for k in range(4)]
    seeds = [r.sampling.seed for r in backend.requests]
    assert seeds[0] == seeds[2] == 5 and seeds[1] == seeds[3] != 5
    usage = completion.usage
    assert usage is not None
    assert usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)  # each prompt once, whatever n
    assert usage.completion_tokens == 4 * 4
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert backend.active == 0 and len(backend.finished) == 4


def test_token_id_batch_scores_each_prompt(oai: openai.OpenAI, backend: ScriptedBackend):
    """lm-evaluation-harness's loglikelihood requests, batched: ``echo`` with ``max_tokens: 0`` and logprobs."""
    batch = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    scored = oai.completions.create(model=MODEL, prompt=batch, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in scored.choices] == [0, 1, 2]
    for choice, ids in zip(scored.choices, batch, strict=True):
        assert choice.text == backend.tokenizer.decode(ids, skip_special_tokens=False)
        assert choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens is not None
        assert logprobs.tokens == [backend.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        # The scripted backend's prompt log probabilities: None, then -p / 10 at position p.
        assert logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx([-p / 10 for p in range(1, len(ids))])
    assert [list(r.prompt_token_ids) for r in backend.requests] == batch
    assert scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (sum(map(len, batch)), 0)


def test_streamed_batch_with_usage(client: TestClient, backend: ScriptedBackend, tokenizer: Tokenizer):
    payload = {
        "model": MODEL,
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 100,
        "echo": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    payloads = sse_payloads(response.text)
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    *chunks, usage_chunk = payloads[:-1]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks:
        assert c["usage"] is None and len(c["choices"]) == 1 and c["id"] == usage_chunk["id"]
        choice = c["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {k: PROMPTS[k // 2] + REPLY for k in range(6)}
    assert finishes == dict.fromkeys(range(6), "stop")
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert usage["completion_tokens"] == 6 * reply_tokens(backend, 100)
    assert backend.active == 0 and len(backend.finished) == 6


def test_streamed_batch_through_the_openai_client(oai: openai.OpenAI, backend: ScriptedBackend):
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPTS[:2], max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts: dict[int, str] = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] and REPLY.startswith(texts[0]) and texts[0]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 2 * 5
    assert usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in backend.requests)


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(
    ("plain", "listed"),
    [("Tell me", ["Tell me"]), ([5, 6, 7], [[5, 6, 7]])],
    ids=["text", "token-ids"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_one_element_list_is_the_plain_prompt(
    client: TestClient, backend: ScriptedBackend, plain: Any, listed: Any, stream: bool
):
    def ask(prompt: Any) -> dict[int | None, list[Any]]:
        """The response without its id and time; streamed, each choice's chunks in order (the choices'
        chunks interleave as their tokens come), the others (usage, ``[DONE]``) under None."""
        payload = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 6, "echo": True, "logprobs": 2}
        payload |= {"stream": stream, "seed": 3}
        response = client.post("/v1/completions", json=payload)
        assert response.status_code == 200, response.text
        if not stream:
            return {None: [_comparable(response.json())]}
        out: dict[int | None, list[Any]] = {}
        for p in sse_payloads(response.text):
            index = p["choices"][0]["index"] if isinstance(p, dict) and p["choices"] else None
            out.setdefault(index, []).append(p if isinstance(p, str) else _comparable(p))
        return out

    first = ask(plain)
    plain_requests = backend.requests[:]
    assert ask(listed) == first
    listed_requests = backend.requests[len(plain_requests) :]
    # The same backend requests but for the response's id: no per-prompt suffix.
    assert [(r.prompt_token_ids, r.sampling) for r in listed_requests] == [
        (r.prompt_token_ids, r.sampling) for r in plain_requests
    ]
    ids = [r.request_id for r in listed_requests]
    assert ids[1] == ids[0].removesuffix("-0") + "-1" and ids[0].count("-") == 2  # cmpl-<hex>-<choice>


def _assert_400(response: httpx.Response, param: str, *, code: str | None = None, says: str = "") -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert says in error["message"], error
    return error["message"]


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([], "at least one prompt"),
        (["Hi", [5, 6]], "expected one of"),
        ([5, "Hi"], "expected one of"),
        ([[5, 6], [7, -1]], "prompt[1]"),
        (["Hi"] * 17, "at most 16"),
    ],
    ids=["empty", "text-then-ids", "id-then-text", "negative-id", "17-prompts"],
)
def test_malformed_batches_are_400s(client: TestClient, backend: ScriptedBackend, prompt: Any, says: str):
    _assert_400(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), "prompt", says=says)
    assert backend.requests == []


def test_prompts_times_n_is_bounded(client: TestClient, backend: ScriptedBackend):
    backend.queue_bound = 16
    message = _assert_400(
        client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS, "n": 6}), "prompt", says="16"
    )
    assert "18 choices" in message
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[:2], "n": 8, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16
    assert len(backend.requests) == 16


@pytest.mark.parametrize(
    ("bad", "param", "code"),
    [
        ("word " * 300, "prompt[2]", "context_length_exceeded"),  # the prompt alone overflows the context
        ("word " * 60, "max_tokens", "context_length_exceeded"),  # the prompt leaves less than max_tokens
        ("", "prompt[2]", None),
        ([5, 10**6], "prompt[2]", None),  # an id outside the vocabulary
        ("x" * 200_001, "prompt[2]", "context_length_exceeded"),  # over controller.max_prompt_chars
    ],
    ids=["too-long", "no-room-for-max-tokens", "empty", "id-out-of-range", "too-many-chars"],
)
def test_one_bad_prompt_fails_the_batch_before_anything_runs(
    client: TestClient, backend: ScriptedBackend, bad: Any, param: str, code: str | None
):
    good: list[Any] = ["Hi", "Tell me"] if isinstance(bad, str) else [[5, 6], [7]]
    payload = {"model": MODEL, "prompt": [*good, bad, good[0]], "max_tokens": 200}
    message = _assert_400(client.post("/v1/completions", json=payload), param, code=code)
    assert message.startswith("prompt[2]: ")
    assert backend.requests == []


def test_the_choices_are_admitted_together_or_not_at_all(client: TestClient, backend: ScriptedBackend):
    backend.token_delay_s = 0.05  # no choice ends before the last one is refused
    backend.queue_bound = 3
    for stream in (False, True):
        payload = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 50, "stream": stream}
        response = client.post("/v1/completions", json=payload)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "queue_full" and "retry-after" in response.headers
        assert backend.active == 0 and backend.finished == set()
    assert len(backend.cancelled) == 2 * 3  # the three admitted choices of each try, cancelled
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS, "max_tokens": 3})
    assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failing_choice_fails_the_batch(client: TestClient, backend: ScriptedBackend, stream: bool):
    backend.fail_after = 2
    backend.fail_reason = FinishReason.ERROR
    payload = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 8, "stream": stream}
    response = client.post("/v1/completions", json=payload)
    if stream:
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]" and "error" in payloads[-2]
    else:
        assert response.status_code == 500
    assert backend.active == 0


def test_a_client_gone_mid_stream_cancels_every_choice(live_server: LiveServer, backend: ScriptedBackend):
    backend.token_delay_s = 0.2  # each reply would take ~5 s; the client leaves after one chunk
    payload = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 100, "stream": True}
    with (
        httpx.Client(base_url=live_server.url, timeout=DEADLINE_S) as http,
        http.stream("POST", "/v1/completions", json=payload, headers={"Authorization": f"Bearer {API_KEY}"}) as r,
    ):
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        request_id = json.loads(first.removeprefix("data: "))["id"]
    wait_until_idle(backend)
    assert backend.active == 0 and backend.finished == set()
    assert backend.cancelled == {f"{request_id}-{k}" for k in range(4)}


def test_a_client_gone_while_waiting_cancels_every_choice(live_server: LiveServer, backend: ScriptedBackend):
    backend.token_delay_s = 0.2
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 100}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=DEADLINE_S) as sock:
        sock.sendall(head + body)
        assert backend.midway_event.wait(DEADLINE_S)  # past admission: the gateway is collecting tokens
    wait_until_idle(backend)
    assert backend.active == 0 and backend.finished == set() and len(backend.cancelled) == 4


# --- The real stack: the official openai client, real worker processes and the real model. ---------------

REAL_PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]
REAL_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> Path:
    from dejavu_engine.checkpoint import ensure_default_model  # torch stays out of the fast tests' imports

    return ensure_default_model(Settings())


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[Any]:
    from tests.system.reference import Reference

    yield Reference(model)


@pytest.mark.e2e
@pytest.mark.model
@pytest.mark.slow
def test_the_real_stack_answers_a_batch_as_each_prompt_alone(redis_url: str, model: Path, reference: Any) -> None:
    """Greedy: each choice of a batch equals the in-process engine's answer to its prompt alone (colocated, one
    stage, microbatch 2 so the three prompts share rows), whole and streamed; usage counts each prompt once."""
    from tests.system.cluster import cluster_settings, logs, running

    settings = cluster_settings(redis_url, model, mode=Mode.COLOCATED, token_depth=1, token_microbatch=2)
    expected = [reference.text(p, REAL_MAX_TOKENS) for p in REAL_PROMPTS]
    with running(settings) as launcher:
        client = openai.OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)
        whole = client.completions.create(
            model=settings.model.name, prompt=REAL_PROMPTS, max_tokens=REAL_MAX_TOKENS, temperature=0
        )
        assert [c.text for c in whole.choices] == expected, logs(launcher)
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert whole.usage is not None
        assert whole.usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in REAL_PROMPTS)
        stream = client.completions.create(
            model=settings.model.name, prompt=REAL_PROMPTS, max_tokens=REAL_MAX_TOKENS, temperature=0, stream=True
        )
        streamed = ["", "", ""]
        for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == expected, logs(launcher)
