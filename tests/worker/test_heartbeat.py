"""The worker's control thread against a real Redis: leases, topology, admin commands."""

from __future__ import annotations

import redis

from dejavu_common import keys
from dejavu_common.admin import sign
from dejavu_common.messages import AdminAction, Topology
from dejavu_common.settings import Settings
from dejavu_worker.heartbeat import Heartbeat


def _hb(redis_url: str) -> tuple[Heartbeat, redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    settings = Settings(redis={"url": redis_url}, admin={"credential": "cred"})
    return Heartbeat(settings, client, "t0"), client


def test_lease_topology_and_verified_admin_orders(redis_url) -> None:
    hb, client = _hb(redis_url)
    hb.beat()
    assert 0 < client.pttl(keys.worker_lease("t0")) <= 1500
    topo = Topology(epoch=4, mode="colocated", n_layers=2, prompt_microbatch=1, token_microbatch=1)
    client.set(keys.TOPOLOGY, topo.encode())
    forged = sign("t0", AdminAction.KILL, "wrong")  # a valid KILL would end this test process
    client.xadd(keys.ADMIN_STREAM, {"cmd": forged.encode()})
    client.xadd(keys.ADMIN_STREAM, {"cmd": b"{garbage"})
    client.xadd(keys.ADMIN_STREAM, {"cmd": sign("t9", AdminAction.DRAIN, "cred").encode()})  # someone else
    hb.beat()
    assert hb.topology == topo and hb.topology_changed.is_set()
    assert not hb.draining.is_set()
    client.xadd(keys.ADMIN_STREAM, {"cmd": sign("t0", AdminAction.PAUSE_HEARTBEATS, "cred", 60).encode()})
    hb.beat()
    client.delete(keys.worker_lease("t0"))
    hb.beat()
    assert not client.exists(keys.worker_lease("t0"))  # paused: the lease is not renewed
    client.xadd(keys.ADMIN_STREAM, {"cmd": sign("t0", AdminAction.DRAIN, "cred").encode()})
    hb.beat()
    assert hb.draining.is_set()


def test_kv_byte_counters_are_flushed_with_the_beat(redis_url) -> None:
    hb, client = _hb(redis_url)
    hb.add_kv_bytes("replication", 100)
    hb.add_kv_bytes("replication", 20)
    hb.beat()
    hb.add_kv_bytes("prompt_to_token", 5)
    hb.beat()
    assert client.hgetall(keys.KV_BYTES) == {b"replication": b"120", b"prompt_to_token": b"5"}


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
