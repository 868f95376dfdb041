"""Log lines of every service: plain text (the default) or one JSON object per line (``log_format: json``).

Every line names its service and, on workers, the worker id. A line written while a request is being handled
names the request too: the gateway binds the request's id (:func:`bind_request`) in the task that serves it, so
everything that task and the tasks it starts log carries it (``contextvars``); code may also pass
``extra={"request_id": ...}`` or ``extra={"mb_id": ...}`` for a line about another request or microbatch.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Any

_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("dejavu_request_id", default=None)
_FIELDS = ("request_id", "mb_id")  # per-line fields a caller may pass with ``extra=``
FORMATS = ("text", "json")


def bind_request(request_id: str) -> contextvars.Token[str | None]:
    """Name ``request_id`` on every line this context logs from now on (undo with :func:`unbind_request`)."""
    return _REQUEST_ID.set(request_id)


def unbind_request(token: contextvars.Token[str | None]) -> None:
    _REQUEST_ID.reset(token)


def current_request() -> str | None:
    return _REQUEST_ID.get()


class _Context(logging.Filter):
    """Puts the service, the worker id and the bound request id on every record."""

    def __init__(self, service: str, worker_id: str | None) -> None:
        super().__init__()
        self.service = service
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        record.worker_id = self.worker_id
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601 with milliseconds), level, logger, message, service,
    worker_id, request_id and mb_id where known, and the exception's traceback where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, Any] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": getattr(record, "service", None),
        }
        for name in ("worker_id", *_FIELDS):
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``time service [worker] logger LEVEL message [request=…] [mb=…]``."""

    def format(self, record: logging.LogRecord) -> str:
        who = " ".join(str(x) for x in (getattr(record, "service", None), getattr(record, "worker_id", None)) if x)
        tags = "".join(
            f" [{label}={getattr(record, name)}]"
            for name, label in (("request_id", "request"), ("mb_id", "mb"))
            if getattr(record, name, None) is not None
        )
        head = f"{self.formatTime(record)} {who} {record.name} {record.levelname} {record.getMessage()}{tags}"
        if record.exc_info:
            head += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            head += "\n" + self.formatStack(record.stack_info)
        return head


def configure(level: str, service: str, worker_id: str | None = None, log_format: str = "text") -> None:
    """Route every logger of this process (libraries' included) to stderr in ``log_format``."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {FORMATS}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_Context(service, worker_id))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
