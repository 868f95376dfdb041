"""What a token stage records in its metrics: stage 0's running and waiting rows as the driver schedules them
(the scripted pipeline of test_driver), and preemptions as its paged pool makes room (real Redis, a real
block pool, the runner of test_paged_runner)."""

from __future__ import annotations

import redis
from prometheus_client.parser import text_string_to_metric_families

from dejavu_common import keys
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_token_worker.driver import Driver
from dejavu_token_worker.runner import Position, StageRunner
from dejavu_worker.metrics import Occupancy, WorkerMetrics
from dejavulib.paged import BlockGeometry, BlockPool
from tests.token_worker.test_driver import Pipeline, Ready, _spec
from tests.token_worker.test_paged_runner import Stage, _two_prompts_in


class Watched(Pipeline):
    """The scripted pipeline, noting the driver's occupancy as each pass starts (what a scrape would read)."""

    driver: Driver | None = None
    seen: list[Occupancy]

    def run(self, pos, members, kind, io, cohort=-1, next_mb=None):
        assert self.driver is not None
        self.seen.append(self.driver.occupancy())
        return super().run(pos, members, kind, io, cohort, next_mb)


def test_stage_0_reports_running_and_waiting_rows_as_microbatches_join_and_leave() -> None:
    rows, finish = {1: 2, 2: 3}, {1: 5, 2: 3}
    p = Watched(1, finish, {mb: _spec(mb, n) for mb, n in rows.items()})
    p.seen = []
    pos = Position(0, 1, None, "t0", colocated=False)
    # Two rows a cohort: microbatch 2 (3 rows) waits while microbatch 1 (2 rows) runs.
    p.driver = Driver(p, p, None, "t0", pos, Ready(p, [(1, 0), (2, 2)]), 1.0, max_running=2)  # type: ignore[arg-type]
    rounds = iter(range(10_000))
    p.driver.run(lambda: set(p.released) >= set(rows) or next(rounds) >= 9_999)
    assert p.seen[0] == Occupancy(running_rows=2, running_microbatches=1, waiting_rows=0, waiting_microbatches=0)
    assert p.seen[3] == Occupancy(running_rows=2, running_microbatches=1, waiting_rows=3, waiting_microbatches=1)
    assert p.seen[-1] == Occupancy(running_rows=3, running_microbatches=1, waiting_rows=0, waiting_microbatches=0)
    assert p.driver.occupancy() == Occupancy(0, 0, 0, 0)  # both left


def _preemptions(metrics: WorkerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.labels["mode"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "dejavu_preemptions"
        for s in f.samples
        if s.name == "dejavu_preemptions_total"
    }


def _runner(redis_url: str, metrics: WorkerMetrics) -> tuple[StageRunner, redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    pool = BlockPool(BlockGeometry.of(Stage().kv_layout(1, 1), block_size=4), max_blocks=6, slab_blocks=2)
    row = RowSpec(request_id="r", prompt_ids=(1,) * 4, sampling=SamplingSpec(max_tokens=8, seed=0))
    for mb in (1, 2):
        client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row, row), prompt_len=4, max_len=12).encode())
    return StageRunner(Stage(), client, None, 1.0, pool=pool, metrics=metrics), client  # type: ignore[arg-type]


def test_a_full_pool_counts_a_swap_preemption_and_past_the_host_budget_a_recompute_one(redis_url: str) -> None:
    metrics = WorkerMetrics("t0", "token")
    runner, client = _runner(redis_url, metrics)
    _one, two = _two_prompts_in(runner)
    runner._in_pass = {2}
    runner._acquire(two, 7, (0, 1))
    assert _preemptions(metrics) == {"swap": 0, "recompute": 0}  # room enough: nothing moved
    runner._acquire(two, 11, (0, 1))  # microbatch 1 goes to host memory
    assert _preemptions(metrics) == {"swap": 1, "recompute": 0}
    client.close()

    metrics = WorkerMetrics("t0", "token")
    runner, client = _runner(redis_url, metrics)
    runner.host_budget = 1  # no host memory to spare: the cache is discarded, to be recomputed
    _one, two = _two_prompts_in(runner)
    runner._in_pass = {2}
    runner._acquire(two, 7, (0, 1))
    runner._acquire(two, 11, (0, 1))
    assert _preemptions(metrics) == {"swap": 0, "recompute": 1}
    client.close()
