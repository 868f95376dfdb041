"""HTTP errors of the gateway and the one place that maps every exception to an OpenAI-style error.

Every error response has the body ``{"error": {"message", "type", "param", "code"}}``. The mapping:

==========================================  ======  ===================================
exception                                   status  notes
==========================================  ======  ===================================
:class:`ApiError` (and subclasses)          own     raised by routers, auth, validation
:class:`RateLimitError`                     429     a key's limit; ``Retry-After`` (whole s)
``RequestValidationError`` (bad body/JSON)  400     ``param`` is the offending field
``dejavu_common.errors.ClientError``        own     ``status`` of the error (4xx)
``backend.QueueFullError``                  503     with ``Retry-After`` (whole seconds)
``backend.NotReadyError``                   503     no complete pipeline yet
``dejavu_common.errors.DeadlineExceeded``   504     a deadline inside the runtime
``dejavu_common.errors.RetryableError``     503     with ``Retry-After: 1``
``StarletteHTTPException`` (404/405 ...)    own     unknown route or method
anything else                               500     logged with its traceback
==========================================  ======  ===================================
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dejavu_common.errors import ClientError, DeadlineExceeded, RetryableError
from dejavu_controller.backend import NotReadyError, QueueFullError

from .schemas.common import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"
TIMEOUT = "timeout_error"

# The status nginx uses for "client closed the request"; nobody reads it, it only labels logs.
CLIENT_CLOSED_REQUEST = 499


class ApiError(Exception):
    """An error the gateway answers with ``status`` and an OpenAI-style body."""

    status = 500
    type = SERVER_ERROR

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class InvalidRequestError(ApiError):
    status = 400
    type = INVALID_REQUEST


class UnauthorizedError(ApiError):
    status = 401
    type = INVALID_REQUEST  # what OpenAI answers for a missing or wrong key

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class NotFoundError(ApiError):
    status = 404
    type = INVALID_REQUEST


class RateLimitError(ApiError):
    """A key's limit is reached: HTTP 429 in OpenAI's shape (``type`` names the kind of limit, ``requests``
    or ``tokens``; ``code`` ``rate_limit_exceeded``) with ``Retry-After`` in whole seconds, at least 1.
    ``retry_after_s`` None: waiting does not help (a request larger than the limit itself), no header."""

    status = 429

    def __init__(self, message: str, *, kind: str, retry_after_s: float | None) -> None:
        headers = {} if retry_after_s is None else {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
        super().__init__(message, code="rate_limit_exceeded", headers=headers)
        self.type = kind


class ServiceUnavailableError(ApiError):
    status = 503
    type = OVERLOADED


class GatewayTimeoutError(ApiError):
    status = 504
    type = TIMEOUT


class ServerError(ApiError):
    status = 500
    type = SERVER_ERROR


class ClientDisconnectedError(ApiError):
    """The client went away before its answer was ready; the request was cancelled."""

    status = CLIENT_CLOSED_REQUEST
    type = INVALID_REQUEST


def mark_counted(request: Request) -> None:
    """From now on the request's generation counts its outcome; :func:`handle_error` must not."""
    request.state.outcome_counted = True


def is_counted(request: Request) -> bool:
    return bool(getattr(request.state, "outcome_counted", False))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body as a JSON-ready dict."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


def _as_api_error(exc: Exception) -> ApiError:
    """Translate any exception into the :class:`ApiError` the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    if isinstance(exc, QueueFullError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return ServiceUnavailableError(str(exc), code="queue_full", headers={"Retry-After": retry_after})
    if isinstance(exc, NotReadyError):
        return ServiceUnavailableError(str(exc) or "the serving pipelines are not ready", code="not_ready")
    if isinstance(exc, ClientError):
        invalid = InvalidRequestError(str(exc), param=exc.param)
        invalid.status = exc.status
        return invalid
    if isinstance(exc, DeadlineExceeded):
        return GatewayTimeoutError(str(exc) or "a deadline expired", code="deadline_exceeded")
    if isinstance(exc, RetryableError):
        return ServiceUnavailableError(str(exc), code="retryable", headers={"Retry-After": "1"})
    if isinstance(exc, StarletteHTTPException):
        error = ApiError(str(exc.detail), code=None, headers=dict(exc.headers or {}))
        error.status = exc.status_code
        error.type = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return error
    return ServerError("internal server error")


# Pydantic names the member of a union that failed in the error's location (``prompt.list[int]``);
# such a tag is a type, never one of our field names.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")


def _split_location(loc: tuple[Any, ...]) -> tuple[str | None, str | None]:
    """``(field path, union member tag)`` of a validation error location, without the ``body`` root."""
    parts: list[str] = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and _UNION_TAG.match(part):
            return ".".join(parts) or None, part
        parts.append(str(part))
    return ".".join(parts) or None, None


def _validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """The first validation error as a 400, naming the field (``messages.0.role``) as ``param``."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return InvalidRequestError(f"malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    param, tag = _split_location(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if tag is not None:  # say which types would do instead of why the first one did not
        tags = {
            t for e in errors if (split := _split_location(tuple(e.get("loc", ()))))[0] == param and (t := split[1])
        }
        message = f"invalid value; expected one of: {', '.join(sorted(tags))}"
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)


async def handle_error(request: Request, exc: Exception) -> JSONResponse:
    """The one exception handler: every error of every route goes through here."""
    error = _as_api_error(exc)
    if isinstance(error, ServerError) and not isinstance(exc, ApiError):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    if request.url.path.startswith("/v1/") and not is_counted(request):  # probes are not requests
        request.app.state.metrics.count_rejection(error.status)
    return JSONResponse(
        status_code=error.status,
        content=error_body(error.message, error.type, error.param, error.code),
        headers=error.headers,
    )


def install_error_handler(app: FastAPI) -> None:
    """Route every exception class of the taxonomy to :func:`handle_error`."""
    for exc_class in (
        ApiError,
        RequestValidationError,
        StarletteHTTPException,
        QueueFullError,
        NotReadyError,
        ClientError,
        RetryableError,
        Exception,
    ):
        app.add_exception_handler(exc_class, handle_error)
