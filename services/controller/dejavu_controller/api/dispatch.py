"""Running a :class:`~.generation.Generation` for one HTTP request, streamed or whole.

Outcome accounting: errors raised before the generation has started are counted by the error
handler; from the moment it has started, the generation counts its own outcome, and
:func:`~.errors.mark_counted` tells the handler not to count it twice.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable

from pydantic import BaseModel
from starlette.requests import Request

from . import sse
from .disconnect import unless_disconnected
from .errors import ApiError, ServerError, error_body, mark_counted
from .generation import Completion, Generation, TextDelta

log = logging.getLogger(__name__)


async def start(request: Request, generation: Generation) -> None:
    """Admit the request and wait for its first token; admission errors propagate (-> 503 etc.)."""
    await unless_disconnected(request, generation.start())
    mark_counted(request)


async def complete(request: Request, generation: Generation) -> Completion:
    """The whole answer; cancels the request if the client disconnects while waiting."""
    await start(request, generation)
    return await unless_disconnected(request, generation.collect())


async def event_stream(
    generation: Generation,
    opening: Iterable[BaseModel],
    chunks_of: Callable[[TextDelta], Iterable[BaseModel]],
    usage_chunk: Callable[[], BaseModel] | None,
) -> AsyncIterator[bytes]:
    """SSE bytes of a started generation: ``opening`` chunks, the chunks of each delta, the usage
    chunk (if requested), then ``[DONE]``. An error mid-stream becomes an error event before
    ``[DONE]``. Client disconnects cancel this generator, which cancels the request."""
    include_usage = usage_chunk is not None
    try:
        for chunk in opening:
            yield sse.event(chunk, include_usage)
        async for delta in generation.deltas():
            for chunk in chunks_of(delta):
                yield sse.event(chunk, include_usage)
        if usage_chunk is not None:
            yield sse.event(usage_chunk(), include_usage)
    except ApiError as exc:
        yield sse.error_event(error_body(exc.message, exc.type, exc.param, exc.code))
    except Exception as exc:  # the status line is sent: the stream must still end cleanly
        log.error("request %s failed mid-stream", generation.request.request_id, exc_info=exc)
        error = ServerError("internal server error")
        yield sse.error_event(error_body(error.message, error.type, error.param, error.code))
    finally:
        await generation.close()
    yield sse.DONE
