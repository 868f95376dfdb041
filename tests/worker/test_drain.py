"""Draining (SIGTERM, ``dejavu admin drain``): the worker says so, serves on until the controller has
handed its stage to a replacement, then leaves; without a replacement it leaves at the drain deadline.
Real Redis, the worker as a thread, the controller's backend in-process."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import redis
import redis.asyncio as aioredis
from redis import Redis

from dejavu_common import keys
from dejavu_common.messages import RecoveryOrder, Topology, WorkerInfo, WorkerRole
from dejavu_common.settings import Settings
from dejavu_controller.pipeline_backend import PipelineBackend

from .test_redis_loss import ScriptedWorker, _record, _settings, _topology, _wait


def _start(url: str, drain_timeout_s: float = 30.0) -> tuple[ScriptedWorker, threading.Thread]:
    settings = _settings(url)
    settings = settings.model_copy(
        update={"recovery": settings.recovery.model_copy(update={"drain_timeout_s": drain_timeout_s})}
    )
    worker = ScriptedWorker(settings, "t0")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


@contextlib.contextmanager
def _t0_serving(url: str, drain_timeout_s: float = 30.0) -> Iterator[tuple[ScriptedWorker, threading.Thread, Redis]]:
    """Worker t0 as a thread, registered and serving its stage at epoch 3; stopped afterwards."""
    worker, thread = _start(url, drain_timeout_s)
    client = redis.Redis.from_url(url)
    try:
        _wait(lambda: client.exists(keys.worker("t0")))
        client.set(keys.TOPOLOGY, _topology(3, "t0").encode())
        _wait(lambda: worker.served == [3])
        yield worker, thread, client
    finally:
        worker.stopping.set()
        thread.join(10)


def test_a_draining_worker_serves_until_its_stage_is_handed_over(redis_url) -> None:
    with _t0_serving(redis_url) as (worker, thread, client):
        worker._on_sigterm()  # what SIGTERM does: only an event is set
        _wait(lambda: _record(client, "t0").get(b"state") == b"draining")
        time.sleep(0.5)
        assert thread.is_alive() and worker.served == [3]  # still serving: nobody took the stage yet
        client.set(keys.TOPOLOGY, _topology(4, "s0").encode())  # handed over to s0
        thread.join(10)
        assert not thread.is_alive() and worker.served == [3]
        assert not client.exists(keys.worker("t0")) and not client.sismember(keys.WORKERS, "t0")


def test_a_worker_whose_stage_goes_to_another_frees_what_it_held_then_can_take_it_back(redis_url) -> None:
    """Fenced or handed over, a worker no topology names holds nothing for anyone: it frees its stage's
    state once (a fenced token worker used to keep its caches until it served again, perhaps never).
    Given the same stage back, it serves it without loading it again."""
    with _t0_serving(redis_url) as (worker, _thread, client):
        assert worker.freed == []
        client.set(keys.TOPOLOGY, _topology(4, "s0").encode())
        _wait(lambda: worker.freed == [4])
        time.sleep(0.5)  # more heartbeats under the same topology: freed once
        assert worker.freed == [4] and worker.served == [3]
        client.set(keys.TOPOLOGY, _topology(5, "t0").encode())
        _wait(lambda: worker.served == [3, 5])
        assert worker.loads == [3] and worker.freed == [4]


def test_a_drain_with_no_replacement_ends_at_its_deadline_and_a_second_sigterm_at_once(redis_url) -> None:
    with _t0_serving(redis_url, drain_timeout_s=0.5) as (worker, thread, client):
        worker._on_sigterm()
        thread.join(10)
        assert not thread.is_alive() and not client.exists(keys.worker("t0"))
    worker, thread = _start(redis_url)
    _wait(lambda: client.exists(keys.worker("t0")))
    worker._on_sigterm()
    worker._on_sigterm()
    assert worker.stopping.is_set()
    thread.join(10)
    assert not thread.is_alive()


def _register(client: redis.Redis, worker_id: str, role: WorkerRole, state: str, epoch: int, spare=False) -> None:
    info = WorkerInfo(
        worker_id=worker_id,
        role=role,
        host="h",
        pid=1,
        instance=worker_id,
        data_address="",
        torch_threads=1,
        spare=spare,
    )
    client.hset(keys.worker(worker_id), mapping={"info": info.encode(), "state": state, "epoch": epoch})
    client.sadd(keys.WORKERS, worker_id)
    client.set(keys.worker_lease(worker_id), "1", px=60_000)


_PIPELINE = (("p0", WorkerRole.PROMPT), ("t0", WorkerRole.TOKEN), ("t1", WorkerRole.TOKEN))


def _backend(redis_url: str) -> tuple[redis.Redis, aioredis.Redis, PipelineBackend, list[dict[int, str]]]:
    """A controller backend for two token stages on the test's Redis, its repairs recorded (not run)."""
    client = redis.Redis.from_url(redis_url)
    r = aioredis.Redis.from_url(redis_url)
    base = Settings()
    settings = base.model_copy(update={"controller": base.controller.model_copy(update={"token_depth": 2})})
    backend = PipelineBackend(settings, r, n_layers=6)
    repairs: list[dict[int, str]] = []

    async def repair_run(topology, replaced, *args, **kwargs) -> None:
        repairs.append(replaced)

    backend.repair.run = repair_run  # type: ignore[method-assign]
    return client, r, backend, repairs


