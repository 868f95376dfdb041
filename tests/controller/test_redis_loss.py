"""The controller when Redis restarts empty (the backend on a real Redis, no workers, no model).

The topology it published vanishes with everything else: it fails the dispatched work to its clients
with an error, keeps the waiting requests, recreates the queues' consumer groups, and publishes a fresh
pipeline (no recovery order, an epoch above anything a worker has seen) once the workers are back.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis

from dejavu_common import fatal, keys
from dejavu_common.messages import WorkerInfo, WorkerRole
from dejavu_common.settings import Settings
from dejavu_controller.backend import FinishReason, GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend


def _settings() -> Settings:
    base = Settings()
    return base.model_copy(
        update={
            "controller": base.controller.model_copy(
                update={"token_depth": 1, "token_microbatch": 1, "prompt_microbatch": 1}
            )
        }
    )


async def _register(r: aioredis.Redis, worker_id: str, role: WorkerRole, seen: int) -> None:
    info = WorkerInfo(
        worker_id=worker_id, role=role, host="h", pid=1, instance=worker_id, data_address="", torch_threads=1
    )
    await r.hset(
        keys.worker(worker_id), mapping={"info": info.encode(), "state": "serving", "epoch": seen, "seen": seen}
    )
    await r.sadd(keys.WORKERS, worker_id)
    await r.set(keys.worker_lease(worker_id), "1", px=60_000)


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=4, temperature=0))


def test_redis_restarted_empty_fails_dispatched_work_keeps_waiting_and_starts_a_fresh_pipeline(redis_url) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)
        backend._incarnation = 5
        await r.set(keys.INCARNATION, 5)
        await _register(r, "p0", WorkerRole.PROMPT, 0)
        await _register(r, "t0", WorkerRole.TOKEN, 0)
        await backend._control_once()  # publishes the first topology
        first = backend.registry.topology
        assert first is not None
        backend._ready = True  # (the workers' records are not at the published epoch)
        dispatched = await backend.generate(_request("dispatched"))
        (mb,) = backend.scheduler.form(now=1e9)
        await backend._dispatch([mb])
        waiting = await backend.generate(_request("waiting"))

        await r.flushall()  # Redis restarted empty; the workers register again, having seen epoch 9
        await backend._control_once()
        assert [ev.finish_reason async for ev in dispatched] == [FinishReason.ERROR]
        assert not backend.scheduler.active and backend.scheduler.queue_depth == 1
        assert backend.registry.topology is None and not backend.is_ready()
        assert int(await r.get(keys.INCARNATION)) == 5  # a later controller takes a newer id range
        groups = {g["name"] for g in await r.xinfo_groups(keys.PROMPT_QUEUE)}
        assert groups == {keys.PROMPT_GROUP.encode()}

        await _register(r, "p0", WorkerRole.PROMPT, 9)
        await _register(r, "t0", WorkerRole.TOKEN, 9)
        await backend._control_once()
        fresh = backend.registry.topology
        assert fresh is not None and fresh.epoch == 10
        assert await r.get(keys.RECOVERY) is None  # a fresh pipeline: workers drop every cache
        assert backend._repair_task is None
        await waiting.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_failed_repair_fails_its_microbatches_instead_of_stranding_them(redis_url) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)

        async def broken_repair(*args, **kwargs) -> None:
            raise ConnectionError("Redis went away half way")

        backend.repair.run = broken_repair
        backend._ready = True
        events = await backend.generate(_request("stranded"))
        backend.scheduler.form(now=1e9)
        await _register(r, "p0", WorkerRole.PROMPT, 0)
        await _register(r, "t0", WorkerRole.TOKEN, 0)
        await backend._control_once()
        old = backend.registry.topology
        new = old.model_copy(update={"epoch": old.epoch + 1})
        backend._start_repair(new, backend._plan_repair(old, new, ["t0"]))
        with contextlib.suppress(ConnectionError):
            await backend._repair_task
        await asyncio.sleep(0)  # done callbacks run on the next loop pass
        assert [ev.finish_reason async for ev in events] == [FinishReason.ERROR]
        assert not backend.scheduler.active
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_backend_loop_that_ends_takes_the_controller_down(redis_url, monkeypatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(fatal, "_exit", exits.append)

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)

        async def dies() -> None:
            raise RuntimeError("a bug the loop did not expect")

        backend._relay_loop = dies
        async with backend:
            await asyncio.sleep(0.1)
            assert exits == [fatal.EXIT_LOOP_DIED]
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("failures", [1, 3])
def test_the_relay_outlives_redis_errors(redis_url, failures) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)
        calls = 0

        async def flaky() -> None:
            nonlocal calls
            calls += 1
            if calls <= failures:
                raise ConnectionError("Redis restarting")
            backend._stream_ids.clear()

        backend._relay_once = flaky
        backend._stream_ids[1] = b"0-0"
        task = asyncio.create_task(backend._relay_loop())
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not backend._stream_ids:
                break
        assert calls == failures + 1 and not task.done()
        task.cancel()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
