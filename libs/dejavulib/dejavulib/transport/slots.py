"""A thread-safe store of chunks keyed by (sender id, key), with waiting: the core of slot transports."""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

from dejavulib.errors import TransferTimeout

T = TypeVar("T")


class SlotStore(Generic[T]):
    """Last value per (sender, key); ``get`` waits for a value up to a deadline."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, int], T] = {}
        self._cond = threading.Condition()

    def put(self, sender: str, key: int, value: T) -> None:
        with self._cond:
            self._slots[(sender, key)] = value
            self._cond.notify_all()

    def pop(self, sender: str, key: int) -> None:
        """Forget the value for (sender, key), if any."""
        with self._cond:
            self._slots.pop((sender, key), None)

    def peek(self, sender: str, key: int) -> T | None:
        """The current value for (sender, key), or None; never waits."""
        with self._cond:
            return self._slots.get((sender, key))

    def get(self, sender: str, key: int, deadline_s: float) -> T:
        """The value for (sender, key); ``TransferTimeout`` if none appears within ``deadline_s``."""
        end = time.monotonic() + deadline_s
        with self._cond:
            while (sender, key) not in self._slots:
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no chunk {key} from {sender!r} within {deadline_s} s")
                self._cond.wait(left)
            return self._slots[(sender, key)]
