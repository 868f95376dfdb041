"""The validation benchmark's reading of the real run: microbatches from first-token times, and the replay order."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.bench_validate import in_admitted_order, microbatches
from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Deployment, Policy
from dejavu_planner.profile import Profile
from dejavu_planner.simulator import simulate
from dejavu_planner.trace import Request, Trace

ProfileFactory = Callable[..., Profile]


def test_requests_with_one_first_token_time_share_a_microbatch() -> None:
    # Two prompt passes 0.9 s apart; request 8 overtook 1, 3, 4, 6 and 7 on its way to the controller,
    # and request 3's first chunk came 0.14 s late (text held back by the gateway).
    first = {0: 2.05, 2: 2.049, 5: 2.048, 8: 2.05, 1: 2.93, 3: 3.07, 4: 2.94, 6: 2.93, 7: 2.93}
    assert microbatches(first) == [frozenset({0, 2, 5, 8}), frozenset({1, 3, 4, 6, 7})]
    assert microbatches({0: 1.0, 1: 1.3}) == [frozenset({0}), frozenset({1})]


def test_the_replay_forms_the_microbatches_the_controller_formed(make_profile: ProfileFactory) -> None:
    # The toy profile: 2 layers, each 1.5 s per prompt and 0.5 s per token step, whatever the batch.
    cost = CostModel(make_profile())
    trace = Trace(tuple(Request(i, i * 0.01, 16, 2 + 3 * i) for i in range(8)))
    admitted = [frozenset({0, 2, 5, 7}), frozenset({1, 3, 4, 6})]
    replay = in_admitted_order(trace, admitted)
    assert [r.rid for r in replay.requests] == [0, 2, 5, 7, 1, 3, 4, 6]
    assert [r.arrival_s for r in replay.requests] == [r.arrival_s for r in trace.requests]
    assert {r.rid: r.new_tokens for r in replay.requests} == {r.rid: r.new_tokens for r in trace.requests}
    deployment = Deployment(Policy.BASELINE, 2, 4)
    result = simulate(deployment, replay, cost, batch_wait_s=0.05)
    assert microbatches({r.rid: r.first_token_s for r in result.requests}) == admitted
    # The grouping alone changes the makespan: the trace's own order pairs the long requests differently.
    in_order = simulate(deployment, trace, cost, batch_wait_s=0.05)
    assert in_order.makespan_s != pytest.approx(result.makespan_s)
