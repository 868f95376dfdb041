"""The request guard: every non-probe path keyed, bodies refused unread, sizes and lengths bounded.

The ASGI-level tests drive the app with a hand-made ``receive`` that counts what the app reads, so
"refused before the body is read" and "never more than the cap held" are measured, not assumed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import create_app
from dejavu_controller.api.guard import OPEN_PATHS, bearer_token, is_json

from .conftest import API_KEY, MODEL, REPLY, LiveServer, ScriptedBackend, make_settings

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
CHUNK = 64 << 10


def _settings(tokenizer_dir: Path, **controller: Any):
    settings = make_settings(tokenizer_dir)
    return settings.model_copy(update={"controller": settings.controller.model_copy(update=controller)})


@pytest.fixture
def app(tokenizer_dir: Path, backend: ScriptedBackend, tokenizer: Tokenizer):
    return create_app(_settings(tokenizer_dir, max_body_bytes=1 << 20), backend.factory(), tokenizer=tokenizer)


@pytest.fixture
def anonymous(app) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as test:
        yield test


def _paths(app) -> list[tuple[str, str]]:
    """Every (method, concrete path) the app serves, docs included, with path parameters filled in."""
    found = [
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route)  # the docs routes; routers are included as a whole
        for method in sorted(route.methods or ())
        if method != "HEAD"
    ]
    for path, operations in app.openapi()["paths"].items():
        found.extend((method.upper(), path.replace("{model}", MODEL)) for method in operations)
    return found


def test_every_path_but_the_probes_needs_a_key(app, anonymous: TestClient, backend: ScriptedBackend):
    paths = _paths(app)
    served = {path for _method, path in paths}
    assert {"/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/v1/completions"} <= served
    for method, path in paths:
        body = CHAT if "chat" in path else {"tokens": [1, 2]} if path == "/detokenize" else COMPLETION
        kwargs = {"json": body} if method == "POST" else {}
        response = anonymous.request(method, path, **kwargs)
        if path in OPEN_PATHS:
            assert response.status_code == 200, path
            continue
        assert response.status_code == 401, (method, path)
        assert response.json()["error"]["code"] == "invalid_api_key"
        keyed = anonymous.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"}, **kwargs)
        assert keyed.status_code == 200, (method, path, keyed.text)
    assert len(backend.requests) == 2  # only the keyed completions reached the backend


class _Body:
    """An ASGI ``receive`` that sends a body in 64 KiB chunks (endless if ``total`` is None) and counts reads."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.sent = 0
        self.reads = 0

    async def __call__(self) -> dict[str, Any]:
        self.reads += 1
        if self.total is not None and self.sent >= self.total:
            await asyncio.sleep(3600)  # a well-behaved server never asks again after the last chunk
        n = CHUNK if self.total is None else min(CHUNK, self.total - self.sent)
        self.sent += n
        more = self.total is None or self.sent < self.total
        return {"type": "http.request", "body": b"{" * n, "more_body": more}


def _call(app, headers: dict[str, str], body: _Body, portal: Any = None) -> tuple[int, dict[str, Any]]:
    """Run one POST to /v1/completions through the ASGI app (on ``portal``'s loop if given, the loop of a
    TestClient whose lifespan runs); returns (status, JSON body)."""
    path = "/v1/completions"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    if portal is None:
        asyncio.run(asyncio.wait_for(app(scope, body, send), 10))
    else:
        portal.call(app, scope, body, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(payload)


def test_unauthenticated_body_is_never_read(app):
    body = _Body(None)  # endless
    for headers in (
        {"content-type": "application/json", "content-length": str(1 << 40)},
        {"content-type": "application/json", "transfer-encoding": "chunked"},
        {"content-type": "application/json", "authorization": "Bearer sk-wrong", "transfer-encoding": "chunked"},
    ):
        status, error = _call(app, headers, body)
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
    assert body.reads == 0


def test_declared_oversized_body_is_refused_unread(app):
    body = _Body(None)
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json", "content-length": str(2 << 20)}
    status, error = _call(app, headers, body)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    assert error["error"]["type"] == "invalid_request_error"
    assert body.reads == 0


def test_endless_chunked_body_is_cut_at_the_cap(app):
    body = _Body(None)
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json", "transfer-encoding": "chunked"}
    status, error = _call(app, headers, body)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    assert body.sent <= (1 << 20) + CHUNK  # never more than the cap and one chunk held


def test_a_body_under_the_cap_reaches_the_route_in_chunks(app, anonymous: TestClient, backend: ScriptedBackend):
    raw = json.dumps({**COMPLETION, "user": "x" * (3 * CHUNK)}).encode()
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}

    class Json(_Body):
        async def __call__(self) -> dict[str, Any]:
            self.reads += 1
            if self.sent >= len(raw):
                await asyncio.sleep(3600)
            chunk = raw[self.sent : self.sent + CHUNK]
            self.sent += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": self.sent < len(raw)}

    status, answer = _call(app, headers, Json(len(raw)), anonymous.portal)  # the lifespan's loop: a gateway
    assert status == 200, answer
    assert answer["object"] == "text_completion"


