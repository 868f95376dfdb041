"""Serving the gateway with uvicorn, programmatically: the API listener and, if configured, the probe listener.

Both listeners speak through :class:`~.connections.GatewayProtocol` (receive deadlines, a cap on idle
connections), each with a :class:`~.connections.ConnectionBook` of its own. The probe listener
(``controller.probe_port``) serves ``/health`` and ``/ready`` only, from the same app, and caps no
request: however many connections and requests load the API port, an orchestrator's probe finds a
listener whose backlog, idle connections and request count are its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket

import uvicorn
from fastapi.responses import JSONResponse
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope

from dejavu_common.settings import ControllerSettings, Settings

from .app import create_app
from .connections import ConnectionBook, ConnectionLimits, GatewayProtocol, connections_closed_counter
from .errors import NOT_FOUND, error_body
from .guard import OPEN_PATHS
from .state import BackendFactory

log = logging.getLogger(__name__)

#: Idle connections the probe listener keeps: an orchestrator holds one or two.
PROBE_MAX_IDLE = 64


def uvicorn_config(settings: Settings, backend_factory: BackendFactory) -> uvicorn.Config:
    """A uvicorn config for the gateway on ``settings.controller.host``/``port`` (port 0: any free port).

    uvicorn's own ``limit_concurrency`` is left off: it counts idle connections too (see
    :mod:`.connections`), whose :class:`GatewayProtocol` caps requests and idle connections apart.
    """
    app = create_app(settings, backend_factory)
    book = ConnectionBook(
        ConnectionLimits.of(settings.controller), connections_closed_counter(app.state.metrics.registry)
    )
    return uvicorn.Config(
        app,
        host=settings.controller.host,
        port=settings.controller.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # uvicorn's loggers propagate to the process's handler (dejavu_common.logs: text or JSON)
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=functools.partial(GatewayProtocol, book=book),  # type: ignore[arg-type]
        ws="none",  # no route speaks WebSocket: an Upgrade header is ignored, the request served as HTTP
        timeout_keep_alive=settings.controller.keep_alive_s,  # type: ignore[arg-type]  # seconds, for call_later
    )


class GatewayServer(uvicorn.Server):
    """uvicorn's server, plus the probe listener on ``controller.probe_port`` when it is set.

    The probe listener opens once the app's lifespan has started and the API listener listens, and
    closes with it. If it cannot bind, the server does not start: the API listener closes, the
    lifespan shuts down, and ``started`` stays False.
    """

    def __init__(self, config: uvicorn.Config, controller: ControllerSettings) -> None:
        super().__init__(config)
        if controller.probe_port and controller.probe_port == controller.port:
            raise ValueError(f"controller.probe_port must differ from controller.port ({controller.port})")
        self._probe_port_setting = controller.probe_port
        limits = ConnectionLimits.of(controller)
        self._probe_book = ConnectionBook(
            ConnectionLimits(limits.header_timeout_s, limits.body_timeout_s, PROBE_MAX_IDLE, max_requests=None)
        )
        self._probe_listener: asyncio.Server | None = None

    @property
    def probe_port(self) -> int | None:
        """The port the probe listener is bound to (None: no probe listener, or not started)."""
        if self._probe_listener is None or not self._probe_listener.sockets:
            return None
        return self._probe_listener.sockets[0].getsockname()[1]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started or self._probe_port_setting is None:
            return
        app = probes_only(self.config.loaded_app)
        book = self._probe_book

        def protocol() -> GatewayProtocol:
            return GatewayProtocol(self.config, self.server_state, self.lifespan.state, book=book, app=app)

        try:
            self._probe_listener = await asyncio.get_running_loop().create_server(
                protocol, host=self.config.host, port=self._probe_port_setting, backlog=self.config.backlog
            )
        except OSError as exc:
            log.error("the probe listener cannot bind %s:%s: %s", self.config.host, self._probe_port_setting, exc)
            for server in self.servers:
                server.close()
            await self.lifespan.shutdown()
            self.started = False
            self.should_exit = True
            return
        self.servers.append(self._probe_listener)  # uvicorn's shutdown closes and awaits every one
        log.info("probes (/health, /ready) also answered on http://%s:%d", self.config.host, self.probe_port)


def gateway_server(settings: Settings, backend_factory: BackendFactory) -> GatewayServer:
    """The gateway's server: the API listener and, with ``controller.probe_port``, the probe listener."""
    return GatewayServer(uvicorn_config(settings, backend_factory), settings.controller)


def probes_only(app: ASGI3Application) -> ASGI3Application:
    """``app`` restricted to the probe paths: any other path is answered 404 (OpenAI error body)."""

    async def probe_app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            body = error_body("this port answers /health and /ready only", NOT_FOUND, None, "not_found")
            await JSONResponse(body, status_code=404)(scope, receive, send)  # type: ignore[arg-type]
            return
        await app(scope, receive, send)

    return probe_app


def run_api(settings: Settings, backend_factory: BackendFactory) -> None:
    """Serve until SIGINT/SIGTERM (blocks; runs its own event loop). Raises if startup fails."""
    server = gateway_server(settings, backend_factory)
    server.run()
    if not server.started:
        raise RuntimeError("the API server failed to start (see the log above)")
