"""``PipelineBackend.overview()``, what the status page shows, from the backend's own state (a real Redis,
registered worker records, no worker processes): the pipelines it published, the workers, the requests in
flight, and a repair from its start to its end."""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import WorkerInfo, WorkerRole
from dejavu_common.settings import Settings
from dejavu_controller.backend import GenerationRequest, SamplingSpec
from dejavu_controller.overview import RepairState
from dejavu_controller.pipeline_backend import PipelineBackend


def _settings() -> Settings:
    base = Settings()
    controller = base.controller.model_copy(update={"token_depth": 2, "token_microbatch": 1, "prompt_microbatch": 1})
    return base.model_copy(update={"controller": controller})


async def _register(r: aioredis.Redis, worker_id: str, role: WorkerRole, spare: bool = False) -> None:
    info = WorkerInfo(
        worker_id=worker_id, role=role, host="h", pid=7, instance=f"{worker_id}-a", data_address="", spare=spare
    )
    await r.hset(keys.worker(worker_id), mapping={"info": info.encode(), "state": "serving", "epoch": 0, "seen": 0})
    await r.sadd(keys.WORKERS, worker_id)
    await r.set(keys.worker_lease(worker_id), "1", px=60_000)


def test_the_overview_follows_the_pipelines_requests_and_a_repair(redis_url) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)
        for worker, role, spare in (
            ("p0", WorkerRole.PROMPT, False),
            ("t0", WorkerRole.TOKEN, False),
            ("t1", WorkerRole.TOKEN, False),
            ("spare0", WorkerRole.TOKEN, True),
        ):
            await _register(r, worker, role, spare)
        await backend.leadership.acquire()  # topology writes are fenced by the leader lease
        await backend._control_once()
        first = backend.overview()
        assert first.topology is not None and first.topology is backend.registry.topology
        assert [a.worker_id for a in first.topology.token_stages] == ["t0", "t1"]
        assert sorted(first.workers) == ["p0", "spare0", "t0", "t1"] and first.workers["spare0"].info.spare
        assert first.repair is None and first.requests == () and first.requests_in_flight == 0
        assert first.leader

        backend._ready = True
        one = await backend.generate(GenerationRequest("one", (1, 2, 3), SamplingSpec(max_tokens=5)))
        (mb,) = backend.scheduler.form(now=1e9)
        mb.requests[0].deliver(0, 42, None)
        two = await backend.generate(GenerationRequest("two", (4, 5), SamplingSpec(max_tokens=3)))
        shown = backend.overview()
        assert [(v.request_id, v.status, v.generated, v.max_tokens, v.microbatch) for v in shown.requests] == [
            ("one", "decoding", 1, 5, mb.spec.mb_id),
            ("two", "queued", 0, 3, None),
        ]
        assert shown.requests_in_flight == 2 and shown.requests[0].prompt_tokens == 3

        await r.delete(keys.worker_lease("t1"))  # t1's lease expired: spare0 takes token stage 1
        await backend._control_once()
        during = backend.overview()
        assert during.topology.epoch == first.topology.epoch + 1
        assert [a.worker_id for a in during.topology.token_stages] == ["t0", "spare0"]
        assert not during.workers["t1"].alive
        repair = during.repair
        assert repair is not None and repair.state is RepairState.RUNNING and repair.epoch == during.topology.epoch
        assert dict(repair.replaced) == {1: "spare0"} and repair.rerun == (mb.spec.mb_id,) and repair.resumable == ()
        await asyncio.sleep(0)  # the repair task starts: its first phase is timed
        assert "replacement_assigned" in backend.overview().repair.phases

        backend._repair_task.cancel()  # no worker reports here: the repair would wait for its deadline
        with contextlib.suppress(asyncio.CancelledError):
            await backend._repair_task
        assert backend.overview().repair.state is RepairState.SUPERSEDED
        await one.aclose()
        await two.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_finished_repair_shows_its_phases(redis_url) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(_settings(), r, n_layers=6)

        for worker, role, spare in (
            ("p0", WorkerRole.PROMPT, False),
            ("t0", WorkerRole.TOKEN, False),
            ("t1", WorkerRole.TOKEN, False),
            ("spare0", WorkerRole.TOKEN, True),
        ):
            await _register(r, worker, role, spare)
        await backend.leadership.acquire()  # topology writes are fenced by the leader lease
        await backend._control_once()
        backend.settings.transport.deadline_s = 0.05  # the repair gives up waiting for reports at once
        await r.delete(keys.worker_lease("t1"))
        await backend._control_once()
        await backend._repair_task  # no reports: it times out, re-runs every prompt and publishes the resume point
        done = backend.overview().repair
        assert done.state is RepairState.DONE
        assert list(done.phases) == ["replacement_assigned", "cache_restored", "resumed"]
        assert done.seconds == done.phases["resumed"]
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
