"""``/dashboard``: the deployment's live status page, its server-sent updates and its admin actions.

- ``GET /dashboard``: the page, one static HTML file with a little vanilla JavaScript (no build step);
- ``GET /dashboard/snapshot``: the current snapshot as JSON (:mod:`dejavu_controller.api.snapshot`);
- ``GET /dashboard/events``: server-sent events, an ``event: snapshot`` about every second, until the
  client leaves or the gateway stops;
- ``POST /dashboard/actions``: ``{"worker_id", "action": "kill" | "pause-heartbeats" | "drain", "seconds"}``
  sends the worker's current instance the Ed25519-signed admin command ``dejavu admin`` sends
  (:mod:`dejavu_common.admin`), over Redis.

Who may: with API keys configured, the keys of the admin role (``controller.admin_key_ids``), presented
as a bearer token or, since a browser opens the page itself, as the password of HTTP Basic auth
(:func:`~dejavu_controller.api.guard.presented_key`); no key or a wrong one is refused 401 by the guard,
another key 403 here. Without API keys (loopback only) the page is open, as the rest of the API. An
action must also come from the page's own origin (a browser sends ``Origin``; another site's is 403).

Actions need the admin signing key: the controller reads it from ``controller.admin_signing_key_file``
(off by default: the key stays with the admin tool, and workers obey whoever holds it). Without that
file the page shows the actions disabled, with the reason.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from dejavu_common import keys
from dejavu_common.admin import AdminKeyError, sign, signing_key
from dejavu_common.messages import AdminAction, WorkerInfo
from dejavu_common.private import UnsafePathError, read_private
from dejavu_common.redis_client import async_client
from dejavu_common.settings import Settings
from dejavu_controller.api.auth import ApiKeyVerifier
from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.errors import (
    INVALID_REQUEST,
    ApiError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
from dejavu_controller.api.guard import presented_key
from dejavu_controller.api.snapshot import Actions, Feed
from dejavu_controller.api.sse import HEADERS as SSE_HEADERS
from dejavu_controller.api.sse import MEDIA_TYPE as SSE_MEDIA_TYPE
from dejavu_controller.api.state import Gateway

log = logging.getLogger(__name__)

#: Seconds between two snapshots on ``/dashboard/events``.
SNAPSHOT_INTERVAL_S = 1.0
#: How long an ``EventSource`` waits before reconnecting to a stream that ended (ms, the SSE ``retry``).
RECONNECT_MS = 2000
_KEY_LINE = "DEJAVU_ADMIN__SIGNING_KEY"
_PAGE = "dashboard.html"


class ForbiddenError(ApiError):
    status = 403
    type = INVALID_REQUEST


class ActionRequest(BaseModel):
    """An admin action for one worker."""

    model_config = ConfigDict(extra="forbid")

    worker_id: str = Field(min_length=1, max_length=128, description="The registered worker to act on.")
    action: AdminAction
    seconds: float | None = Field(
        None, gt=0, description="pause-heartbeats only: how long (at most admin.max_pause_s)."
    )


class ActionSent(BaseModel):
    """The signed command written to the admin stream; the worker carries it out at its next heartbeat."""

    command_id: str
    worker_id: str
    instance: str
    action: AdminAction
    seconds: float
    expires_at: float


def load_signing_key(path: Path) -> str:
    """The admin signing key in ``path``: base64 alone, or a ``DEJAVU_ADMIN__SIGNING_KEY=<base64>`` line (as
    ``dejavu up`` writes it). Raises ``ValueError`` if the file is missing, open to other users or holds no
    well-formed key."""
    try:
        text = read_private(path)
    except (UnsafePathError, OSError) as exc:
        raise ValueError(f"controller.admin_signing_key_file {path}: {exc}") from exc
    if text is None:
        raise ValueError(f"controller.admin_signing_key_file {path} does not exist")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    named = [line.partition("=")[2].strip() for line in lines if line.partition("=")[0].strip() == _KEY_LINE]
    candidates = named or (lines if len(lines) == 1 else [])
    if len(candidates) != 1:
        raise ValueError(
            f"controller.admin_signing_key_file {path} must hold one key: base64 alone or a {_KEY_LINE}= line"
        )
    try:
        signing_key(candidates[0])
    except AdminKeyError as exc:
        raise ValueError(f"controller.admin_signing_key_file {path}: {exc}") from exc
    return candidates[0]


class Dashboard:
    """The page's state in one app: who is an admin, the signing key (if any), and the snapshot feed."""

    def __init__(self, settings: Settings, verifier: ApiKeyVerifier) -> None:
        """Raises ``ValueError`` if ``controller.admin_key_ids`` names no configured key, or if the signing key
        file is configured but unusable (see :func:`load_signing_key`) or does not match ``admin.verify_key``."""
        controller = settings.controller
        unknown = sorted(set(controller.admin_key_ids) - set(verifier.key_ids if verifier.enabled else ()))
        if unknown:
            raise ValueError(f"controller.admin_key_ids names no configured API key: {', '.join(unknown)}")
        self.settings = settings
        self.verifier = verifier
        self.admin_ids = frozenset(controller.admin_key_ids)
        self.signing_key: str | None = None
        self.disabled_reason: str | None = (
            "the controller holds no admin signing key: set DEJAVU_CONTROLLER__ADMIN_SIGNING_KEY_FILE"
        )
        if controller.admin_signing_key_file is not None:
            self.signing_key = load_signing_key(controller.admin_signing_key_file)
            self._check_pair(self.signing_key)
            self.disabled_reason = None
        self.feed = Feed(self.actions)

    def _check_pair(self, key: str) -> None:
        verify = self.settings.admin.verify_key
        if verify is None:
            return
        public = signing_key(key).public_key().public_bytes_raw()
        if base64.b64encode(public).decode() != verify.strip():
            raise ValueError(
                "controller.admin_signing_key_file holds a key that does not match admin.verify_key: "
                "the workers would refuse every action"
            )

    def actions(self) -> Actions:
        return Actions(self.signing_key is not None, self.disabled_reason, self.settings.admin.max_pause_s)

    def authorize(self, request: Request) -> str:
        """The key id of an admin request; raises 401 (no or a wrong key) or 403 (not of the admin role)."""
        key = self.verifier.identify(presented_key(request.url.path, request.headers.get("authorization")))
        if self.verifier.enabled and key not in self.admin_ids:
            raise ForbiddenError(
                "this API key does not have the admin role (controller.admin_key_ids)", code="admin_required"
            )
        return key

    async def send(self, action: ActionRequest, key: str) -> ActionSent:
        """Sign ``action`` for the worker's current instance and write it to the admin stream."""
        if self.signing_key is None:
            raise ForbiddenError(f"admin actions are disabled: {self.disabled_reason}", code="admin_actions_disabled")
        seconds = self._seconds(action)
        try:
            async with async_client(self.settings.redis) as client:
                info = await _registered(client, action.worker_id)
                command = sign(
                    self.signing_key,
                    action.worker_id,
                    info.instance,  # void for any later restart of the worker
                    action.action,
                    seconds=seconds,
                    ttl_s=self.settings.admin.command_ttl_s,
                )
                await client.xadd(keys.ADMIN_STREAM, {"cmd": command.encode()}, maxlen=1000, approximate=True)
        except RedisError as exc:
            raise ServiceUnavailableError(f"Redis did not take the command: {exc}", code="redis_unavailable") from exc
        what = f"{action.action.value}{f' {seconds:g} s' if seconds else ''}"
        log.warning(
            "status page: %s sent to %s by key %s (command %s)", what, action.worker_id, key, command.command_id
        )
        self.feed.record("action", f"{what} sent to {action.worker_id} (command {command.command_id[:8]})")
        return ActionSent(
            command_id=command.command_id,
            worker_id=command.worker_id,
            instance=command.instance,
            action=command.action,
            seconds=command.seconds,
            expires_at=command.expires_at,
        )

    def _seconds(self, action: ActionRequest) -> float:
        if action.action is not AdminAction.PAUSE_HEARTBEATS:
            if action.seconds is not None:
                raise InvalidRequestError(f"{action.action.value} takes no seconds", param="seconds")
            return 0.0
        limit = self.settings.admin.max_pause_s
        if action.seconds is None or action.seconds > limit:
            raise InvalidRequestError(f"pause-heartbeats needs seconds in (0, {limit:g}]", param="seconds")
        return action.seconds


