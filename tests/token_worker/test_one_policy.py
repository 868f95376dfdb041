"""The token stage and the planner's simulator run the very same scheduling policy (issue 31: one policy, pinned)."""

from __future__ import annotations

from dejavu_common import sched
from dejavu_planner import budget as simulated
from dejavu_token_worker import loop, request_stage


def test_the_request_loop_and_the_simulator_share_one_scheduler_class() -> None:
    assert request_stage.Scheduler is simulated.Scheduler is sched.Scheduler
    assert loop.Scheduler is sched.Scheduler
