"""The gateway's HTTP/1.1 connections: receive deadlines, a cap on idle connections, a cap on requests.

uvicorn's own h11 protocol bounds none of what a client sends before its request is in: a connection
that opens and sends half a header, or a header and half a body, is kept for good (the keep-alive
timer runs only between requests, and any byte cancels it). Its ``limit_concurrency`` counts open
connections, stalled ones included, and answers 503 to every request beyond: a few hundred stalled
sockets make every request, the probes' too, fail. :class:`GatewayProtocol` is uvicorn's
:class:`~uvicorn.protocols.http.h11_impl.H11Protocol` with three additions, all derived from h11's
view of the client's side after each event, so that no uvicorn code is copied:

1. a **header deadline**: a connection whose request header is not in ``header_timeout_s`` after it
   opened (or after the first byte of a request on a kept-alive connection) is closed;
2. a **body deadline**: a request whose body has not ended ``body_timeout_s`` after its header is
   dropped and its connection closed (a whole-body deadline: a body trickled a byte at a time is
   bounded too);
3. a **cap on idle connections**: connections waiting for a request (:data:`IDLE_PHASES`) are
   booked per listener, oldest first; one more than ``max_idle`` closes the oldest. A client that
   sends its request leaves the book within a round trip, so a flood of stalled connections
   evicts itself, not the clients that send requests.

Requests in progress are capped apart (``max_requests``; beyond, 503 with the OpenAI error body and
``Retry-After``) and never count idle connections; the probe paths are neither counted nor refused.
Everything runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Any

import h11
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from dejavu_common.settings import ControllerSettings

from .errors import OVERLOADED, error_body
from .guard import OPEN_PATHS

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a connection is in its request cycle, as the client's side of h11 says."""

    HEADER = "header"  # a request header is awaited or arriving: the header deadline runs
    KEPT_ALIVE = "kept_alive"  # between requests, no byte of the next yet: uvicorn's keep-alive timer runs
    BODY = "body"  # the header is in, the body has not ended: the body deadline runs
    SERVING = "serving"  # the request is in and the app answers it: no receive deadline
    CLOSED = "closed"


#: Phases in which a connection waits for a request: these count against ``max_idle``.
IDLE_PHASES = frozenset({Phase.HEADER, Phase.KEPT_ALIVE})


class CloseReason(enum.StrEnum):
    """Why the gateway closed a connection, as the ``reason`` label of ``dejavu_connections_closed``."""

    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    EVICTED = "evicted"  # the oldest idle connection, closed for a newer one


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of one listener's connections (see the module docstring)."""

    header_timeout_s: float
    body_timeout_s: float
    max_idle: int
    max_requests: int | None  # None: requests are not capped (the probe listener)

    @classmethod
    def of(cls, controller: ControllerSettings) -> ConnectionLimits:
        """The API listener's limits from the controller's settings."""
        return cls(
            header_timeout_s=controller.header_timeout_s,
            body_timeout_s=controller.body_timeout_s,
            max_idle=controller.max_idle_connections,
            max_requests=controller.max_connections,
        )


def connections_closed_counter(registry: CollectorRegistry) -> Counter:
    """The counter of connections closed before their request was in, by :class:`CloseReason`."""
    return Counter(
        "dejavu_connections_closed",
        "Connections the gateway closed before their request was in: a missed header or body deadline, or "
        "evicted as the oldest idle connection.",
        labelnames=["reason"],
        registry=registry,
    )


