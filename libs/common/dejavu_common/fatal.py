"""Ending a process visibly when one of its background loops dies.

A thread or task that stops on an unexpected exception leaves a process that looks healthy (its lease
may even go on being renewed) but no longer does its job. The rule instead: a background loop survives
the errors it expects (it catches and logs them itself) and anything else ends the whole process, after
logging why, with :data:`EXIT_LOOP_DIED`. The lease then expires, the controller repairs the pipeline,
and a supervisor (the launcher, Compose, Kubernetes) restarts the process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn, ParamSpec

log = logging.getLogger("dejavu.fatal")

EXIT_LOOP_DIED = 70  # EX_SOFTWARE: an internal error, not a configuration or usage error

P = ParamSpec("P")


def _exit(code: int) -> NoReturn:
    """``os._exit``, named so tests can replace it; no clean-up runs (other threads may hold locks)."""
    os._exit(code)


def die(what: str, exc: BaseException | None = None) -> NoReturn:
    """Log that ``what`` failed (with ``exc``'s traceback) and end the process at once."""
    log.critical("%s died: ending the process", what, exc_info=exc)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):  # a broken handler must not keep the process alive
            handler.flush()
    sys.stderr.flush()
    _exit(EXIT_LOOP_DIED)


def guarded(
    what: str, target: Callable[P, None], retry_on: tuple[type[BaseException], ...] = (), pause_s: float = 0.2
) -> Callable[P, None]:
    """``target`` wrapped for use as a thread's body: returning is fine; raising one of ``retry_on``
    (errors the loop outlives, e.g. Redis being restarted) is logged and runs ``target`` again after
    ``pause_s``, so ``target`` must be a loop that can start over; raising anything else ends the process."""

    @functools.wraps(target)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        while True:
            try:
                target(*args, **kwargs)
                return
            except retry_on as exc:
                log.warning("%s failed (%r): starting it again in %.1f s", what, exc, pause_s)
                time.sleep(pause_s)
            except BaseException as exc:  # whatever it is, the loop is gone
                die(what, exc)
                return  # (only reached where a test replaced ``_exit``)

    return run
