"""The app factory: ``create_app(settings, backend_factory)`` builds the OpenAI-compatible gateway.

The lifespan owns the runtime: it loads the tokenizer (off the event loop), enters the backend
factory's context (the backend's Redis pool, its background tasks), publishes the :class:`Gateway`
to the routes, and on shutdown takes it back before exiting the backend. Nothing is global: two
apps in one process are independent (own backend, own metrics registry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import Depends, FastAPI

from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer

from .auth import ApiKeyVerifier
from .dependencies import require_api_key
from .errors import install_error_handler
from .guard import RequestGuard
from .metrics import GatewayMetrics
from .quota import QuotaGate, Quotas
from .routers import chat, completions, dashboard, health, metrics, models, tokenize
from .state import BackendFactory, Gateway

log = logging.getLogger(__name__)


def create_app(settings: Settings, backend_factory: BackendFactory, tokenizer: Tokenizer | None = None) -> FastAPI:
    """Build the gateway app; nothing starts until the ASGI server runs its lifespan.

    Every request passes :class:`~.guard.RequestGuard` first (API key on every path but the probes,
    JSON content type, body-size cap), before its body is read, then, on ``/v1``, its key's limits
    (:class:`~.quota.QuotaGate`), before its body is parsed.

    ``tokenizer`` overrides loading one from ``settings.model.folder`` at startup. Raises
    :class:`~.auth.InsecureExposureError` if ``settings.controller.host`` is not loopback and no
    API keys are configured (on loopback without keys it logs a warning), and ``ValueError`` if
    ``controller.key_limits_by_id`` names the id of no configured key.
    """
    verifier = ApiKeyVerifier(settings.controller.api_keys)
    verifier.check_exposure(settings.controller.host)
    gateway_metrics = GatewayMetrics()
    quotas = Quotas(settings.controller, verifier.key_ids, gateway_metrics.keys)
    log.info("API key ids (the `key` label of the dejavu_key_* metrics): %s", ", ".join(verifier.key_ids))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loaded = tokenizer
        if loaded is None:
            folder = settings.model.folder
            loaded = await anyio.to_thread.run_sync(Tokenizer.from_pretrained, folder)
            log.info("tokenizer loaded from %s", folder)
        async with backend_factory(settings, gateway_metrics.runtime) as backend:
            app.state.gateway = Gateway(settings, backend, loaded, gateway_metrics, int(time.time()))
            gateway_metrics.watch(backend)
            try:
                yield
            finally:
                gateway_metrics.watch(None)
                app.state.gateway = None

    app = FastAPI(
        title="DejaVu",
        description="OpenAI-compatible gateway of a DejaVu deployment (KV-cache streaming LLM serving).",
        version="0.1.0",
        lifespan=lifespan,
        strict_content_type=True,  # RequestGuard already refuses a body that is not declared JSON (415)
    )
    # Inside the guard (added before it, so the guard wraps it): the key is known good by then.
    app.add_middleware(QuotaGate, verifier=verifier, quotas=quotas, metrics=gateway_metrics)
    # Outermost: the key, content type and body size are checked before any other middleware or route.
    app.add_middleware(
        RequestGuard, verifier=verifier, metrics=gateway_metrics, max_body_bytes=settings.controller.max_body_bytes
    )
    app.state.metrics = gateway_metrics
    app.state.verifier = verifier
    app.state.quotas = quotas
    app.state.gateway = None
    install_error_handler(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    keyed = [Depends(require_api_key)]
    app.include_router(models.router, dependencies=keyed)
    app.include_router(completions.router, dependencies=keyed)
    app.include_router(chat.router, dependencies=keyed)
    app.include_router(tokenize.router, dependencies=keyed)
    dashboard.install(app, settings, verifier)  # the status page, for keys of the admin role
    _document_served_model(app, settings.model.name)
    return app


def _document_served_model(app: FastAPI, model: str) -> None:
    """Make the schema say which ``model`` is served: the one value a request's ``model`` may take (a
    client, or a fuzzer generating requests from the schema, learns it from the schema alone)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # kept by FastAPI as app.openapi_schema: edited once, in place
        for component in schema.get("components", {}).get("schemas", {}).values():
            field = component.get("properties", {}).get("model")
            if field is not None and field.get("type") == "string":
                field["enum"] = [model]
        for operation in schema.get("paths", {}).get("/v1/models/{model}", {}).values():
            for parameter in operation.get("parameters", []):
                if parameter.get("name") == "model":
                    parameter["schema"]["examples"] = [model]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
