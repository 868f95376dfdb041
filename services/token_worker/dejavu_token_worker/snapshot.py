"""What a token stage reports holding: the KV its heartbeat counts (:func:`kv_held`) and the snapshot its metrics
scrape (:func:`stage_snapshot`), read on other threads than the one computing, from snapshots of the books (taken
without their locks) and the pools' counts (each under its own lock, held for a count)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, replace

import redis

from dejavu_common import keys
from dejavu_common.sched import BlockBook, Scheduler
from dejavu_token_worker.driver import Driver
from dejavu_token_worker.replication import ReplicaStore
from dejavu_token_worker.request_stage import RequestStage
from dejavu_token_worker.runner import StageRunner
from dejavu_worker.metrics import Occupancy, PoolUsage, PrefixCacheStats, StageSnapshot
from dejavu_worker.microbatch import KVStatus

log = logging.getLogger("dejavu.token_worker")


def occupancy(scheduler: Scheduler) -> Occupancy:
    """Requests holding blocks (running) and queued for their first pass (waiting)."""
    running, waiting = len(scheduler.running), len(scheduler.waiting)
    return Occupancy(running, running, waiting, waiting)


def pool_usage(book: BlockBook) -> PoolUsage:
    """Blocks referenced by requests now, of the pool's."""
    return PoolUsage(book.num_blocks - book.free, book.num_blocks)


def prefix_cache(book: BlockBook) -> PrefixCacheStats:
    """The prefix cache's figures now (counts only)."""
    stats = book.stats()
    return PrefixCacheStats(stats.queries, stats.hits, stats.shared, stats.cached_free)


def stage_kv_held(
    runner: StageRunner | None, replica: ReplicaStore | None, requests: RequestStage | None
) -> tuple[int, int]:
    """(bytes, microbatches or requests) of KV a stage holds: caches, replicas (those in memory), a
    request-scheduled stage's blocks and arrived prompt KV (what memory accounting checks)."""
    caches = [st.cache for st in list(runner.states.values())] if runner is not None else []
    if replica is not None:
        caches += replica.memory_caches()  # a replica on disk holds no memory
    held, count = sum(c.nbytes for c in caches), len(caches)
    if requests is not None:
        more, n = requests.kv_held()
        held, count = held + more, count + n
    return held, count


def stage_snapshot(
    base: StageSnapshot,
    runner: StageRunner | None,
    replica: ReplicaStore | None,
    driver: Driver | None,
    requests: RequestStage | None,
    client: redis.Redis | None,
    replicates_requests: bool,
) -> StageSnapshot:
    """``base`` with what the stage holds now (see :class:`StageSnapshot`): the runner's, the replica store's, the
    driver's or the request-scheduled stage's books, the pools' and the swap manager's counts, and the watermarks of
    the stage's replicas (one Redis read, where it replicates: ``runner.replicas``, or ``replicates_requests``)."""
    if runner is None:
        return base
    states = list(runner.states.values())
    pools: dict[str, PoolUsage] = {}
    if runner.pool is not None:
        pools["stage"] = PoolUsage(runner.pool.used_blocks, runner.pool.max_blocks)
    loop = requests.loop if requests is not None else None
    if loop is not None:
        pools["stage"] = pool_usage(loop.scheduler.book)
    if replica is not None and replica.pool is not None:
        pools["replica"] = PoolUsage(replica.pool.used_blocks, replica.pool.max_blocks)
    preempted = [st.cache.nbytes for st in states if st.status is KVStatus.PREEMPTED]
    replicating = (runner.replicas is not None or replicates_requests) and base.stage is not None
    # What the stage holds, as its successor's watermarks count it: per microbatch its last step, per request of a
    # request-scheduled pipeline its last position.
    held = requests.held() if requests is not None else {st.mb_id: st.done_step for st in states if st.holds_kv}
    return replace(
        base,
        microbatches=len(states),
        occupancy=driver.occupancy() if driver is not None else occupancy(loop.scheduler) if loop is not None else None,
        pools=pools,
        host_bytes=sum(preempted) if runner.pool is not None else None,
        replicas=len(replica.replicas) if replica is not None else None,
        replication_lag_steps=replication_lag(client, base.stage, held) if replicating else None,
        swap=asdict(runner.swap.stats()) if runner.swap is not None else None,
        prefix_cache=prefix_cache(loop.scheduler.book) if loop is not None else None,
    )


def replication_lag(client: redis.Redis | None, stage: int, held: dict[int, int]) -> int | None:
    """The largest gap between what stage ``stage`` holds of a microbatch or request (``held``: its last step or
    position) and the watermark its successor recorded for it (-1 when none); None when Redis cannot be read now."""
    assert client is not None
    try:
        raw = client.hgetall(keys.watermark(stage))
    except redis.RedisError as exc:
        log.warning("replication lag not read: %s", exc)
        return None
    marks = {}
    for mb, step in raw.items():  # any worker may write these: a field that does not parse is skipped
        with contextlib.suppress(ValueError):
            marks[int(mb)] = int(step)
    return max((last - marks.get(mb, -1) for mb, last in held.items()), default=0)
