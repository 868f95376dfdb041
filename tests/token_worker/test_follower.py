"""A later token stage whose pass breaks on an error it outlives (a send past its back-pressure deadline,
Redis refusing the last stage's tokens): the error goes on to the lifecycle, and when the stage serves
the epoch again it handles the broken message again first, with its members' trackers rebuilt from their
token streams, so the pass's tokens are neither lost nor sampled from a tracker that saw them once. A
scripted runner and endpoint stand in for the engine and the data plane."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from dejavu_common.settings import Settings
from dejavu_token_worker.follow_cohorts import CohortFollower
from dejavu_token_worker.runner import Position
from dejavu_worker.dataplane import Kind, StageMessage
from dejavu_worker.endpoint import Channel
from dejavulib.errors import BackPressureTimeout


class Tracked:
    """A microbatch's state on the stage, as far as this test looks: its rows' tracker."""

    def __init__(self) -> None:
        self.tracker: object | None = object()


class Follower:
    """A later stage's runner and endpoint at once: ``follow`` raises each of ``errors`` in turn, then
    succeeds; passes followed, failures and sends are kept."""

    def __init__(self, errors: list[Exception], message: bytes) -> None:
        self.errors = errors
        self.inbox = [message]
        self.followed: list[tuple[int, ...]] = []
        self.failed: list[tuple[int, int]] = []
        self.sent: list[tuple[str, Channel, bytes]] = []
        self.released: list[int] = []
        self.states = {7: Tracked(), 8: Tracked()}

    def follow(self, pos, msg) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.followed.append(tuple(mb for mb, _step, _rows in msg.members))

    def fail(self, mb: int, step: int, error: Exception) -> None:
        self.failed.append((mb, step))

    def recv(self, channel: Channel, timeout_s: float) -> bytes | None:
        return self.inbox.pop(0) if self.inbox else None

    def send(self, peer: str, channel: Channel, payload: bytes) -> None:
        self.sent.append((peer, channel, payload))


def _stage(errors: list[Exception]) -> tuple[CohortFollower, Follower, Callable[[], bool]]:
    message = StageMessage(Kind.DECODE, 1, 0, torch.zeros(3, 1, 4), members=((7, 4, (0, 1)), (8, 2, (0,))))
    stage = Follower(errors, message.encode())
    deadline_s = Settings().transport.deadline_s
    follower = CohortFollower(stage, stage, deadline_s, stage.released.append)  # type: ignore[arg-type]
    # The epoch "changes" (the loop returns) once the stage has nothing left to handle.
    return follower, stage, lambda: not stage.inbox and follower.broken is None


POS = Position(1, 2, None, "t0", colocated=False)


def test_a_pass_a_later_stage_cannot_hand_on_is_handled_again_when_the_epoch_is_served_again() -> None:
    follower, stage, stop = _stage([BackPressureTimeout("no room within 10 s")])
    with pytest.raises(BackPressureTimeout):
        follower.run(POS, stop)  # the error goes on to the lifecycle, which pauses
    assert stage.followed == [] and stage.failed == [] and stage.sent == []
    assert all(s.tracker is not None for s in stage.states.values())
    follower.run(POS, stop)  # the epoch served again
    assert stage.followed == [(7, 8)] and stage.failed == []
    assert all(s.tracker is None for s in stage.states.values())  # rebuilt from the streams as it samples


def test_a_broken_pass_past_stage_0s_deadline_is_dropped_not_run_again() -> None:
    """Stage 0 failed the pass at its deadline meanwhile (a long outage): running it now would only
    publish tokens nobody reads."""
    follower, stage, stop = _stage([BackPressureTimeout("no room within 10 s")])
    with pytest.raises(BackPressureTimeout):
        follower.run(POS, stop)
    assert follower.broken is not None
    payload, _since = follower.broken
    follower.broken = (payload, time.monotonic() - 61 * Settings().transport.deadline_s)
    follower.run(POS, stop)
    assert stage.followed == [] and stage.failed == [] and follower.broken is None
