"""Workers outlive Redis being restarted empty and peers that can't be reached (real Redis, workers as
threads, no model and no data plane): they register again, accept the controller's next topology, and
serve on; the controller's epochs never go backwards."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import StageAssignment, Topology, WorkerInfo, WorkerRole, WorkerState
from dejavu_common.settings import Settings
from dejavu_controller.registry import Registry
from dejavu_worker.lifecycle import WorkerProcess
from dejavulib.errors import PeerError


class ScriptedWorker(WorkerProcess):
    """A worker whose stage is nothing: ``serve`` polls Redis (as every real serving loop does) until
    the epoch changes, and raises what ``failures`` scripts for the first epochs it serves."""

    role = WorkerRole.TOKEN

    def __init__(self, settings: Settings, worker_id: str, failures: list[Exception] | None = None) -> None:
        super().__init__(settings, worker_id)
        self.loads: list[int] = []
        self.served: list[int] = []
        self.failures = list(failures or [])
        self.freed: list[int] = []  # epochs at which the topology named it for no stage (``unassigned``)

    def unassigned(self, epoch: int) -> None:
        super().unassigned(epoch)
        self.freed.append(epoch)

    def open_data_plane(self) -> bytes:
        return b"no data plane"

    def load(self, assignment: StageAssignment, topology: Topology) -> None:
        self.loads.append(topology.epoch)

    def serve(self, topology: Topology) -> None:
        self.served.append(topology.epoch)
        if self.failures:
            raise self.failures.pop(0)
        assert self.redis is not None
        while not self.epoch_changed():
            self.redis.get(keys.TOPOLOGY)
            time.sleep(0.02)


def _settings(url: str) -> Settings:
    return Settings(redis={"url": url, "retries": 1, "socket_timeout_s": 0.5, "connect_timeout_s": 0.5})


def _topology(epoch: int, worker_id: str) -> Topology:
    stage = StageAssignment(worker_id=worker_id, stage=0, layers=(0, 2))
    return Topology(
        epoch=epoch, mode="colocated", n_layers=2, token_stages=(stage,), prompt_microbatch=1, token_microbatch=1
    )


def _wait(cond: Callable[[], object], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except redis.RedisError:
            pass
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def _publish(url: str, worker_id: str, registry_epoch: int = 0) -> int:
    """What the controller does: read the registry, publish a topology holding ``worker_id``; the epoch."""

    async def go() -> int:
        client = aioredis.Redis.from_url(url)
        try:
            registry = Registry(client, Settings().controller, n_layers=2)
            registry.last_epoch = registry_epoch
            workers = await registry.workers()
            topo = await registry.publish(_topology(0, worker_id), workers)
            return topo.epoch
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.fixture
def running_worker() -> Iterator[Callable[..., ScriptedWorker]]:
    started: list[tuple[ScriptedWorker, threading.Thread]] = []

    def start(url: str, failures: list[Exception] | None = None) -> ScriptedWorker:
        worker = ScriptedWorker(_settings(url), "t0", failures)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stopping.set()
        thread.join(10)
        assert not thread.is_alive(), "the worker did not stop"


def _record(client: redis.Redis, worker_id: str) -> dict[bytes, bytes]:
    return client.hgetall(keys.worker(worker_id))


def test_a_worker_registers_again_when_redis_restarts_empty_while_it_serves(own_redis, running_worker) -> None:
    worker = running_worker(own_redis.url)
    client = redis.Redis.from_url(own_redis.url)
    _wait(lambda: client.exists(keys.worker("t0")))
    client.set(keys.EPOCH, 6)
    client.set(keys.TOPOLOGY, _topology(7, "t0").encode())
    _wait(lambda: worker.served == [7] and _record(client, "t0")[b"state"] == b"serving")
    first = WorkerInfo.decode(_record(client, "t0")[b"info"]).instance

    own_redis.restart(down_s=1.5)  # long enough for the worker's Redis retries to give up
    client = redis.Redis.from_url(own_redis.url)
    _wait(lambda: client.exists(keys.worker("t0")) and client.exists(keys.worker_lease("t0")))
    _wait(lambda: WorkerInfo.decode(_record(client, "t0")[b"info"]).instance != first)
    assert client.smembers(keys.WORKERS) == {b"t0"}
    assert int(_record(client, "t0")[b"seen"]) == 7

    # A controller that lost its memory too (restarted with Redis) still publishes above what the worker saw.
    epoch = _publish(own_redis.url, "t0")
    assert epoch == 8 and int(client.get(keys.EPOCH)) == 8
    _wait(lambda: worker.served == [7, 8])
    assert worker.loads == [7, 8]  # the new instance holds nothing: it loads its stage again
    _wait(lambda: _record(client, "t0")[b"state"] == b"serving" and _record(client, "t0")[b"epoch"] == b"8")


def test_the_heartbeat_registers_again_when_the_record_vanishes(redis_url, running_worker) -> None:
    """Redis came back before any command failed (a fast restart): only the beat notices."""
    worker = running_worker(redis_url)
    client = redis.Redis.from_url(redis_url)
    _wait(lambda: client.exists(keys.worker("t0")))
    client.set(keys.TOPOLOGY, _topology(3, "t0").encode())
    _wait(lambda: worker.served == [3] and _record(client, "t0").get(b"state") == b"serving")
    instance = _record(client, "t0")[b"info"]
    client.flushall()
    client.hset(keys.worker("t0"), mapping={"state": "serving", "epoch": 3})  # a state write racing the beat
    _wait(lambda: client.hexists(keys.worker("t0"), "info"))
    record = _record(client, "t0")
    assert record[b"info"] == instance and record[b"state"] == b"serving" and record[b"epoch"] == b"3"
    assert client.sismember(keys.WORKERS, "t0")
    assert _publish(redis_url, "t0") == 4
    _wait(lambda: worker.served == [3, 4])
    assert worker.loads == [3]  # the same instance, still holding its stage


def test_a_controller_never_publishes_an_epoch_below_its_own_last_one(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    client.hset(keys.worker("t0"), mapping={"info": _info("t0").encode(), "state": "idle", "epoch": 0})
    client.sadd(keys.WORKERS, "t0")
    assert _publish(redis_url, "t0", registry_epoch=41) == 42
    assert int(client.get(keys.EPOCH)) == 42


def _info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=WorkerRole.TOKEN, host="h", pid=1, instance="i", data_address="", torch_threads=1
    )


def test_a_peer_that_cannot_be_reached_is_retried_not_fatal(redis_url, running_worker, caplog) -> None:
    worker = running_worker(redis_url, failures=[PeerError("UCX: Shared memory error"), PeerError("again")])
    client = redis.Redis.from_url(redis_url)
    _wait(lambda: client.exists(keys.worker("t0")))
    client.set(keys.TOPOLOGY, _topology(2, "t0").encode())
    _wait(lambda: worker.served == [2, 2, 2])  # failed twice, backed off, serving on the third try
    assert _record(client, "t0")[b"state"] == WorkerState.SERVING.value.encode()
    assert "Shared memory error" in caplog.text and "2 in a row" in caplog.text