async def _registered(client: aioredis.Redis, worker_id: str) -> WorkerInfo:
    """The registration record of ``worker_id``; 404 if it is not registered (or its record is not its own)."""
    pipe = client.pipeline(transaction=False)
    pipe.sismember(keys.WORKERS, worker_id)
    pipe.hget(keys.worker(worker_id), "info")
    member, raw = await pipe.execute()
    info = None
    if member and raw is not None:
        try:
            info = WorkerInfo.decode(raw)
        except ValueError:
            info = None
    if info is None or info.worker_id != worker_id:
        raise NotFoundError(f"no registered worker {worker_id!r}", param="worker_id", code="worker_not_found")
    return info


def get_dashboard(request: Request) -> Dashboard:
    return request.app.state.dashboard


def require_admin(request: Request) -> str:
    """Dependency of every dashboard route: the caller's key id, if it has the admin role."""
    return get_dashboard(request).authorize(request)


DashboardDep = Annotated[Dashboard, Depends(get_dashboard)]
AdminDep = Annotated[str, Depends(require_admin)]

# Not in the OpenAPI schema: an operator's page, not part of the OpenAI-compatible API (docs/api.md has it).
router = APIRouter(
    prefix="/dashboard", tags=["dashboard"], dependencies=[Depends(require_admin)], include_in_schema=False
)


