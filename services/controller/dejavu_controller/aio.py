"""Cancellation that is never lost, and where a task that ignored it waits.

On Python 3.11, ``asyncio.wait_for`` returns the inner operation's result when that operation finishes
in the same turn of the loop as the task is cancelled, and the cancellation is dropped (CPython
gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on ``asyncio.timeout``). redis-py wraps every
command it sends in ``wait_for`` when the client has a socket timeout, which ours always has. A
controller loop cancelled at that moment would go on forever, and shutting the controller down
would hang on it.

The controller's loops therefore call :func:`cancellation_point` once per turn. A task that has been
asked to stop (``Task.cancelling()`` is not zero) stops there even if the ``CancelledError`` never
reached it. ``asyncio.timeout`` keeps that count balanced for its own expiries, so a loop turn that
starts outside any timeout scope sees zero unless someone cancelled the task.
"""

from __future__ import annotations

import asyncio


def cancellation_point() -> None:
    """Raise ``CancelledError`` where the current task was cancelled but the error was swallowed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError(f"{task.get_name()} was cancelled (the CancelledError itself was lost)")


def await_chain(task: asyncio.Task) -> str:
    """Where ``task`` waits: its whole chain of awaits, innermost last, one ``File ..., line ...`` per
    coroutine (``Task.print_stack`` shows only the outermost coroutine)."""
    lines: list[str] = []
    aw: object = task.get_coro()
    while aw is not None:
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None) or getattr(aw, "gi_frame", None)
        if frame is None:
            lines.append(f"  awaiting {aw!r}")
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        aw = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None) or getattr(aw, "gi_yieldfrom", None)
    return "\n".join(lines)
