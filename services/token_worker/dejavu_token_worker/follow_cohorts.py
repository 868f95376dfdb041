"""The stages after stage 0 of a cohort pipeline (swapping, or request scheduling off): each follows the passes and
releases stage 0's :class:`~dejavu_token_worker.driver.Driver` sends, computing its layers of each pass with its
:class:`~dejavu_token_worker.runner.StageRunner` and handing it on (the last stage samples and publishes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dejavu_token_worker.driver import PASS_DEADLINES
from dejavu_token_worker.runner import STEP_FAILURES, Position, StageRunner
from dejavu_worker.dataplane import Kind, Returned, StageMessage, TokenReturn
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.lifecycle import SERVE_RETRYABLE

log = logging.getLogger("dejavu.token_worker")


class CohortFollower:
    """A stage > 0 of a cohort pipeline at one epoch: ``runner`` computes, ``endpoint`` receives and hands on,
    ``release(microbatch)`` frees what the stage holds of a microbatch stage 0 released. ``deadline_s``: the
    transport deadline (stage 0 fails a pass :data:`PASS_DEADLINES` of them after sending it). ``broken``: the
    message whose handling an error broke here, with when it arrived, handled again first by the next :meth:`run`."""

    def __init__(
        self, runner: StageRunner, endpoint: DataEndpoint, deadline_s: float, release: Callable[[int], None]
    ) -> None:
        self.runner = runner
        self.endpoint = endpoint
        self.deadline_s = deadline_s
        self.release = release
        self.broken: tuple[memoryview | bytes, float] | None = None

    def run(self, pos: Position, stop: Callable[[], bool]) -> None:
        """Follow the passes (and releases) stage 0 sends, until ``stop()``. A message whose handling an error
        broke (:data:`SERVE_RETRYABLE`: Redis refused the last stage's tokens, a send found no room: the pass did
        not get through, since this stage hands it on last) is kept in ``broken``, and the error goes on to the
        lifecycle; when it serves this epoch again, the message is handled again first (a pass runs again from the
        top: it rewrites the same KV and samples the same tokens, from trackers rebuilt from the token streams).
        Past stage 0's pass deadline it is dropped instead: stage 0 has failed it."""
        while not stop():
            broken, self.broken = self.broken, None
            if broken is None:
                payload = self.endpoint.recv(Channel.ACTIVATION, timeout_s=0.05)
                if payload is None:
                    continue
                since = time.monotonic()
            else:
                payload, since = broken
            try:
                msg = StageMessage.decode(payload)
            except ValueError as exc:
                log.error("dropped a malformed stage message: %s", exc)
                continue
            if broken is not None and not self._again(msg, since):
                continue
            try:
                self._handle(pos, msg, payload)
            except SERVE_RETRYABLE:
                self.broken = (payload, since)
                raise

    def _again(self, msg: StageMessage, since: float) -> bool:
        """Whether a message an error broke (received at ``since``) is handled again: not past stage 0's
        pass deadline. A pass that is has its members' trackers rebuilt from their token streams."""
        if time.monotonic() - since > PASS_DEADLINES * self.deadline_s:
            log.warning("dropped the pass of cohort %d broken here: stage 0 has failed it by now", msg.mb_id)
            return False
        for mb, _step, _rows in msg.members:
            state = self.runner.states.get(mb)
            if state is not None:
                state.tracker = None
        log.info("handling again the %s message of cohort %d an error broke here", msg.kind.name, msg.mb_id)
        return True

    def _handle(self, pos: Position, msg: StageMessage, payload: memoryview | bytes) -> None:
        """One message from the previous stage: a release (freed here, then handed on) or a pass."""
        if msg.kind is Kind.RELEASE:
            self.release(msg.mb_id)
            if pos.next_peer is not None:
                self.endpoint.send(pos.next_peer, Channel.ACTIVATION, payload)
            return
        try:
            self.runner.follow(pos, msg)
        except STEP_FAILURES as exc:
            # The pass's values broke the computation here: its members' clients get errors, stage 0
            # frees them along the pipeline, and this stage keeps serving the others.
            for mb, step, _rows in msg.members:
                self.runner.fail(mb, step, exc)
            failed = tuple(Returned(mb, step, (), True) for mb, step, _rows in msg.members)
            self.endpoint.send(pos.first_peer, Channel.TOKENS, TokenReturn(msg.mb_id, failed).encode())
