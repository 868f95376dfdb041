"""Bearer API keys on /v1, open probes, and the refusal to expose a keyless API."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import InsecureExposureError, create_app
from dejavu_controller.api.auth import is_loopback

from .conftest import API_KEY, MODEL, ScriptedBackend, make_settings

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.fixture
def anonymous(tokenizer_dir: Path, backend: ScriptedBackend, tokenizer: Tokenizer):
    """A client of a keyed app that sends no key by default."""
    settings = make_settings(tokenizer_dir, keys=(API_KEY, "sk-second-key"))
    with TestClient(create_app(settings, backend.factory(), tokenizer=tokenizer)) as test:
        yield test


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": API_KEY},
    ],
)
def test_v1_without_a_valid_key_is_401(anonymous: TestClient, backend: ScriptedBackend, headers: dict[str, str]):
    for method, path, json in (
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        ("GET", "/v1/models", None),
    ):
        response = anonymous.request(method, path, json=json, headers=headers)
        assert response.status_code == 401, (path, headers)
        assert response.headers["WWW-Authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert backend.requests == []


def test_every_configured_key_is_accepted(anonymous: TestClient):
    for key in (API_KEY, "sk-second-key"):
        response = anonymous.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200


def test_auth_is_checked_before_the_body(anonymous: TestClient):
    response = anonymous.post("/v1/completions", json={"model": "nope"})
    assert response.status_code == 401


def test_probes_stay_open_and_metrics_need_a_key(anonymous: TestClient):
    assert anonymous.get("/health").status_code == 200
    assert anonymous.get("/ready").status_code == 200
    assert anonymous.get("/metrics").status_code == 401  # it lists worker ids, states and recovery timings
    assert anonymous.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com", "192.168.0.1"])
def test_keyless_api_beyond_loopback_is_refused(tokenizer_dir: Path, backend: ScriptedBackend, host: str):
    settings = make_settings(tokenizer_dir, keys=())
    settings.controller.host = host
    with pytest.raises(InsecureExposureError, match="API_KEYS"):
        create_app(settings, backend.factory())


def test_keyed_api_may_listen_anywhere(tokenizer_dir: Path, backend: ScriptedBackend):
    settings = make_settings(tokenizer_dir)
    settings.controller.host = "0.0.0.0"
    create_app(settings, backend.factory())


def test_keyless_loopback_api_warns_and_serves(
    tokenizer_dir: Path, backend: ScriptedBackend, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.WARNING, logger="dejavu_controller.api.auth"):
        app = create_app(make_settings(tokenizer_dir, keys=()), backend.factory(), tokenizer=tokenizer)
    assert "unauthenticated" in caplog.text
    with TestClient(app) as test:
        assert test.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("128.0.0.1", False),
        ("localhost.example.com", False),
    ],
)
def test_is_loopback(host: str, loopback: bool):
    assert is_loopback(host) is loopback
