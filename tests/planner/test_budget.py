"""Per-request passes under a token budget in the simulator: the policy object itself, the pass costs, chunked
prefill keeping streams going, the pool's limits, and DejaVu's prompt pipeline reserving token-side blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dejavu_common.sched import Scheduler
from dejavu_planner.budget import BudgetSimulator, pass_stage_time, pool_blocks
from dejavu_planner.costmodel import CostModel
from dejavu_planner.deployment import Batching, Deployment, Policy
from dejavu_planner.profile import Profile
from dejavu_planner.simulator import simulate
from dejavu_planner.trace import Trace, lmsys_like_trace, uniform_trace


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(Profile.load(Path("smollm2-135m-cpu-1thread")))


def colocated(budget: int = 512, max_running: int = 16, depth: int = 1, kv_blocks: int = 0) -> Deployment:
    return Deployment(
        Policy.BASELINE, depth, 1, batching=Batching.BUDGET, max_running=max_running, token_budget=budget,
        kv_blocks=kv_blocks,
    )  # fmt: skip


def test_the_simulator_runs_the_one_scheduling_policy(cost: CostModel) -> None:
    sim = BudgetSimulator(colocated(), uniform_trace(2, 64, 4), cost)
    assert type(sim.scheduler) is Scheduler


def test_a_chunk_costs_its_share_of_the_prompt_and_decodes_cost_one_token_step(cost: CostModel) -> None:
    from dejavu_common.sched import BlockBook, Budget, RequestState

    sched = Scheduler(BlockBook(1000, 16), Budget(tokens=4096, max_running=8))
    sched.add(RequestState("p", [0] * 1000, 1000, 4))
    whole = sched.schedule().slices
    layers = cost.layers
    assert pass_stage_time(cost, layers, whole, last=False) == pytest.approx(
        cost.prompt_stage_time(layers, 1, 1000, False)
    )
    sched2 = Scheduler(BlockBook(1000, 16), Budget(tokens=256, max_running=8))
    sched2.add(RequestState("p", [0] * 1000, 1000, 4))
    chunks = []
    while True:
        step = sched2.schedule()
        chunks.append(pass_stage_time(cost, layers, step.slices, last=False))
        sched2.update(step, {"p": 0} if step.slices[0].samples else {})
        if step.slices[0].samples:
            break
    assert len(chunks) == 4 and sum(chunks) == pytest.approx(cost.prompt_stage_time(layers, 1, 1000, False))
    assert chunks[-1] < chunks[0] * 1.5 and chunks[1] >= chunks[0] * 0.99  # later chunks attend over more


def test_every_request_finishes_and_its_blocks_return(cost: CostModel) -> None:
    trace = lmsys_like_trace(60, 300, rate_per_s=4.0, seed=3)
    sim = BudgetSimulator(colocated(budget=256, kv_blocks=200), trace, cost)
    result = sim.run()
    assert len(result.requests) == 60
    assert all(r.first_token_s >= r.arrival_s and r.finish_s >= r.first_token_s for r in result.requests)
    assert sim.scheduler.book.free == 200 and not len(sim.scheduler)


def test_chunked_prefill_keeps_running_streams_going_past_a_long_prompt(cost: CostModel) -> None:
    # Four short requests stream; a 2,000-token prompt arrives. A small budget splits it into chunks and the
    # streams get a token from every pass; a budget that takes it whole stalls them for its whole prefill.
    rows = [(0.0, 32, 200) for _ in range(4)] + [(1.0, 2000, 4)]

    def worst_tpot(budget: int) -> float:
        result = simulate(colocated(budget=budget), Trace.of(rows), cost, record_timeline=True)
        passes = sorted(s.end_s - s.start_s for s in result.timeline)
        return passes[-1]

    assert worst_tpot(128) < worst_tpot(4096) / 4


def test_dejavu_reserves_token_blocks_before_its_prompt_pipeline_runs(cost: CostModel) -> None:
    d = Deployment(
        Policy.DEJAVU, 1, 1, token_depth=2, batching=Batching.BUDGET, max_running=8, token_budget=1024, kv_blocks=80
    )
    trace = uniform_trace(20, 300, 16, rate_per_s=8.0)
    sim = BudgetSimulator(d, trace, cost, record_timeline=True)
    result = sim.run()
    assert len(result.requests) == 20 and sim.scheduler.book.free == 80
    # 80 blocks of 16 hold 4 requests of 316 positions: the prompt pipeline waits for the token side's room.
    prompt_passes = [s for s in result.timeline if s.pipeline == "prompt" and s.stage == 0]
    assert max(s.rows for s in prompt_passes) <= 3


def test_budgeted_passes_are_refused_where_they_do_not_run(cost: CostModel) -> None:
    with pytest.raises(ValueError, match="budgeted passes"):
        Deployment(Policy.FASTER_TRANSFORMER, 2, 1, batching=Batching.BUDGET)
    with pytest.raises(ValueError, match="budgeted passes"):
        Deployment(Policy.BASELINE, 1, 1, replicas=2, batching=Batching.BUDGET)
    with pytest.raises(ValueError, match="token_budget"):
        Deployment(Policy.BASELINE, 1, 1, batching=Batching.BUDGET, token_budget=0)
    assert pool_blocks(cost, 1, 16) > 100
