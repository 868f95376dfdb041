"""Per API key limits (``controller.key_limits``): request and token buckets, the in-flight cap, 429 with
Retry-After in OpenAI's shape, per-key metrics, and the bounds on a conversation's shape.

Bucket refills are driven by a fake clock (``Quotas.set_clock``), never by sleeping.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from dejavu_common.settings import KeyLimits, Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import create_app
from dejavu_controller.api.auth import ANONYMOUS, key_id
from dejavu_controller.api.errors import RateLimitError
from dejavu_controller.api.metrics import GatewayMetrics
from dejavu_controller.api.quota import Quotas, TokenBucket, limits_of
from dejavu_controller.api.schemas.chat import MAX_CONTENT_PARTS, MAX_MESSAGES

from .conftest import API_KEY, MODEL, LiveServer, ScriptedBackend, make_settings

OTHER_KEY = "sk-test-key-2"
DEADLINE_S = 30.0
_OFF = {"requests_per_second": None, "requests_per_minute": None, "tokens_per_minute": None, "max_concurrent": None}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _settings(tokenizer_dir: Path, keys: tuple[str, ...] = (API_KEY, OTHER_KEY), **limits) -> Settings:
    base = make_settings(tokenizer_dir, keys=keys)
    controller = base.controller.model_copy(update={"key_limits": KeyLimits(**{**_OFF, **limits})})
    return base.model_copy(update={"controller": controller})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def serve(backend: ScriptedBackend, tokenizer: Tokenizer, clock: FakeClock) -> Iterator[Callable[..., TestClient]]:
    """``serve(settings)``: the app in-process on the fake clock (no default key header)."""
    clients: list[TestClient] = []

    def make(settings: Settings) -> TestClient:
        app = create_app(settings, backend.factory(), tokenizer=tokenizer)
        app.state.quotas.set_clock(clock)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _complete(client: TestClient, key: str = API_KEY, max_tokens: int = 4, prompt: str = "Hi") -> httpx.Response:
    return client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {key}"},
    )


def _metric(client: TestClient, name: str, **labels: str) -> float | None:
    text = client.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    wanted = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(f"{name}{wanted} "):
            return float(line.rsplit(" ", 1)[1])
    return None


# -- the buckets -----------------------------------------------------------------------------------------


def test_a_token_bucket_bursts_its_capacity_then_refills_at_its_rate() -> None:
    bucket = TokenBucket.per(6, 60.0)  # 6 a minute: one every 10 s
    for _ in range(6):
        assert bucket.wait_s(1, now=0.0) == 0
        bucket.take(1, now=0.0)
    assert bucket.wait_s(1, now=0.0) == pytest.approx(10.0)
    assert bucket.wait_s(1, now=4.0) == pytest.approx(6.0)
    assert bucket.wait_s(1, now=10.0) == 0
    assert bucket.wait_s(7, now=10.0) is None  # more than it ever holds
    bucket.give(100, now=10.0)  # a refund never fills it beyond its capacity
    assert bucket.wait_s(6, now=10.0) == 0 and bucket.wait_s(6.5, now=10.0) is None


def test_a_bucket_below_one_request_still_admits_one() -> None:
    bucket = TokenBucket.per(0.5, 1.0)  # one request every 2 s
    assert bucket.wait_s(1, now=0.0) == 0


def test_per_key_limits_override_the_default_field_by_field(tokenizer_dir: Path) -> None:
    settings = _settings(tokenizer_dir, max_concurrent=8, requests_per_second=5.0)
    other = key_id(OTHER_KEY)
    controller = settings.controller.model_copy(
        update={"key_limits_by_id": {other: KeyLimits.model_validate({"max_concurrent": 1})}}
    )
    assert limits_of(controller, key_id(API_KEY)) == controller.key_limits
    mine = limits_of(controller, other)
    assert mine.max_concurrent == 1 and mine.requests_per_second == 5.0 and mine.tokens_per_minute is None


def test_limits_for_an_unknown_key_id_are_refused_at_startup(tokenizer_dir: Path, backend: ScriptedBackend) -> None:
    settings = _settings(tokenizer_dir)
    controller = settings.controller.model_copy(update={"key_limits_by_id": {"0123456789ab": KeyLimits()}})
    with pytest.raises(ValueError, match="0123456789ab"):
        create_app(settings.model_copy(update={"controller": controller}), backend.factory())


def test_the_defaults_limit_every_key() -> None:
    limits = KeyLimits()
    assert None not in (
        limits.requests_per_second,
        limits.requests_per_minute,
        limits.tokens_per_minute,
        limits.max_concurrent,
    )


def test_quotas_of_two_keys_are_independent(clock: FakeClock) -> None:
    settings = Settings().controller.model_copy(update={"key_limits": KeyLimits(**{**_OFF, "max_concurrent": 1})})
    quotas = Quotas(settings, ("a", "b"), GatewayMetrics().keys, clock)
    lease = quotas.admit("a")
    with pytest.raises(RateLimitError, match="in flight"):
        quotas.admit("a")
    quotas.admit("b").release()
    lease.release()
    lease.release()  # once only: the slot is not freed twice
    assert quotas.in_flight("a") == 0
    quotas.admit("a")
    assert quotas.in_flight("a") == 1


# -- through HTTP ----------------------------------------------------------------------------------------


def test_over_the_request_rate_is_429_with_retry_after_and_refills(serve, tokenizer_dir: Path, clock: FakeClock):
    client = serve(_settings(tokenizer_dir, requests_per_minute=2))
    assert [_complete(client).status_code for _ in range(2)] == [200, 200]
    refused = _complete(client)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "30"  # one request refills every 30 s
    error = refused.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded" and error["param"] is None
    assert "requests per minute" in error["message"]
    clock.now += 29.0
    assert _complete(client).headers["retry-after"] == "1"
    clock.now += 1.0
    assert _complete(client).status_code == 200
    assert _complete(client).status_code == 429


def test_one_keys_exhaustion_leaves_another_key_alone(serve, tokenizer_dir: Path, backend: ScriptedBackend):
    client = serve(_settings(tokenizer_dir, requests_per_second=1.0))
    assert _complete(client).status_code == 200
    assert _complete(client).status_code == 429
    assert _complete(client, key=OTHER_KEY).status_code == 200
    assert len(backend.requests) == 2  # the refused request never reached the backend
    mine, other = key_id(API_KEY), key_id(OTHER_KEY)
    assert _metric(client, "dejavu_key_rate_limited_total", key=mine, limit="requests_per_second") == 1
    assert _metric(client, "dejavu_key_rate_limited_total", key=other, limit="requests_per_second") is None
    assert _metric(client, "dejavu_key_admitted_total", key=mine) == 1
    assert _metric(client, "dejavu_key_admitted_total", key=other) == 1
    assert _metric(client, "dejavu_requests_total", outcome="rate_limited") == 1
    metrics = client.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert API_KEY not in metrics and OTHER_KEY not in metrics  # keys are named by id only


def test_the_token_budget_is_charged_then_reconciled(serve, tokenizer_dir, tokenizer, backend: ScriptedBackend):
    prompt = len(tokenizer.encode("Hi"))
    generated = len(backend.tokenizer.encode(backend.reply, add_special_tokens=False)) + 1  # the reply and EOS
    budget = 200
    assert generated < budget and prompt + budget <= 256
    cost, used = prompt + budget, prompt + generated
    # The clock stands still (no refill): a second request fits only if the first gave back what it did
    # not generate when it ended.
    client = serve(_settings(tokenizer_dir, tokens_per_minute=cost + used))
    first = _complete(client, max_tokens=budget)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == generated
    assert _complete(client, max_tokens=budget).status_code == 200
    assert _metric(client, "dejavu_key_tokens_total", key=key_id(API_KEY)) == 2 * used
    left = cost - used  # the bucket now holds (cost + used) - 2 * used
    refused = _complete(client, max_tokens=left - prompt + 1)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
    assert int(refused.headers["retry-after"]) >= 1
    assert _complete(client, max_tokens=left - prompt).status_code == 200


def test_a_request_larger_than_the_token_limit_is_refused_for_good(serve, tokenizer_dir: Path, backend):
    client = serve(_settings(tokenizer_dir, tokens_per_minute=50))
    refused = _complete(client, max_tokens=100)
    assert refused.status_code == 429 and "retry-after" not in refused.headers
    assert refused.headers["x-should-retry"] == "false"
    assert refused.json()["error"]["type"] == "tokens" and "lower max_tokens" in refused.json()["error"]["message"]
    assert not backend.requests
    assert _complete(client, max_tokens=10).status_code == 200  # nothing was charged for the refusal


def test_a_failed_admission_gives_its_tokens_back(serve, tokenizer_dir: Path, backend: ScriptedBackend):
    client = serve(_settings(tokenizer_dir, tokens_per_minute=150))
    backend.ready = False
    assert _complete(client, max_tokens=100).status_code == 503
    backend.ready = True
    assert _complete(client, max_tokens=100).status_code == 200


def test_without_api_keys_all_clients_share_one_quota(serve, tokenizer_dir: Path):
    client = serve(_settings(tokenizer_dir, keys=(), requests_per_second=1.0))
    assert _complete(client, key="anything").status_code == 200
    assert _complete(client, key="something-else").status_code == 429
    assert _metric(client, "dejavu_key_admitted_total", key=ANONYMOUS) == 1


def test_probes_and_metrics_are_not_limited(serve, tokenizer_dir: Path):
    client = serve(_settings(tokenizer_dir, requests_per_second=1.0))
    assert _complete(client).status_code == 200
    for _ in range(3):
        assert client.get("/health").status_code == 200
        assert client.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_a_conversation_has_at_most_max_messages(serve, tokenizer_dir: Path, backend: ScriptedBackend):
    client = serve(_settings(tokenizer_dir))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    too_many = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": too_many}, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    parts = [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.content"
    assert str(MAX_CONTENT_PARTS) in response.json()["error"]["message"]
    assert not backend.requests


# -- the in-flight cap, behind a real server -------------------------------------------------------------


@pytest.fixture
def capped(tokenizer_dir: Path, backend: ScriptedBackend) -> Iterator[LiveServer]:
    server = LiveServer(_settings(tokenizer_dir, max_concurrent=1), backend)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _in_flight(server: LiveServer, key: str = API_KEY) -> int:
    return server.server.config.app.state.quotas.in_flight(key_id(key))


def _until_idle(server: LiveServer) -> None:
    end = time.monotonic() + DEADLINE_S
    while _in_flight(server):
        assert time.monotonic() < end, "the request's slot was never freed"
        time.sleep(0.01)


def test_the_in_flight_cap_holds_while_streaming_and_frees_when_the_client_leaves(capped, backend):
    backend.token_delay_s = 0.2  # the whole reply would take ~5 s; the client leaves after one token
    oai = openai.OpenAI(base_url=f"{capped.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)
    other = openai.OpenAI(base_url=f"{capped.url}/v1", api_key=OTHER_KEY, timeout=DEADLINE_S, max_retries=0)
    stream = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=100, stream=True)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as refused:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["type"] == "requests" and refused.value.code == "rate_limit_exceeded"
    backend.token_delay_s = 0.0
    assert other.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"
    stream.close()  # the client leaves mid-stream
    _until_idle(capped)
    for _ in range(2):  # a finished request frees its slot too
        assert oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"
        assert _in_flight(capped) == 0


def test_the_in_flight_cap_frees_when_a_waiting_client_leaves(capped, backend: ScriptedBackend):
    backend.token_delay_s = 0.2
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 100}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", capped.port), timeout=DEADLINE_S) as sock:
        sock.sendall(head + body)
        assert backend.midway_event.wait(DEADLINE_S)  # admitted, generating, the client waiting for it all
        assert _in_flight(capped) == 1
    _until_idle(capped)
    backend.token_delay_s = 0.0
    oai = openai.OpenAI(base_url=f"{capped.url}/v1", api_key=API_KEY, timeout=DEADLINE_S, max_retries=0)
    assert oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"


def test_the_openai_client_retries_after_the_advertised_time(tokenizer_dir: Path, backend: ScriptedBackend):
    """The official client reads Retry-After: with retries on, a refusal becomes a wait, then an answer."""
    clock = FakeClock()
    refusals: list[str] = []

    def on_response(response: httpx.Response) -> None:
        if response.status_code == 429:  # the client now waits Retry-After seconds: so does the bucket's clock
            refusals.append(response.headers["retry-after"])
            clock.now += float(response.headers["retry-after"])

    server = LiveServer(_settings(tokenizer_dir, requests_per_second=1.0), backend)
    server.start()
    try:
        server.server.config.app.state.quotas.set_clock(clock)
        http = httpx.Client(timeout=DEADLINE_S, event_hooks={"response": [on_response]})
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=2, http_client=http)
        answers = [oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3) for _ in range(2)]
        assert [a.choices[0].finish_reason for a in answers] == ["length", "length"]
        assert refusals == ["1"]
        http.close()
    finally:
        server.stop()


def test_key_ids_are_not_secrets_and_tell_keys_apart() -> None:
    ids = {key_id(f"sk-{i}") for i in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 12 and "sk-" not in i for i in ids)
    assert SecretStr(API_KEY).get_secret_value() not in key_id(API_KEY)
