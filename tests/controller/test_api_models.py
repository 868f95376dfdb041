"""GET /v1/models, /health and /ready."""

from __future__ import annotations

from fastapi.testclient import TestClient

from .conftest import MODEL


def test_models_lists_the_served_model(client: TestClient):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "dejavu"
    assert card["max_model_len"] == 256 and isinstance(card["created"], int)
    assert client.get(f"/v1/models/{MODEL}").json() == card
    error = client.get("/v1/models/other").json()["error"]
    assert error["code"] == "model_not_found"


def test_health_and_ready(client: TestClient):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
