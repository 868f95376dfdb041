"""Serving the gateway with uvicorn, programmatically."""

from __future__ import annotations

import uvicorn

from dejavu_common.settings import Settings

from .app import create_app
from .state import BackendFactory


def uvicorn_config(settings: Settings, backend_factory: BackendFactory) -> uvicorn.Config:
    """A uvicorn config for the gateway on ``settings.controller.host``/``port`` (port 0: any free port)."""
    app = create_app(settings, backend_factory)
    return uvicorn.Config(
        app,
        host=settings.controller.host,
        port=settings.controller.port,
        log_level=settings.log_level.lower(),
        lifespan="on",
        timeout_graceful_shutdown=5,
        # Connections and in-flight requests beyond this are answered 503 by uvicorn before the app runs.
        limit_concurrency=settings.controller.max_connections,
        timeout_keep_alive=settings.controller.keep_alive_s,
    )


def run_api(settings: Settings, backend_factory: BackendFactory) -> None:
    """Serve until SIGINT/SIGTERM (blocks; runs its own event loop). Raises if startup fails."""
    server = uvicorn.Server(uvicorn_config(settings, backend_factory))
    server.run()
    if not server.started:
        raise RuntimeError("the API server failed to start (see the log above)")
