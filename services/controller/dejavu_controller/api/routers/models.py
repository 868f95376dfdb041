"""``GET /v1/models``: the one model this deployment serves."""

from __future__ import annotations

from fastapi import APIRouter

from dejavu_controller.api.admission import check_model
from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.schemas.model import ModelCard, ModelList
from dejavu_controller.api.state import Gateway

router = APIRouter(tags=["models"])


def _card(gateway: Gateway) -> ModelCard:
    return ModelCard(id=gateway.model_name, created=gateway.started_at, max_model_len=gateway.max_context)


@router.get("/v1/models", response_model=ModelList)
async def list_models(gateway: GatewayDep) -> ModelList:
    return ModelList(data=[_card(gateway)])


@router.get("/v1/models/{model}", response_model=ModelCard)
async def get_model(model: str, gateway: GatewayDep) -> ModelCard:
    check_model(gateway, model)
    return _card(gateway)
