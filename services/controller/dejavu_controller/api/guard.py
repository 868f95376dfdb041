"""The gate in front of every route: key, content type and body size, checked before the app runs.

:class:`RequestGuard` is a pure ASGI middleware, so it decides from the request line and headers
alone, before a byte of the body is read:

1. with API keys configured, every path except the liveness/readiness probes (``/health``,
   ``/ready``) needs ``Authorization: Bearer <key>``: ``/v1``, ``/metrics``, ``/docs``, ``/redoc`` and
   ``/openapi.json`` alike. A request without one is answered 401 and its body is never read. The
   status page (``/dashboard...``), which a browser opens, also takes the key as the password of HTTP
   Basic auth, and its 401 asks for that (``WWW-Authenticate: Basic``);
2. a request that carries a body must say ``Content-Type: application/json`` (415 otherwise): a
   browser page cannot post such a request cross-origin without a CORS preflight, which we never
   grant, so a keyless loopback API cannot be driven by a web page;
3. a ``Content-Length`` over ``controller.max_body_bytes`` is answered 413 at once; a body sent
   without one (chunked) is read up to the cap and answered 413 as soon as it passes it.

The body of an admitted request is read here, at most the cap, and replayed to the app as one
message; later ``receive`` calls go to the server, so the routes still see ``http.disconnect``. A
request whose connection ends before its body does (the client left, or the server's body deadline
closed it) never reaches the app.
Every refusal has an OpenAI error body and, for ``/v1`` paths, counts as a rejection in the metrics.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from .auth import ApiKeyVerifier
from .errors import INVALID_REQUEST, ApiError, InvalidRequestError, error_body
from .metrics import GatewayMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Paths an orchestrator probes without credentials; they reveal nothing but "up" and "ready".
OPEN_PATHS = frozenset({"/health", "/ready"})
#: The status page's paths: a browser opens them, so they also take the key as HTTP Basic auth's password.
BROWSER_PATH = "/dashboard"
BASIC_CHALLENGE = 'Basic realm="DejaVu dashboard", charset="UTF-8"'
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class PayloadTooLargeError(ApiError):
    status = 413
    type = INVALID_REQUEST


class UnsupportedMediaTypeError(ApiError):
    status = 415
    type = INVALID_REQUEST


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def basic_password(authorization: str | None) -> str | None:
    """The password of an ``Authorization: Basic <base64(user:password)>`` header value (any user name), else
    None: how a browser sends what it asked its user for."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


def is_browser_path(path: str) -> bool:
    """Whether ``path`` is the status page's (``/dashboard`` and below), which a browser opens itself."""
    return path == BROWSER_PATH or path.startswith(BROWSER_PATH + "/")


def presented_key(path: str, authorization: str | None) -> str | None:
    """The API key a request presents: its bearer token, or on the browser's paths the password of HTTP
    Basic auth (a browser cannot add a bearer header to a page it opens, but asks for Basic credentials)."""
    token = bearer_token(authorization)
    if token is None and is_browser_path(path):
        token = basic_password(authorization)
    return token


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (``application/json``, parameters such as charset allowed)."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


class RequestGuard:
    """See the module docstring. Wraps ``app``; only ``http`` scopes are checked (lifespan passes through)."""

    def __init__(self, app: ASGIApp, verifier: ApiKeyVerifier, metrics: GatewayMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.verifier = verifier
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            self._check_headers(scope, headers)
            body = await self._read_body(receive, headers)
        except ApiError as error:
            await self._refuse(scope, receive, send, error)
            return
        if body is None:  # the client left, or missed the body deadline, before its body ended: nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope, headers: dict[str, str]) -> None:
        """Raise the :class:`ApiError` that refuses this request from its path and headers, if any."""
        if scope["path"] not in OPEN_PATHS:
            self.verifier.verify(presented_key(scope["path"], headers.get("authorization")))
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _bad_length(length)
            if int(length) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
        has_body = (length is not None and int(length) > 0) or "transfer-encoding" in headers
        if (scope["method"] in _BODY_METHODS or has_body) and not is_json(headers.get("content-type")):
            raise UnsupportedMediaTypeError(
                "the request body must be JSON: send 'Content-Type: application/json'", code="unsupported_media_type"
            )

    async def _read_body(self, receive: Receive, headers: dict[str, str]) -> bytes | None:
        """The whole body, refused (413) as soon as it passes the cap: never more than cap + one chunk held.
        None if the connection ends first: a partial body is never handed to the app as a whole one."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        if scope["path"].startswith("/v1/"):
            self.metrics.count_rejection(error.status)
        # Close the connection: the server then discards whatever of the body the client still sends.
        headers = {**error.headers, "Connection": "close"}
        if error.status == 401 and is_browser_path(scope["path"]):  # the browser asks its user for the key
            headers["WWW-Authenticate"] = BASIC_CHALLENGE
        response = JSONResponse(
            error_body(error.message, error.type, error.param, error.code), status_code=error.status, headers=headers
        )
        await response(scope, receive, send)


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the request body is larger than {limit} bytes", code="request_too_large")


def _bad_length(value: str) -> ApiError:
    return InvalidRequestError(f"invalid Content-Length {value[:32]!r}", code="invalid_content_length")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that first returns ``body`` as one message, then defers to the server's."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
