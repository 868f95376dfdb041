"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` per chunk, ``data: [DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# Proxies (nginx) must not buffer the stream; clients must not cache it.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(chunk: BaseModel, include_usage: bool) -> bytes:
    """One chunk as an SSE event; without ``include_usage`` the ``usage`` field is left out entirely."""
    exclude = None if include_usage else {"usage"}
    return b"data: " + chunk.model_dump_json(exclude=exclude).encode() + b"\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    """An error after the stream has started (the status line is already sent): ``data: {"error": ...}``."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"
