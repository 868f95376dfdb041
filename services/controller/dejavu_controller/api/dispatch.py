"""Running the :class:`~.generation.Generation` of each choice of one HTTP request (``n`` of them, side by
side), streamed or whole.

Outcome accounting: errors raised before the generation has started are counted by the error
handler; from the moment it has started, the generation counts its own outcome, and
:func:`~.errors.mark_counted` tells the handler not to count it twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence

from pydantic import BaseModel
from starlette.requests import Request

from . import sse
from .disconnect import unless_disconnected
from .errors import ApiError, ServerError, error_body, mark_counted
from .generation import Completion, Generation, TextDelta
from .quota import Lease

log = logging.getLogger(__name__)


async def start(request: Request, generation: Generation) -> None:
    """Charge the generation's tokens to the request's key (:class:`~.quota.Lease`; 429 beyond its
    limit), admit it and wait for its first token; admission errors propagate (-> 503 etc.)."""
    lease: Lease = request.state.lease
    lease.charge(generation)
    await unless_disconnected(request, generation.start())
    mark_counted(request)


async def start_all(request: Request, generations: Sequence[Generation]) -> None:
    """:func:`start` every choice, side by side (each waits for its own first token); if one fails, every
    choice is closed and its error propagates."""
    if len(generations) == 1:
        return await start(request, generations[0])
    results = await asyncio.gather(*(start(request, g) for g in generations), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await close(generations)
        raise failed[0]


async def close(generations: Sequence[Generation]) -> None:
    """Close every choice (idempotent): the ones still running are cancelled in the backend."""
    for generation in generations:
        await generation.close()


async def complete(request: Request, generations: Sequence[Generation]) -> list[Completion]:
    """Every choice's whole answer, in order; cancels them all if the client disconnects while waiting or
    one of them fails (whose error is the request's)."""
    await start_all(request, generations)

    async def collect_all() -> list[Completion]:
        async with asyncio.TaskGroup() as group:  # a failure cancels the other choices (each closes itself)
            tasks = [group.create_task(g.collect()) for g in generations]
        return [t.result() for t in tasks]

    try:
        return await unless_disconnected(request, collect_all())
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    finally:
        await close(generations)


async def deltas(generations: Sequence[Generation]) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """The deltas of every started choice as they come, as ``(choice index, delta)``; a choice's error ends
    them all (raised here). Closing this iterator cancels the choices still running."""
    if len(generations) == 1:
        async for delta in generations[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TextDelta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for delta in generation.deltas():
                queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each choice closes its backend iterator


async def event_stream(
    generations: Sequence[Generation],
    opening: Iterable[BaseModel],
    chunks_of: Callable[[int, TextDelta], Iterable[BaseModel]],
    usage_chunk: Callable[[], BaseModel] | None,
) -> AsyncIterator[bytes]:
    """SSE bytes of the started choices: ``opening`` chunks, the chunks of each delta (``chunks_of(choice
    index, delta)``, as the choices produce them), the usage chunk (if requested), then ``[DONE]``. An error
    mid-stream becomes an error event before ``[DONE]``. Client disconnects cancel this generator, which
    cancels the request."""
    include_usage = usage_chunk is not None
    merged = deltas(generations)
    try:
        for chunk in opening:
            yield sse.event(chunk, include_usage)
        async for index, delta in merged:
            for chunk in chunks_of(index, delta):
                yield sse.event(chunk, include_usage)
        if usage_chunk is not None:
            yield sse.event(usage_chunk(), include_usage)
    except ApiError as exc:
        yield sse.error_event(error_body(exc.message, exc.type, exc.param, exc.code))
    except Exception as exc:  # the status line is sent: the stream must still end cleanly
        log.error("request %s failed mid-stream", generations[0].request.request_id, exc_info=exc)
        error = ServerError("internal server error")
        yield sse.error_event(error_body(error.message, error.type, error.param, error.code))
    finally:
        await merged.aclose()
        await close(generations)
    yield sse.DONE
