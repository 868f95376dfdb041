"""Completion handles: how a caller learns that an asynchronous transfer finished or failed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dejavulib.errors import TransferTimeout


class Handle:
    """Completes exactly once, with success or with an exception. Thread-safe.

    ``wait`` re-raises the transfer's exception (a ``DejaVuLibError`` subclass) in the waiting thread.
    """

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "deadline", "nbytes")

    def __init__(self, nbytes: int = 0, deadline_s: float | None = None) -> None:
        """``deadline_s`` (seconds from now) bounds ``wait()`` when it is called without a timeout."""
        self.nbytes = nbytes
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Handle], None]] = []

    @classmethod
    def completed(cls, nbytes: int = 0) -> Handle:
        handle = cls(nbytes)
        handle.set_done()
        return handle

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def set_done(self, error: BaseException | None = None) -> None:
        """Complete the handle; later calls are ignored (the first outcome wins)."""
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Handle], None]) -> None:
        """Run ``cb(handle)`` on completion (immediately if already done), on the completing thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until complete; raise its error, or ``TransferTimeout`` if not done within ``timeout_s``
        (default: until the handle's own deadline, or forever if it has none)."""
        if timeout_s is None and self.deadline is not None:
            timeout_s = max(0.0, self.deadline - time.monotonic())
        if not self._done.wait(timeout_s):
            raise TransferTimeout(f"transfer of {self.nbytes} bytes not complete within {timeout_s} s")
        if self._error is not None:
            raise self._error
