"""The controller's progress watchdog: dispatched work that stops moving while the pipeline is up.

Whatever happens to a dispatched microbatch in the workers ends, within the data plane's deadlines, in
an entry on its token stream: tokens, or an error its requests fail with (a pass lost on the way fails
at stage 0's pass deadline, prompt KV that never completes at the transport deadline; a failed worker
changes the topology, and the repair resumes, re-runs or fails its microbatches). So while a complete
pipeline is up and no repair is running, dispatched requests that receive no entry at all for longer
than those deadlines were lost track of (a worker that forgot its work, a stream nobody writes): the
controller notices, says so once, and ``/ready`` answers 503 (code ``stalled``) until entries flow
again. An idle controller, one without a pipeline, and one repairing never count as stalled.

Pure logic: no I/O, no asyncio. The backend tells it of every relayed entry (:meth:`progressed`) and
asks it at each control loop iteration (:meth:`observe`).
"""

from __future__ import annotations

import logging

log = logging.getLogger("dejavu.controller.progress")

# The stall limit derived from the transport deadline: twice stage 0's pass deadline (6 deadlines), the
# longest any dispatched microbatch waits for an entry while every worker is alive and the data plane
# works (a long prompt's prefill is covered by it too: 120 s with the default 10 s deadline).
DEADLINES_BEFORE_STALL = 12


def stall_limit_s(configured: float | None, transport_deadline_s: float) -> float:
    """The configured stall limit, or :data:`DEADLINES_BEFORE_STALL` transport deadlines."""
    return configured if configured is not None else DEADLINES_BEFORE_STALL * transport_deadline_s


class ProgressWatchdog:
    """Tracks how long dispatched work has gone without an entry on any token stream."""

    def __init__(self, stall_after_s: float) -> None:
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s must be > 0, got {stall_after_s}")
        self.stall_after_s = stall_after_s
        self._since: float | None = None  # when the current wait for an entry began (None: nothing awaited)
        self.stalled_s: float | None = None  # how long it has lasted, once past the limit (as last observed)

    def progressed(self, now: float) -> None:
        """An entry for some dispatched microbatch arrived at ``now``: the wait starts over."""
        if self._since is not None:
            self._since = now

    def observe(self, now: float, awaiting: bool, pipeline_up: bool) -> float | None:
        """Whether the wait is past the limit at ``now``: how long it has lasted then, else None.

        ``awaiting``: some dispatched microbatch has not finished; ``pipeline_up``: a complete pipeline is
        registered and no repair is running. Without both there is nothing to wait for (or the repair's own
        deadlines apply), and the wait starts over once there is. Logs when a stall begins and ends."""
        if not (awaiting and pipeline_up):
            self._since = None
        elif self._since is None:
            self._since = now
        waited = now - self._since if self._since is not None else 0.0
        stalled = waited if waited > self.stall_after_s else None
        if stalled is not None and self.stalled_s is None:
            log.error("dispatched requests have had no token and no error for %.0f s while the pipeline is up "
                      "(limit %.0f s): not ready until work moves again", waited, self.stall_after_s)  # fmt: skip
        elif stalled is None and self.stalled_s is not None:
            log.warning("dispatched work moves again (or none is awaited) after a stall of %.0f s", self.stalled_s)
        self.stalled_s = stalled
        return stalled