async def _serving(client: redis.Redis, backend: PipelineBackend) -> int:
    """Register p0, t0, t1, let the controller publish a pipeline and see them serve it; its epoch."""
    for wid, role in _PIPELINE:
        _register(client, wid, role, "serving", 0)
    await backend._control_once()
    epoch = backend.registry.topology.epoch
    for wid, role in _PIPELINE:
        _register(client, wid, role, "serving", epoch)
    await backend._control_once()
    assert backend.is_ready()
    return epoch


def test_the_controller_hands_a_draining_stage_to_a_spare_and_stays_ready_while_it_waits_for_one(redis_url) -> None:
    async def scenario() -> None:
        client, r, backend, repairs = _backend(redis_url)
        epoch = await _serving(client, backend)

        _register(client, "t1", WorkerRole.TOKEN, "draining", epoch)  # no spare yet: t1 serves on
        await backend._control_once()
        assert backend.registry.topology.epoch == epoch and backend.is_ready() and not repairs

        _register(client, "s0", WorkerRole.TOKEN, "idle", 0, spare=True)
        await backend._control_once()
        topo = backend.registry.topology
        assert topo.epoch == epoch + 1 and [a.worker_id for a in topo.token_stages] == ["t0", "s0"]
        await asyncio.sleep(0)
        assert repairs == [{1: "s0"}]
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_repair_order_is_written_before_the_topology_that_needs_it(redis_url) -> None:
    """A worker that sees a new epoch must find that epoch's recovery order: without it, it would take
    the epoch for a fresh pipeline and drop every cache (then everything re-runs after the repair's
    timeout). The controller writes the order before it publishes the topology."""

    async def scenario() -> None:
        client, r, backend, _repairs = _backend(redis_url)
        seen: list[tuple[int, bytes | None]] = []  # (epoch published, the recovery order just before it)
        real_fenced = backend.leadership.fenced

        async def watching_fenced(queue_writes, tries: int = 5) -> None:  # the topology's (fenced) write
            order = client.get(keys.RECOVERY)
            await real_fenced(queue_writes, tries)
            seen.append((Topology.decode(client.get(keys.TOPOLOGY)).epoch, order))

        backend.leadership.fenced = watching_fenced  # type: ignore[method-assign]
        epoch = await _serving(client, backend)
        assert seen[-1][1] is None  # a fresh pipeline: no order
        _register(client, "s0", WorkerRole.TOKEN, "idle", 0, spare=True)
        await backend._control_once()
        client.delete(keys.worker_lease("t1"))  # t1 dies
        await backend._control_once()
        new_epoch, order = seen[-1]
        assert new_epoch == epoch + 1 and order is not None
        assert RecoveryOrder.decode(order) == RecoveryOrder(epoch=new_epoch, replaced={1: "s0"}, microbatches=())
        await r.aclose()
        client.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_leases_that_expired_together_during_a_stall_are_not_failures_but_one_not_renewed_after_is(
    redis_url,
) -> None:
    """Redis (or the controller) stalled for longer than a lease: every lease expired at once while the
    workers were fine. The controller waits one lease period for renewals before it fails anyone, so
    a stall does not turn into a repair of every stage; a worker that stays silent is failed after it."""

    async def scenario() -> None:
        client, r, backend, repairs = _backend(redis_url)
        settings = backend.settings
        epoch = await _serving(client, backend)
        _register(client, "s0", WorkerRole.TOKEN, "idle", 0, spare=True)
        await backend._control_once()

        for wid, _role in _PIPELINE:  # the stall: every lease gone at once
            client.delete(keys.worker_lease(wid))
        backend._last_poll = time.monotonic() - 3 * settings.recovery.lease_ttl_s
        await backend._control_once()
        assert backend.registry.topology.epoch == epoch and not repairs
        # p0 and t0 renew as their heartbeats do; t1 stays silent: failed once the grace period is over
        end = time.monotonic() + 3 * settings.recovery.lease_ttl_s
        while not repairs and time.monotonic() < end:
            for wid in ("p0", "t0", "s0"):
                client.set(keys.worker_lease(wid), "1", px=60_000)
            await backend._control_once()
            await asyncio.sleep(settings.recovery.heartbeat_interval_s)
        assert repairs == [{1: "s0"}] and backend.registry.topology.epoch == epoch + 1
        await r.aclose()
        client.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_lost_workers_unacknowledged_claims_are_dropped_with_it(redis_url) -> None:
    """A prompt worker dies between claiming a task and acknowledging it: the repair re-runs the task's
    microbatches, and nothing would ever read the entry pending for the dead consumer again. The
    controller drops the lost worker's consumer (its pending entries with it); the others' stay."""

    async def scenario() -> None:
        client, r, backend, _repairs = _backend(redis_url)
        client.delete(keys.PROMPT_QUEUE)
        client.xgroup_create(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, id="0", mkstream=True)
        await _serving(client, backend)
        _register(client, "p1", WorkerRole.PROMPT, "idle", 0, spare=True)
        for worker in ("p0", "p1"):  # each claims one task and never acknowledges it
            client.xadd(keys.PROMPT_QUEUE, {"task": b"-"})
            client.xreadgroup(keys.PROMPT_GROUP, worker, {keys.PROMPT_QUEUE: ">"}, count=1)
        assert client.xpending(keys.PROMPT_QUEUE, keys.PROMPT_GROUP)["pending"] == 2
        await backend._control_once()
        client.delete(keys.worker_lease("p0"))  # p0 dies
        await backend._control_once()
        pending = client.xpending(keys.PROMPT_QUEUE, keys.PROMPT_GROUP)
        assert pending["pending"] == 1 and [c["name"] for c in pending["consumers"]] == [b"p1"]
        await r.aclose()
        client.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
