"""``GET /metrics``: the app's Prometheus registry in the text exposition format (keyed like ``/v1``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from dejavu_controller.api.dependencies import MetricsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(registry: MetricsDep) -> Response:
    return Response(content=registry.render(), media_type=CONTENT_TYPE_LATEST)
