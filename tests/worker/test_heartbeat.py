"""The worker's control thread against a real Redis: leases, topology, admin commands."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from dejavu_common import keys
from dejavu_common.admin import generate_keypair, sign
from dejavu_common.messages import AdminAction, Topology
from dejavu_common.settings import Settings
from dejavu_worker.heartbeat import Heartbeat

SIGNING, VERIFY = generate_keypair()


def _hb(redis_url: str) -> tuple[Heartbeat, redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    settings = Settings(redis={"url": redis_url}, admin={"verify_key": VERIFY})
    return Heartbeat(settings, client, "t0", "inst"), client


def _order(action: AdminAction, worker_id: str = "t0", seconds: float = 0.0, key: str = SIGNING) -> dict:
    return {"cmd": sign(key, worker_id, "inst", action, seconds=seconds).encode()}


def test_lease_topology_and_verified_admin_orders(redis_url) -> None:
    hb, client = _hb(redis_url)
    hb.beat()
    assert 0 < client.pttl(keys.worker_lease("t0")) <= 1500
    topo = Topology(epoch=4, mode="colocated", n_layers=2, prompt_microbatch=1, token_microbatch=1)
    client.set(keys.TOPOLOGY, topo.encode())
    wrong_key, _ = generate_keypair()
    client.xadd(keys.ADMIN_STREAM, _order(AdminAction.KILL, key=wrong_key))  # a valid KILL would end this process
    client.xadd(keys.ADMIN_STREAM, _order(AdminAction.KILL, key=VERIFY))  # what a worker holds cannot sign
    client.xadd(keys.ADMIN_STREAM, {"cmd": b"{garbage"})
    client.xadd(keys.ADMIN_STREAM, _order(AdminAction.DRAIN, "t9"))  # someone else
    hb.beat()
    assert hb.topology == topo and hb.topology_changed.is_set()
    assert not hb.draining.is_set()
    client.xadd(keys.ADMIN_STREAM, _order(AdminAction.PAUSE_HEARTBEATS, seconds=60))
    hb.beat()
    client.delete(keys.worker_lease("t0"))
    hb.beat()
    assert not client.exists(keys.worker_lease("t0"))  # paused: the lease is not renewed
    drain = _order(AdminAction.DRAIN)
    client.xadd(keys.ADMIN_STREAM, drain)
    hb.beat()
    assert hb.draining.is_set()


def test_a_replayed_admin_command_is_refused(redis_url, caplog) -> None:
    hb, client = _hb(redis_url)
    hb.beat()
    pause = _order(AdminAction.PAUSE_HEARTBEATS, seconds=0.2)
    client.xadd(keys.ADMIN_STREAM, pause)
    hb.beat()
    client.delete(keys.worker_lease("t0"))
    time.sleep(0.3)  # the pause is over
    client.xadd(keys.ADMIN_STREAM, pause)  # an eavesdropper on the stream sends the same command again
    with caplog.at_level(logging.ERROR, logger="dejavu.worker.heartbeat"):
        hb.beat()
    assert "replayed" in caplog.text
    assert client.exists(keys.worker_lease("t0"))  # not paused again: the lease was renewed


def test_kv_byte_counters_are_flushed_with_the_beat(redis_url) -> None:
    hb, client = _hb(redis_url)
    hb.add_kv_bytes("replication", 100)
    hb.add_kv_bytes("replication", 20)
    hb.beat()
    hb.add_kv_bytes("prompt_to_token", 5)
    hb.beat()
    assert client.hgetall(keys.KV_BYTES) == {b"replication": b"120", b"prompt_to_token": b"5"}


@pytest.mark.ucx
def test_a_peer_record_that_claims_another_worker_is_refused(redis_url) -> None:
    from dejavu_common.messages import WorkerInfo, WorkerRole
    from dejavu_common.settings import TransportSettings
    from dejavu_worker.endpoint import DataEndpoint
    from dejavulib.errors import TransferError

    client = redis.Redis.from_url(redis_url)
    forged = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=1, instance="i", data_address="")
    client.hset(keys.worker("t9"), mapping={"info": forged.encode()})
    endpoint = DataEndpoint(TransportSettings(), "p0")
    try:
        with pytest.raises(TransferError, match="claims to be worker 't0'"):
            endpoint.connect_all(client, ["t9"])
    finally:
        endpoint.close()


def test_the_heartbeat_thread_outlives_redis_errors_and_ends_the_process_on_anything_else(redis_url, monkeypatch):
    from dejavu_common import fatal

    exits: list[int] = []
    monkeypatch.setattr(fatal, "_exit", exits.append)
    hb, _client = _hb(redis_url)
    hb.settings = hb.settings.model_copy(
        update={"recovery": hb.settings.recovery.model_copy(update={"heartbeat_interval_s": 0.01})}
    )
    outcomes = [redis.ConnectionError("restarting"), ValueError("a bug")]

    def beat() -> None:
        if not outcomes:
            hb.stop()
            return
        raise outcomes.pop(0)

    hb.beat = beat
    hb.start()
    hb.join(5)
    assert exits == [fatal.EXIT_LOOP_DIED]
