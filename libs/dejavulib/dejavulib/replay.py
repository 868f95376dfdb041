"""Replay protection of the data plane: each authenticated (sender, epoch, seq) is accepted once.

A sender numbers its messages from a start that grows across restarts (``Endpoint`` starts at the
wall clock in nanoseconds), so a restarted sender with the same id and epoch continues above its
predecessor. The receiver keeps, per (sender, epoch), the highest sequence number seen and the set of
those seen within ``window`` below it: transports may deliver one sender's channels slightly out of
order, so a late message inside the window is accepted once; anything older than the window, or
seen before, is a replay. Only senders whose header MAC verified reach this check, so its memory is
bounded by the deployment's own peers (``forget_before`` drops fenced epochs).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

DEFAULT_WINDOW = 1 << 16


@dataclass
class _Track:
    highest: int
    seen: set[int] = field(default_factory=set)


class ReplayGuard:
    """Thread-safe; see the module docstring."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("the replay window must be at least 1")
        self.window = window
        self._tracks: dict[tuple[str, int], _Track] = {}
        self._lock = threading.Lock()

    def accept(self, sender: str, epoch: int, seq: int) -> bool:
        """True the first time (sender, epoch, seq) is offered, if it is not older than the window."""
        with self._lock:
            track = self._tracks.get((sender, epoch))
            if track is None:
                self._tracks[(sender, epoch)] = _Track(seq, {seq})
                return True
            if seq <= track.highest - self.window or seq in track.seen:
                return False
            track.seen.add(seq)
            if seq > track.highest:
                track.highest = seq
                if len(track.seen) > 2 * self.window:  # prune now and then, not on every message
                    floor = seq - self.window
                    track.seen = {s for s in track.seen if s > floor}
            return True

    def forget_before(self, epoch: int) -> None:
        """Drop the tracks of epochs older than ``epoch`` (their messages are fenced anyway)."""
        with self._lock:
            self._tracks = {k: t for k, t in self._tracks.items() if k[1] >= epoch}
