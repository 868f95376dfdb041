"""The controller's leader lease on a real Redis: one controller acts at a time, a standby waits (not
ready, the work left alone) and takes over when the leader leaves or dies; a restarted controller takes
its own lease back at once; a leader that lost the lease to another instance learns it."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.settings import Settings
from dejavu_controller.backend import NotReadyError
from dejavu_controller.leadership import Leadership, LeadershipLost
from dejavu_controller.pipeline_backend import PipelineBackend


def test_one_instance_holds_the_lease_and_a_restart_of_the_same_controller_takes_it_back(redis_url) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        await r.delete(keys.CONTROLLER_LEADER)
        a, b = Leadership(r, "host-a:8000", ttl_s=5), Leadership(r, "host-b:8000", ttl_s=5)
        assert await a.try_acquire() and not await b.try_acquire()
        await a.renew()
        assert await a.holder() == a.value
        # The same controller restarted (same identity, new instance) does not wait out the TTL ...
        a2 = Leadership(r, "host-a:8000", ttl_s=5)
        assert await a2.try_acquire() and await a2.holder() == a2.value
        # ... and the old instance, were it still alive, learns it no longer leads.
        with pytest.raises(LeadershipLost, match="host-a:8000/"):
            await a.renew()
        assert not a.held
        # Releasing lets the standby take the lease at once; releasing again does nothing.
        await a2.release()
        await a2.release()
        assert await b.try_acquire()
        # Redis lost the key (restarted empty): the leader takes it again when it renews.
        await r.delete(keys.CONTROLLER_LEADER)
        await b.renew()
        assert await b.holder() == b.value
        await b.release()
        assert await b.holder() is None
        await r.aclose()

    asyncio.run(scenario())


def test_a_standby_takes_over_once_a_dead_leaders_lease_expires(redis_url) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        await r.delete(keys.CONTROLLER_LEADER)
        dead, standby = Leadership(r, "a:1", ttl_s=0.6), Leadership(r, "b:1", ttl_s=0.6)
        assert await dead.try_acquire()  # and never renews
        waiting = asyncio.create_task(standby.acquire(poll_s=0.05))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the lease is still alive
        await asyncio.wait_for(waiting, timeout=2.0)
        assert standby.held and await standby.holder() == standby.value
        await standby.release()
        await r.aclose()

    asyncio.run(scenario())


LEASE_S = 1.5  # short for a test, long enough that a loaded CI host never stalls a renewal past it


def _settings(port: int) -> Settings:
    base = Settings()
    controller = base.controller.model_copy(update={"port": port, "leader_lease_s": LEASE_S})
    return base.model_copy(update={"controller": controller})


def test_a_second_controller_stands_by_without_touching_the_leaders_work_then_takes_over(redis_url) -> None:
    async def scenario() -> None:
        client = redis.Redis.from_url(redis_url)
        client.delete(keys.CONTROLLER_LEADER, keys.PROMPT_QUEUE)
        r1, r2 = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
        async with PipelineBackend(_settings(18001), r1, n_layers=6) as leader:
            while not leader.leadership.held:
                await asyncio.sleep(0.01)
            client.xadd(keys.PROMPT_QUEUE, {"task": "the leader's work"})
            standby = PipelineBackend(_settings(18002), r2, n_layers=6)
            await standby.__aenter__()
            try:
                await asyncio.sleep(LEASE_S * 1.5)  # longer than the lease: the leader keeps renewing it
                assert leader.leadership.held and not standby.leadership.held
                assert client.xlen(keys.PROMPT_QUEUE) == 1  # a standby clears nothing
                assert not standby.is_ready()
                with pytest.raises(NotReadyError, match="standing by"):
                    await standby.generate(None)  # type: ignore[arg-type]
            except BaseException:
                await standby.__aexit__(None, None, None)
                raise
        # The leader left (lease released): the standby takes over and clears the stale work.
        try:
            for _ in range(int(LEASE_S / 0.02) * 2):  # a free lease is taken within a poll (a third of it)
                if standby.leadership.held and client.xlen(keys.PROMPT_QUEUE) == 0:
                    break
                await asyncio.sleep(0.02)
            assert standby.leadership.held and client.xlen(keys.PROMPT_QUEUE) == 0
        finally:
            await standby.__aexit__(None, None, None)
        assert client.get(keys.CONTROLLER_LEADER) is None
        for c in (r1, r2):
            await c.aclose()
        client.close()

    asyncio.run(scenario())


def test_a_leader_that_lost_the_lease_cannot_publish_a_topology(redis_url) -> None:
    """The fencing: topology writes commit only while the writer holds the lease, checked by Redis in the
    same transaction; a leader that stalled past its TTL and lost the lease to another writes nothing."""
    from dejavu_common.messages import WorkerInfo, WorkerRole
    from dejavu_common.settings import ControllerSettings, Mode
    from dejavu_controller.registry import Registry

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        await r.delete(keys.CONTROLLER_LEADER, keys.TOPOLOGY)
        info = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=1, instance="t0-1", data_address="")
        await r.hset(keys.worker("t0"), mapping={"info": info.encode(), "state": "serving", "epoch": 0})
        await r.sadd(keys.WORKERS, "t0")
        await r.set(keys.worker_lease("t0"), "1", px=5000)
        stalled, other = Leadership(r, "host-a:8000", ttl_s=5), Leadership(r, "host-b:8000", ttl_s=5)
        settings = ControllerSettings(mode=Mode.COLOCATED, token_depth=1)
        registry = Registry(r, settings, n_layers=4)
        assert await stalled.try_acquire()
        workers = await registry.workers()
        first = await registry.publish(registry.assemble(workers), workers, fenced=stalled.fenced)
        assert await r.get(keys.TOPOLOGY) == first.encode()
        await r.delete(keys.CONTROLLER_LEADER)  # its lease expired while it stalled ...
        assert await other.try_acquire()  # ... and another instance leads now
        with pytest.raises(LeadershipLost, match="write refused"):
            await registry.publish(registry.assemble(workers), workers, fenced=stalled.fenced)
        assert await r.get(keys.TOPOLOGY) == first.encode()  # nothing written
        assert not stalled.held
        await other.fenced(lambda pipe: pipe.set(keys.TOPOLOGY, b"x"))  # the holder writes
        assert await r.get(keys.TOPOLOGY) == b"x"
        await r.delete(keys.CONTROLLER_LEADER)  # Redis restarted empty: the lease is gone with it
        await other.fenced(lambda pipe: pipe.set(keys.TOPOLOGY, b"y"))  # taken back with the write
        assert await r.get(keys.TOPOLOGY) == b"y" and await other.holder() == other.value
        with pytest.raises(LeadershipLost):
            await stalled.fenced(lambda pipe: pipe.set(keys.TOPOLOGY, b"z"))
        await r.delete(keys.TOPOLOGY, keys.CONTROLLER_LEADER)
        await r.aclose()

    asyncio.run(scenario())