class ConnectionBook:
    """One listener's idle connections, oldest first, and its count of requests in progress.

    Shared by the protocol instances of that listener; used on the event loop's thread only.
    """

    def __init__(self, limits: ConnectionLimits, closed: Counter | None = None) -> None:
        self.limits = limits
        self.requests = 0
        self._closed = closed
        self._idle: dict[GatewayProtocol, None] = {}  # insertion order: the longest waiting first

    @property
    def idle(self) -> int:
        return len(self._idle)

    def wait(self, connection: GatewayProtocol) -> None:
        """Book ``connection`` as idle (no-op if it is), closing the oldest idle ones beyond ``max_idle``."""
        if connection in self._idle:
            return
        while len(self._idle) >= self.limits.max_idle:
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            oldest.close(CloseReason.EVICTED)
        self._idle[connection] = None

    def leave(self, connection: GatewayProtocol) -> None:
        """``connection`` no longer waits for a request (its request is in, or it closed)."""
        self._idle.pop(connection, None)

    def take_request(self) -> bool:
        """Count one more request in progress; False (nothing counted) when that would pass the cap."""
        if self.limits.max_requests is not None and self.requests >= self.limits.max_requests:
            return False
        self.requests += 1
        return True

    def release_request(self) -> None:
        self.requests -= 1

    def count_closed(self, reason: CloseReason) -> None:
        if self._closed is not None:
            self._closed.labels(reason=reason.value).inc()


class GatewayProtocol(H11Protocol):
    """uvicorn's h11 protocol with the gateway's deadlines and caps (see the module docstring).

    ``book`` is the listener's :class:`ConnectionBook`; ``app`` replaces the config's app (the probe
    listener serves a narrower one). uvicorn builds one instance per connection through a factory
    that binds these two, e.g. ``functools.partial(GatewayProtocol, book=book)``.
    """

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        book: ConnectionBook,
        app: ASGI3Application | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.book = book
        self.phase: Phase | None = None
        self._served_app = app if app is not None else self.app
        self.app = self._admit
        self._deadline: asyncio.TimerHandle | None = None

    # uvicorn's hooks: each ends by deriving the phase from the state it left.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._enter(Phase.CLOSED)

    def handle_events(self) -> None:
        super().handle_events()
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def close(self, reason: CloseReason) -> None:
        """Close this connection before its request is in (a deadline passed, or evicted), counting why."""
        if self.phase is Phase.CLOSED:
            return
        log.debug("closing connection from %s: %s", self.client, reason.value)
        self.book.count_closed(reason)
        self.transport.close()  # connection_lost follows; an app reading the body then sees http.disconnect
        self._enter(Phase.CLOSED)

    def _current_phase(self) -> Phase:
        if self.transport is None or self.transport.is_closing():
            return Phase.CLOSED
        state = self.conn.their_state
        if state is h11.IDLE:
            buffered, _ = self.conn.trailing_data  # bytes of a next request, pipelined behind the last one
            return Phase.KEPT_ALIVE if self.timeout_keep_alive_task is not None and not buffered else Phase.HEADER
        if state is h11.SEND_BODY:
            return Phase.BODY
        return Phase.SERVING

    def _track(self) -> None:
        self._enter(self._current_phase())

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase``: re-arm the deadline and the idle booking. Staying in a phase changes nothing,
        so a header (or body) arriving in pieces has one deadline for all of it."""
        if phase is self.phase or self.phase is Phase.CLOSED:
            return
        self.phase = phase
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        limits = self.book.limits
        if phase is Phase.HEADER:
            self._deadline = self.loop.call_later(limits.header_timeout_s, self.close, CloseReason.HEADER_TIMEOUT)
        elif phase is Phase.BODY:
            self._deadline = self.loop.call_later(limits.body_timeout_s, self.close, CloseReason.BODY_TIMEOUT)
        if phase in IDLE_PHASES:
            self.book.wait(self)
        else:
            self.book.leave(self)

    async def _admit(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        """The app, unless ``max_requests`` requests are in progress (503); the probes are never refused."""
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._served_app(scope, receive, send)
            return
        if not self.book.take_request():
            log.warning("%d requests in progress (controller.max_connections): answered 503", self.book.requests)
            body = error_body("the gateway is at its bound of requests in progress", OVERLOADED, None, "overloaded")
            await JSONResponse(body, status_code=503, headers={"Retry-After": "1"})(scope, receive, send)  # type: ignore[arg-type]
            return
        try:
            await self._served_app(scope, receive, send)
        finally:
            self.book.release_request()
