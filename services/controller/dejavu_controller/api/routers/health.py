"""``GET /health`` (liveness: the process answers) and ``GET /ready`` (a pipeline can serve).

Both are open (no API key): orchestrators probe them.
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


@router.get("/ready", response_model=Status, responses={503: {"description": "No complete pipeline yet."}})
async def ready(gateway: GatewayDep) -> Status:
    """200 once ``backend.is_ready()``; 503 (OpenAI error body, code ``not_ready``) before."""
    if not gateway.backend.is_ready():
        raise ServiceUnavailableError("the serving pipelines are not ready", code="not_ready")
    return Status(status="ready")