def test_live_server_refuses_big_bodies_without_reading_them(tokenizer_dir: Path, backend: ScriptedBackend):
    server = LiveServer(_settings(tokenizer_dir, max_body_bytes=64 << 10), backend)
    server.start()
    try:

        def endless() -> Iterator[bytes]:
            for _ in range(4096):  # 256 MiB if the server kept reading
                yield b" " * CHUNK

        headers = {"Content-Type": "application/json"}
        with httpx.Client(base_url=server.url, timeout=20) as http:
            for auth in ({}, {"Authorization": f"Bearer {API_KEY}"}):
                try:
                    response = http.post("/v1/completions", content=endless(), headers={**headers, **auth})
                except (httpx.RemoteProtocolError, httpx.WriteError):
                    continue  # the server answered and closed while the client was still writing
                assert response.status_code == (413 if auth else 401)
            keyed = {**headers, "Authorization": f"Bearer {API_KEY}"}
            response = http.post("/v1/completions", content=b" " * (65 << 10), headers=keyed)
            assert response.status_code == 413
            assert response.json()["error"]["code"] == "request_too_large"
            assert http.get("/health").status_code == 200  # and it still serves
    finally:
        server.stop()
    assert backend.requests == []


def test_prompt_text_is_bounded_before_tokenizing(
    tokenizer_dir: Path, backend: ScriptedBackend, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
):
    app = create_app(_settings(tokenizer_dir, max_prompt_chars=100), backend.factory(), tokenizer=tokenizer)
    calls: list[str] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: calls.append(text) or encode(text, *a, **k))
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with TestClient(app, raise_server_exceptions=False, headers=auth) as client:
        response = client.post("/v1/completions", json={**COMPLETION, "prompt": "a" * 101})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "a" * 60}] * 2}
        response = client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert calls == []  # refused without touching the tokenizer
        assert client.post("/v1/completions", json={**COMPLETION, "prompt": "a" * 100}).status_code == 200
    assert backend.requests and calls[0] == "a" * 100  # (the scripted backend encodes its reply too)


def test_prompts_are_tokenized_off_the_event_loop(
    client: TestClient, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
):
    threads: list[int] = []
    encode = tokenizer.encode

    def recording(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if text == REPLY:  # the scripted backend encoding its answer, not the gateway
            return encode(text, *args, **kwargs)
        threads.append(threading.get_ident())
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return encode(text, *args, **kwargs)
        raise AssertionError("tokenizing on the event loop's thread")

    monkeypatch.setattr(tokenizer, "encode", recording)
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(threads) == 2


@pytest.mark.parametrize("stop", ["x" * 257, ["ok", "y" * 1000], ["a", "b", "c", "d", "e"]])
def test_stop_strings_are_bounded(client: TestClient, backend: ScriptedBackend, stop: Any):
    response = client.post("/v1/completions", json={**COMPLETION, "stop": stop})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
    assert backend.requests == []


def test_requests_in_progress_are_capped_not_idle_connections(tokenizer_dir: Path, backend: ScriptedBackend):
    """``max_connections`` caps requests in progress (503 beyond): an idle kept-alive connection does not
    count, and the probes are never refused."""
    settings = _settings(tokenizer_dir, max_connections=1)
    backend.token_delay_s = 0.2
    server = LiveServer(settings, backend)
    server.start()
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        streamed = {**COMPLETION, "stream": True, "max_tokens": 8}
        with (
            httpx.Client(base_url=server.url, timeout=20, headers=auth) as first,
            httpx.Client(base_url=server.url, timeout=20, headers=auth) as second,
        ):
            assert second.get("/v1/models").status_code == 200  # its connection stays open, idle
            with first.stream("POST", "/v1/completions", json=streamed) as stream:
                assert stream.status_code == 200
                assert backend.started_event.wait(10)
                refused = second.get("/v1/models")  # over the cap while the stream runs
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "overloaded"
                assert second.get("/health").status_code == 200
                stream.read()
            assert second.get("/v1/models").status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer   ", None),
        ("Basic abc", None),
        ("abc", None),
        ("Bearer abc", "abc"),
        ("bearer abc ", "abc"),
    ],
)
def test_bearer_token(header: str | None, token: str | None):
    assert bearer_token(header) == token


def test_is_json():
    assert is_json("application/json") and is_json("Application/JSON; charset=utf-8")
    assert not any(map(is_json, (None, "", "text/plain", "application/jsonx", "multipart/form-data")))