@router.get("", response_class=HTMLResponse)
async def page() -> HTMLResponse:
    """The status page. Its scripts and styles are allowed by hash alone; no other page may frame it."""
    html, policy = _page()
    headers = {
        "Content-Security-Policy": policy,
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }
    return HTMLResponse(html, headers=headers)


@router.get("/snapshot")
async def snapshot(gateway: GatewayDep, dashboard: DashboardDep) -> JSONResponse:
    """The current snapshot (the shape is in :mod:`dejavu_controller.api.snapshot`)."""
    return JSONResponse(dashboard.feed.snapshot(gateway), headers={"Cache-Control": "no-store"})


@router.get("/events", response_class=StreamingResponse)
async def events(request: Request, gateway: GatewayDep, dashboard: DashboardDep) -> StreamingResponse:
    """Server-sent events: ``event: snapshot`` with the snapshot as ``data``, every ``SNAPSHOT_INTERVAL_S``."""
    return StreamingResponse(_stream(request, gateway, dashboard), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)


@router.post("/actions", response_model=ActionSent)
async def act(action: ActionRequest, request: Request, dashboard: DashboardDep, key: AdminDep) -> ActionSent:
    """Send a worker an admin action (the signed command ``dejavu admin`` sends)."""
    _same_origin(request)
    return await dashboard.send(action, key)


async def _stream(request: Request, gateway: Gateway, dashboard: Dashboard) -> AsyncIterator[bytes]:
    """Snapshots until the client leaves (Starlette then cancels this) or the app's gateway goes away."""
    yield f"retry: {RECONNECT_MS}\n\n".encode()
    sequence = 0
    while request.app.state.gateway is gateway:
        sequence += 1
        yield sse_event("snapshot", dashboard.feed.snapshot(gateway), sequence)
        await asyncio.sleep(SNAPSHOT_INTERVAL_S)


def sse_event(name: str, data: dict[str, Any], event_id: int) -> bytes:
    """One server-sent event: ``event``, ``id`` and a one-line JSON ``data`` field."""
    return f"event: {name}\nid: {event_id}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _same_origin(request: Request) -> None:
    """Refuse (403) an action a browser sends from another site's page: its ``Origin`` is not this host."""
    origin = request.headers.get("origin")
    if origin is None:  # not sent by a browser's cross-site request (curl, scripts): the key is what counts
        return
    if urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower():
        raise ForbiddenError("admin actions are taken only from the status page's own origin", code="cross_origin")


@cache
def _page() -> tuple[str, str]:
    """The page's HTML and the Content-Security-Policy that allows exactly its inline script and style."""
    html = resources.files("dejavu_controller.api").joinpath("static", _PAGE).read_text(encoding="utf-8")
    hashes = {kind: [_csp_hash(body) for body in _inline(html, kind)] for kind in ("script", "style")}
    policy = (
        "default-src 'none'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        f"frame-ancestors 'none'; script-src {' '.join(hashes['script'])}; style-src {' '.join(hashes['style'])}"
    )
    return html, policy


def _inline(html: str, tag: str) -> list[str]:
    return re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)


def _csp_hash(body: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


def install(app: FastAPI, settings: Settings, verifier: ApiKeyVerifier) -> None:
    """Serve the status page on ``app`` (see the module docstring); raises ``ValueError`` as :class:`Dashboard`."""
    app.state.dashboard = Dashboard(settings, verifier)
    app.include_router(router)
