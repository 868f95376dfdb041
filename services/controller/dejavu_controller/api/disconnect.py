"""Cancel work whose HTTP client has gone away.

Streaming responses need nothing from here: Starlette cancels the response task when the client
disconnects, and the cancellation reaches :class:`~.generation.Generation`. A non-streaming handler
instead waits for its whole answer; :func:`unless_disconnected` races that wait against the
client's ``http.disconnect`` so the request is cancelled (and its backend slot freed) at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from .errors import ClientDisconnectedError

T = TypeVar("T")


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the ASGI server reports that the client closed the connection.

    Only valid once the request body has been read (FastAPI has read it before the handler runs):
    from then on the server's ``receive`` blocks until ``http.disconnect``.
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientDisconnectedError`.

    ``work`` must clean up on cancellation (a :class:`~.generation.Generation` closes its backend
    iterator). Exceptions of ``work`` propagate unchanged.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this handler itself is cancelled (server shutdown): nothing outlives it.
        for task in (watcher, work_task):
            task.cancel()
        await asyncio.gather(watcher, work_task, return_exceptions=True)
    if work_task.cancelled():  # only the disconnect above cancels it
        raise ClientDisconnectedError("the client closed the connection; the request was cancelled")
    return work_task.result()
