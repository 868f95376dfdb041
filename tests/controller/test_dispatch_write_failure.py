"""Dispatch when Redis refuses the write (the backend on a real Redis at ``maxmemory``, no workers).

Forming a microbatch and writing it are one step: a microbatch whose spec and prompt task could not be
written is un-formed (its requests back at the head of the queue, its slot free), never left waiting
for tokens no worker will ever produce; once Redis accepts writes again, the requests are dispatched.
"""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import MicrobatchSpec, PromptTask, WorkerInfo, WorkerRole
from dejavu_common.settings import Settings
from dejavu_controller.backend import GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend
from dejavu_controller.request import RequestStatus


def _settings() -> Settings:
    base = Settings()
    return base.model_copy(
        update={
            "controller": base.controller.model_copy(
                update={"token_depth": 1, "token_microbatch": 2, "prompt_microbatch": 2, "batch_wait_ms": 0}
            )
        }
    )


async def _register(r: aioredis.Redis, worker_id: str, role: WorkerRole) -> None:
    info = WorkerInfo(
        worker_id=worker_id, role=role, host="h", pid=1, instance=worker_id, data_address="", torch_threads=1
    )
    await r.hset(keys.worker(worker_id), mapping={"info": info.encode(), "state": "serving", "epoch": 0, "seen": 0})
    await r.sadd(keys.WORKERS, worker_id)
    await r.set(keys.worker_lease(worker_id), "1", px=60_000)


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=4, temperature=0))


async def _oom_errors(r: aioredis.Redis) -> int:
    """Commands Redis refused for memory so far (its own count, from INFO errorstats)."""
    stats = await r.info("errorstats")
    return int(stats.get("errorstat_OOM", {}).get("count", 0))


async def _until(condition, what: str, bound_s: float = 10.0) -> None:
    """Poll an async ``condition`` until it holds; fail naming ``what`` if it never does."""
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while not await condition():
        assert loop.time() < end, f"never happened: {what}"
        await asyncio.sleep(0.01)


def test_a_failed_dispatch_write_unforms_its_microbatch_and_redispatches_it_later(own_redis) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(own_redis.url)
        backend = PipelineBackend(_settings(), r, n_layers=6)
        backend._incarnation = 1
        await _register(r, "p0", WorkerRole.PROMPT)
        await _register(r, "t0", WorkerRole.TOKEN)
        await backend.leadership.acquire()  # topology writes are fenced by the leader lease
        await backend._control_once()  # publishes the topology
        backend._ready = True
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", 1)  # every write that takes memory is refused (OOM)
        first = await backend.generate(_request("first"))
        second = await backend.generate(_request("second"))
        requests = list(backend.scheduler.waiting)
        loop = asyncio.create_task(backend._dispatch_loop())
        try:

            async def refused() -> bool:
                return await _oom_errors(r) > 0

            await _until(refused, "Redis refused the dispatch write")
            async with backend._dispatching:  # between two dispatch attempts
                assert not backend.scheduler.active, "a microbatch stayed formed though its write failed"
                assert backend.scheduler.outstanding_rows == 0
                assert list(backend.scheduler.waiting) == requests  # back at the head, in their order
                assert all(q.status is RequestStatus.QUEUED and q.mb_id is None for q in requests)
                assert not backend._stream_ids

            await r.config_set("maxmemory", 0)

            async def dispatched() -> bool:
                return await r.xlen(keys.PROMPT_QUEUE) > 0

            await _until(dispatched, "the requests were dispatched once Redis accepted writes")
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        # Each request is a microbatch of its own (request scheduling); prompt tasks pack them.
        tasks = [PromptTask.decode(fields[b"task"]) for _, fields in await r.xrange(keys.PROMPT_QUEUE)]
        pieces = [piece.mb_id for task in tasks for piece in task.pieces]
        assert sorted(pieces) == sorted(backend.scheduler.active) == sorted(backend._stream_ids)
        specs = [MicrobatchSpec.decode(await r.get(keys.microbatch(mb))) for mb in sorted(pieces)]
        assert [row.request_id for spec in specs for row in spec.rows] == ["first", "second"]
        assert all(q.status is RequestStatus.SCHEDULED for q in requests)
        await first.aclose()
        await second.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_keys_of_an_unformed_microbatch_are_deleted_in_case_its_write_landed(redis_url) -> None:
    """A connection lost after EXEC leaves the write's outcome unknown: the un-formed microbatch's spec
    is deleted by the next control pass, so a worker that took its prompt task finds no spec and drops it."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)
        backend._incarnation = 1
        await _register(r, "p0", WorkerRole.PROMPT)
        await _register(r, "t0", WorkerRole.TOKEN)
        await backend.leadership.acquire()
        await backend._control_once()
        backend._ready = True
        real_dispatch = backend._dispatch

        async def lands_then_connection_lost(mbs, write_specs=True) -> None:
            await real_dispatch(mbs, write_specs)
            raise redis.ConnectionError("connection lost reading the EXEC reply")

        backend._dispatch = lands_then_connection_lost  # type: ignore[method-assign]
        events = await backend.generate(_request("only"))
        assert not await backend._form_and_write()
        (request,) = backend.scheduler.waiting
        assert request.status is RequestStatus.QUEUED and not backend.scheduler.active
        landed = [k for k in await r.keys(keys.microbatch(0).rsplit(":", 1)[0] + ":*")]
        assert len(landed) == 1
        await backend._control_once()
        assert await r.exists(*landed) == 0
        await events.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
