"""Admin commands: signatures, and the ``dejavu admin`` tool against a real Redis."""

from __future__ import annotations

import json

import pytest
import redis

from dejavu_cli.main import main as dejavu
from dejavu_common import keys
from dejavu_common.admin import sign, verify
from dejavu_common.messages import AdminAction, AdminCommand, StageAssignment, Topology, WorkerInfo, WorkerRole


def test_signature_binds_every_field_and_the_credential() -> None:
    cmd = sign("t1", AdminAction.PAUSE_HEARTBEATS, "secret", seconds=3.0)
    assert verify(cmd, "secret")
    assert not verify(cmd, "other")
    for change in ({"worker_id": "t2"}, {"action": AdminAction.KILL}, {"seconds": 30.0}):
        assert not verify(cmd.model_copy(update=change), "secret")
    assert AdminCommand.decode(cmd.encode()) == cmd


def test_admin_tool_sends_signed_orders_and_reports_status(redis_url, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DEJAVU_ADMIN__CREDENTIAL", "cred")
    client = redis.Redis.from_url(redis_url)
    info = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=1, instance="i", data_address="")
    client.hset(keys.worker("t0"), mapping={"info": info.encode(), "state": "serving", "epoch": 3})
    client.sadd(keys.WORKERS, "t0")
    client.set(keys.worker_lease("t0"), "1", px=5000)
    topo = Topology(
        epoch=3,
        mode="colocated",
        n_layers=4,
        prompt_microbatch=1,
        token_microbatch=1,
        token_stages=(StageAssignment(worker_id="t0", stage=0, layers=(0, 4)),),
    )
    client.set(keys.TOPOLOGY, topo.encode())
    client.hset(keys.watermark(0), 7, 12)

    assert dejavu(["admin", "--redis-url", redis_url, "pause-heartbeats", "t0", "2.5"]) == 0
    ((_id, fields),) = client.xrange(keys.ADMIN_STREAM)
    cmd = AdminCommand.decode(fields[b"cmd"])
    assert cmd.action is AdminAction.PAUSE_HEARTBEATS and cmd.seconds == 2.5 and verify(cmd, "cred")
    assert dejavu(["admin", "--redis-url", redis_url, "kill-worker", "nobody"]) == 2  # unknown worker: refused

    capsys.readouterr()
    assert dejavu(["admin", "--redis-url", redis_url, "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["epoch"] == 3
    assert status["workers"]["t0"]["stage"] == {"stage": 0, "layers": [0, 4]}
    assert status["watermarks"] == {"0": {"7": 12}}


@pytest.mark.parametrize("raw", [b"{}", b'{"command_id": 1}', b"not json"])
def test_malformed_admin_commands_do_not_decode(raw) -> None:
    with pytest.raises(ValueError):
        AdminCommand.decode(raw)
