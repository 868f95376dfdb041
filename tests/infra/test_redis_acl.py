"""infra/redis: each DejaVu user may do what its role needs and nothing else (a real redis-server).

The key and channel names follow dejavu_common.keys; the cases are the commands the services send.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from .redis_acl_server import START, AclRedis, password_variable

WORKER_IDS = ("t-w1", "t-w2")
PASSWORDS = {
    "controller": "c0ntroller-pw",
    "worker-t-w1": "w0rker-1-pw",
    "worker-t-w2": "w0rker-2-pw",
    "admin": "adm1n-pw",
}

LEASE = "dejavu:worker:t-w1:lease"
SET_LEASE = "return redis.call('SET', KEYS[1], ARGV[1], 'PX', 1500)"

ALLOWED: list[tuple[str, tuple[str, ...]]] = [
    ("default", ("PING",)),
    ("controller", ("SET", "dejavu:topology", "{}")),
    ("controller", ("INCR", "dejavu:topology:epoch")),
    ("controller", ("SET", "dejavu:ctl:resume", "{}")),
    ("controller", ("PUBLISH", "dejavu:ctl:topology", "1")),
    ("controller", ("SET", "dejavu:mb:1", "{}")),
    ("controller", ("SADD", "dejavu:mb:1:cancel", "0")),
    ("controller", ("XADD", "dejavu:q:prompt", "*", "task", "t")),
    ("controller", ("XREAD", "COUNT", "1", "STREAMS", "dejavu:tok:1", "0")),
    ("controller", ("HGETALL", "dejavu:wm:0")),
    ("controller", ("SMEMBERS", "dejavu:worker:index")),
    ("controller", ("DEL", "dejavu:tok:1", "dejavu:mb:1", "dejavu:mb:1:cancel")),
    ("worker-t-w1", ("HSET", "dejavu:worker:t-w1", "state", "idle")),
    ("worker-t-w1", ("SADD", "dejavu:worker:index", "t-w1")),
    ("worker-t-w1", ("SET", LEASE, "1", "PX", "1500")),
    ("worker-t-w1", ("GET", "dejavu:topology")),
    ("worker-t-w1", ("GET", "dejavu:topology:epoch")),
    ("worker-t-w1", ("GET", "dejavu:mb:1")),
    ("worker-t-w1", ("SMEMBERS", "dejavu:mb:1:cancel")),
    ("worker-t-w1", ("GET", "dejavu:ctl:resume")),
    ("worker-t-w1", ("XREAD", "COUNT", "32", "STREAMS", "dejavu:admin:commands", "0")),
    ("worker-t-w1", ("XADD", "dejavu:q:ready", "*", "ready", "r")),
    ("worker-t-w1", ("XADD", "dejavu:tok:1", "*", "step", "s")),
    ("worker-t-w1", ("HSET", "dejavu:wm:0", "1", "5")),
    ("worker-t-w1", ("PUBLISH", "dejavu:ctl:topology", "1")),
    ("worker-t-w1", ("HGET", "dejavu:worker:t-w2", "info")),  # a peer's data-plane address
    ("worker-t-w1", ("PTTL", "dejavu:worker:t-w2:lease")),
    ("worker-t-w1", ("SREM", "dejavu:worker:index", "t-w1")),
    # Every command the workers send, on the keys they send it to (dejavu_worker, the worker services).
    ("worker-t-w1", ("HEXISTS", "dejavu:worker:t-w1", "info")),
    ("worker-t-w1", ("SET", "dejavu:worker:t-w1:kv", "{}", "PX", "6000")),
    ("worker-t-w1", ("HINCRBY", "dejavu:wm:kvbytes", "replication", "4096")),
    ("worker-t-w1", ("HDEL", "dejavu:wm:0", "1")),
    ("worker-t-w1", ("HSET", "dejavu:wm:0:sig", "1", "t-w1 c2ln")),
    ("worker-t-w1", ("HDEL", "dejavu:wm:0:sig", "1")),
    ("worker-t-w1", ("SET", "dejavu:wm:progress:3:1", "{}", "EX", "3600")),
    ("worker-t-w1", ("SET", "dejavu:wm:restored:3:1", "1", "EX", "3600")),
    ("worker-t-w1", ("XGROUP", "CREATE", "dejavu:q:prompt", "prompt-stage0", "0", "MKSTREAM")),
    ("worker-t-w1", ("XREADGROUP", "GROUP", "prompt-stage0", "t-w1", "COUNT", "1", "STREAMS", "dejavu:q:prompt", ">")),
    ("worker-t-w1", ("XAUTOCLAIM", "dejavu:q:prompt", "prompt-stage0", "t-w1", "1000", "0")),
    ("worker-t-w1", ("XACK", "dejavu:q:prompt", "prompt-stage0", "0-1")),
    ("worker-t-w1", ("XADD", "dejavu:q:ready", "MAXLEN", "~", "10000", "*", "done", "d")),
    ("worker-t-w1", ("XREVRANGE", "dejavu:tok:1", "+", "-", "COUNT", "1")),
    ("worker-t-w1", ("DEL", LEASE)),
    ("worker-t-w1", ("DEL", "dejavu:worker:t-w1")),
    ("admin", ("XADD", "dejavu:admin:commands", "MAXLEN", "~", "1000", "*", "cmd", "c")),
    ("admin", ("SISMEMBER", "dejavu:worker:index", "t-w1")),
    ("admin", ("HGETALL", "dejavu:worker:t-w1")),
    ("admin", ("PTTL", LEASE)),
    ("admin", ("GET", "dejavu:topology")),
    ("admin", ("HGETALL", "dejavu:wm:0")),
    ("admin", ("SCAN", "0", "MATCH", "dejavu:tok:*")),
]

DENIED: list[tuple[str, tuple[str, ...]]] = [
    ("default", ("GET", "dejavu:topology")),
    ("default", ("SET", "dejavu:topology", "{}")),
    ("controller", ("SET", "other:key", "1")),
    ("controller", ("PUBLISH", "other", "1")),
    ("controller", ("FLUSHALL",)),
    ("controller", ("CONFIG", "GET", "*")),
    ("controller", ("KEYS", "*")),
    ("controller", ("ACL", "LIST")),
    ("worker-t-w1", ("SET", "dejavu:topology", "{}")),
    ("worker-t-w1", ("INCR", "dejavu:topology:epoch")),
    ("worker-t-w1", ("SET", "dejavu:mb:1", "{}")),
    ("worker-t-w1", ("SET", "dejavu:ctl:resume", "{}")),
    ("worker-t-w1", ("XADD", "dejavu:admin:commands", "*", "cmd", "forged")),
    ("worker-t-w1", ("EVAL", SET_LEASE, "1", "dejavu:topology", "1")),
    ("worker-t-w1", ("EVAL", SET_LEASE, "1", LEASE, "1")),  # Lua is unused: revoked even on the worker's own keys
    ("worker-t-w1", ("EVALSHA", "0" * 40, "1", LEASE)),
    ("worker-t-w1", ("SCRIPT", "LOAD", SET_LEASE)),
    ("controller", ("EVAL", SET_LEASE, "1", "dejavu:topology", "1")),
    ("controller", ("FUNCTION", "LIST")),
    ("worker-t-w1", ("PUBLISH", "dejavu:admin:x", "1")),
    ("worker-t-w1", ("GET", "other:key")),
    ("worker-t-w1", ("FLUSHDB",)),
    # No command grows a value in place, not even on the worker's own keys (a 512 MB string in one call).
    ("worker-t-w1", ("SETRANGE", LEASE, str(512 << 20), "x")),
    ("worker-t-w1", ("APPEND", LEASE, "x")),
    ("worker-t-w1", ("SETBIT", LEASE, str(1 << 32 - 1), "1")),
    ("worker-t-w1", ("APPEND", "dejavu:tok:1", "x")),
    ("worker-t-w1", ("SETRANGE", "dejavu:wm:progress:3:1", "0", "x")),
    # A shared hash or stream cannot be replaced, deleted, renamed or trimmed by a worker.
    ("worker-t-w1", ("SET", "dejavu:wm:kvbytes", "forged")),
    ("worker-t-w1", ("SET", "dejavu:wm:0", "forged")),
    ("worker-t-w1", ("SET", "dejavu:tok:1", "forged")),
    ("worker-t-w1", ("SET", "dejavu:worker:index", "forged")),
    ("worker-t-w1", ("DEL", "dejavu:worker:index")),
    ("worker-t-w1", ("DEL", "dejavu:tok:1")),
    ("worker-t-w1", ("UNLINK", "dejavu:wm:kvbytes")),
    ("worker-t-w1", ("RENAME", "dejavu:tok:1", "dejavu:tok:2")),
    ("worker-t-w1", ("XTRIM", "dejavu:tok:1", "MAXLEN", "0")),
    ("worker-t-w1", ("XDEL", "dejavu:tok:1", "0-1")),
    ("worker-t-w1", ("HSET", "dejavu:worker:index", "f", "v")),
    ("worker-t-w1", ("SADD", "dejavu:tok:9", "x")),
    ("worker-t-w1", ("LPUSH", "dejavu:q:prompt2", "x")),
    ("worker-t-w1", ("XADD", "dejavu:mb:1:cancel", "*", "f", "v")),
    # One worker's user cannot touch another worker's record or lease (redirect its KV traffic, fail it).
    ("worker-t-w2", ("HSET", "dejavu:worker:t-w1", "info", "{}")),
    ("worker-t-w2", ("DEL", "dejavu:worker:t-w1")),
    ("worker-t-w2", ("DEL", LEASE)),
    ("worker-t-w2", ("SET", LEASE, "1", "PX", "99999999")),
    ("worker-t-w2", ("PEXPIRE", LEASE, "1")),
    ("worker-t-w2", ("RENAME", LEASE, "dejavu:worker:t-w2:lease")),
    ("admin", ("SET", "dejavu:topology", "{}")),
    ("admin", ("HSET", "dejavu:worker:t-w1", "state", "dead")),
    ("admin", ("DEL", LEASE)),
    ("admin", ("XADD", "dejavu:q:prompt", "*", "task", "t")),
    ("admin", ("PUBLISH", "dejavu:ctl:topology", "1")),
    ("admin", ("SHUTDOWN",)),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    srv = AclRedis(tmp_path_factory.mktemp("acl-redis"), PASSWORDS, WORKER_IDS)
    try:
        yield srv
    finally:
        srv.stop()


def client(server: AclRedis, user: str) -> redis.Redis:
    if user == "default":
        return redis.Redis(port=server.port, socket_timeout=5)
    return redis.Redis(port=server.port, username=user, password=PASSWORDS[user], socket_timeout=5)


def _id(case: tuple[str, tuple[str, ...]]) -> str:
    return f"{case[0]}:{' '.join(case[1][:2])}"


@pytest.mark.parametrize("case", ALLOWED, ids=[_id(c) for c in ALLOWED])
def test_role_may(server: AclRedis, case: tuple[str, tuple[str, ...]]) -> None:
    user, command = case
    with client(server, user) as c:
        c.execute_command(*command)


@pytest.mark.parametrize("case", DENIED, ids=[_id(c) for c in DENIED])
def test_role_may_not(server: AclRedis, case: tuple[str, tuple[str, ...]]) -> None:
    user, command = case
    with client(server, user) as c, pytest.raises(redis.ResponseError, match=r"(?i)no ?perm|permission"):
        c.execute_command(*command)


def test_a_wrong_password_is_refused(server: AclRedis) -> None:
    for user, password in (("worker-t-w1", "guess"), ("worker-t-w1", PASSWORDS["worker-t-w2"]), ("worker", "x")):
        c = redis.Redis(port=server.port, username=user, password=password, socket_timeout=5)
        with c, pytest.raises(redis.AuthenticationError):
            c.ping()  # ...and there is no shared worker user


@pytest.mark.parametrize("ids", ["", "t-w1,bad*id"])
def test_start_refuses_no_worker_user_and_glob_ids(tmp_path: Path, ids: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "REDIS_ACL_FILE": str(tmp_path / "acl"), "REDIS_DATA_DIR": str(tmp_path)}
    env.update({password_variable(u): pw for u, pw in PASSWORDS.items()})
    env["REDIS_WORKER_IDS"] = ids
    env[password_variable("worker-bad*id")] = "pw"
    result = subprocess.run(["sh", str(START)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert ("no worker could log in" if not ids else "is not a worker id") in result.stderr


def test_acl_file_holds_digests_only_and_the_data_is_persisted(server: AclRedis) -> None:
    text = server.acl_file.read_text()
    assert not any(pw in text for pw in PASSWORDS.values())
    assert text.count(" on #") == len(PASSWORDS)
    # redis.conf turns the append-only file on; start.sh points it at the data folder (the volume).
    assert (server.data_dir / "appendonlydir").is_dir()


def test_start_refuses_a_user_without_password(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "REDIS_ACL_FILE": str(tmp_path / "acl"), "REDIS_DATA_DIR": str(tmp_path)}
    env.update({password_variable(u): pw for u, pw in PASSWORDS.items() if u != "admin"})
    env["REDIS_WORKER_IDS"] = ",".join(WORKER_IDS)
    result = subprocess.run(["sh", str(START)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "REDIS_PASSWORD_ADMIN" in result.stderr


def test_the_services_client_logs_in_as_its_user(server: AclRedis) -> None:
    """dejavu_common's client, configured as the deployments configure it, gets the worker's rights."""
    from dejavu_common import keys
    from dejavu_common.redis_client import sync_client
    from dejavu_common.settings import RedisSettings

    url = f"redis://127.0.0.1:{server.port}/0"
    settings = RedisSettings(url=url, username="worker-t-w1", password=PASSWORDS["worker-t-w1"])
    c = sync_client(settings)
    with c:
        assert c.set(keys.worker_lease("t-w1"), "1", px=1500)
        assert c.exists(keys.worker_lease("t-w1")) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            c.set(keys.worker_lease("t-w2"), "1", px=1500)


def test_a_worker_reads_its_password_from_a_file(server: AclRedis, tmp_path: Path) -> None:
    """How a Kubernetes worker logs in: its init container wrote its own password to a file."""
    from dejavu_common import keys
    from dejavu_common.redis_client import sync_client
    from dejavu_common.settings import RedisSettings

    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORDS["worker-t-w2"] + "\n")
    url = f"redis://127.0.0.1:{server.port}/0"
    with sync_client(RedisSettings(url=url, username="worker-t-w2", password_file=secret)) as c:
        assert c.set(keys.worker_lease("t-w2"), "1", px=1500)
        with pytest.raises(redis.exceptions.NoPermissionError):
            c.set(keys.TOPOLOGY, "{}")


def test_no_client_makes_a_value_past_the_bulk_bound(server: AclRedis) -> None:
    """redis.conf's proto-max-bulk-len bounds what one command may make, even for a user allowed SETRANGE."""
    with client(server, "controller") as c:
        with pytest.raises(redis.ResponseError, match="maximum allowed size"):
            c.setrange("dejavu:ctl:big", 128 << 20, "x")
        assert c.exists("dejavu:ctl:big") == 0
        c.setrange("dejavu:ctl:big", 1 << 20, "x")  # a value within the bound is made as usual
        assert c.strlen("dejavu:ctl:big") == (1 << 20) + 1
        c.delete("dejavu:ctl:big")
