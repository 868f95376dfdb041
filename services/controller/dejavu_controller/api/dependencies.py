"""FastAPI dependencies: how a route reaches the gateway's state and how ``/v1`` checks keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .auth import ApiKeyVerifier
from .errors import ServiceUnavailableError
from .metrics import GatewayMetrics
from .state import Gateway

_bearer = HTTPBearer(auto_error=False, description="One of the configured API keys.")


def get_gateway(request: Request) -> Gateway:
    """The running gateway; 503 if the lifespan has not built it (startup) or has torn it down."""
    gateway: Gateway | None = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise ServiceUnavailableError("the gateway is starting or stopping", code="not_ready")
    return gateway


def get_metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Raise 401 unless the request carries a configured bearer key (no-op when none are configured)."""
    verifier: ApiKeyVerifier = request.app.state.verifier
    verifier.verify(credentials.credentials if credentials is not None else None)


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]
