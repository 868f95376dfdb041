"""``GET /health`` (liveness: the process answers) and ``GET /ready`` (a pipeline can serve).

Both are open (no API key): orchestrators probe them. Neither counts against nor is refused by the
cap on requests in progress, and both are also served on the probe listener (``controller.probe_port``,
see :mod:`dejavu_controller.api.server`), whose connections the API port's load cannot starve.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.errors import ServiceUnavailableError

router = APIRouter(tags=["health"])


class Status(BaseModel):
    status: str


@router.get("/health", response_model=Status)
async def health() -> Status:
    """200 as long as the event loop runs; says nothing about the workers."""
    return Status(status="ok")


@router.get(
    "/ready",
    response_model=Status,
    responses={503: {"description": "No complete pipeline yet, or dispatched requests make no progress."}},
)
async def ready(gateway: GatewayDep) -> Status:
    """200 once ``backend.is_ready()`` while dispatched work makes progress; 503 (OpenAI error body) with
    code ``not_ready`` before, and with code ``stalled`` while the backend reports that dispatched requests
    have had no token and no error for longer than its stall limit (``BackendStats.stalled_s``)."""
    backend = gateway.backend
    if not backend.is_ready():
        raise ServiceUnavailableError("the serving pipelines are not ready", code="not_ready")
    stalled_s = backend.stats().stalled_s
    if stalled_s is not None:
        raise ServiceUnavailableError(
            f"dispatched requests have had no token and no error for {stalled_s:.0f} s while the pipeline is up",
            code="stalled",
        )
    return Status(status="ready")
