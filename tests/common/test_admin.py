"""Admin commands: signatures, and the ``dejavu admin`` tool against a real Redis."""

from __future__ import annotations

import base64
import json

import pytest
import redis

from dejavu_cli.main import main as dejavu
from dejavu_common import keys
from dejavu_common.admin import (
    AdminKeyError,
    AdminRejected,
    CommandVerifier,
    generate_keypair,
    sign,
    signed_bytes,
    verify_key,
)
from dejavu_common.messages import AdminAction, AdminCommand, StageAssignment, Topology, WorkerInfo, WorkerRole

SIGNING, VERIFY = generate_keypair()
NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _verifier(clock: Clock, key: str | None = VERIFY, instance: str = "inst-1") -> CommandVerifier:
    return CommandVerifier(key, "t1", instance, max_ttl_s=30, max_pause_s=60, clock_skew_s=5, clock=clock)


def _cmd(action: AdminAction = AdminAction.DRAIN, **kw) -> AdminCommand:
    kw.setdefault("now", NOW)
    return sign(SIGNING, kw.pop("worker_id", "t1"), kw.pop("instance", "inst-1"), action, **kw)


def test_a_signed_command_verifies_once_and_round_trips() -> None:
    clock = Clock()
    verifier = _verifier(clock)
    cmd = _cmd(AdminAction.PAUSE_HEARTBEATS, seconds=3.0)
    assert AdminCommand.decode(cmd.encode()) == cmd
    verifier.check(cmd)
    with pytest.raises(AdminRejected, match="replayed"):
        verifier.check(AdminCommand.decode(cmd.encode()))  # the same command, read again from the stream


def test_signature_binds_every_field() -> None:
    verifier = _verifier(Clock())
    cmd = _cmd(AdminAction.PAUSE_HEARTBEATS, seconds=3.0)
    for change in (
        {"worker_id": "t2"},
        {"instance": "inst-2"},
        {"action": AdminAction.KILL},
        {"seconds": 30.0},
        {"command_id": "f" * 32},
        {"issued_at": NOW + 1},
        {"expires_at": NOW + 20},
    ):
        with pytest.raises(AdminRejected, match="bad signature"):
            verifier.check(cmd.model_copy(update=change))


def test_a_verifier_cannot_sign_and_other_keys_do_not_verify() -> None:
    verifier = _verifier(Clock())
    other_signing, _other_verify = generate_keypair()
    # What a worker holds (the public key) used as a signing key, and a foreign deployment's key.
    for key in (VERIFY, other_signing):
        with pytest.raises(AdminRejected, match="bad signature"):
            verifier.check(sign(key, "t1", "inst-1", AdminAction.KILL, now=NOW))
    cmd = _cmd()
    flipped = bytearray(base64.b64decode(cmd.signature))
    flipped[0] ^= 1
    with pytest.raises(AdminRejected, match="bad signature"):
        verifier.check(cmd.model_copy(update={"signature": base64.b64encode(bytes(flipped)).decode()}))
    with pytest.raises(AdminRejected, match="bad signature"):
        verifier.check(cmd.model_copy(update={"signature": "not base64!"}))
    with pytest.raises(AdminRejected, match="no admin verify key"):
        _verifier(Clock(), key=None).check(cmd)
    with pytest.raises(AdminKeyError):
        verify_key(base64.b64encode(b"short").decode())


def test_commands_bind_to_the_worker_instance() -> None:
    with pytest.raises(AdminRejected, match="not to this instance"):
        _verifier(Clock(), instance="inst-restarted").check(_cmd())
    verifier = _verifier(Clock())
    assert not verifier.addressed_here(_cmd(worker_id="t9"))
    with pytest.raises(AdminRejected, match="not to this instance"):
        verifier.check(_cmd(worker_id="t9"))


def test_commands_expire_and_nonces_are_forgotten_only_after_expiry() -> None:
    clock = Clock()
    verifier = _verifier(clock)
    cmd = _cmd(ttl_s=10)
    verifier.check(cmd)
    clock.now = NOW + 14  # past expiry, inside the skew: still remembered
    with pytest.raises(AdminRejected, match="replayed"):
        verifier.check(cmd)
    clock.now = NOW + 16  # past expiry and skew: the window check refuses it
    with pytest.raises(AdminRejected, match="expired"):
        verifier.check(cmd)
    assert verifier._seen == {}  # the nonce was dropped once it could no longer verify
    with pytest.raises(AdminRejected, match="not yet valid"):
        _verifier(Clock()).check(_cmd(now=NOW + 60))
    with pytest.raises(AdminRejected, match="more than allowed"):
        _verifier(Clock()).check(_cmd(ttl_s=3600))


@pytest.mark.parametrize("seconds", [0.0, 61.0, 86_400.0])
def test_pause_seconds_are_bounded(seconds: float) -> None:
    with pytest.raises(AdminRejected, match="pause"):
        _verifier(Clock()).check(_cmd(AdminAction.PAUSE_HEARTBEATS, seconds=seconds))
    with pytest.raises(ValueError):
        _cmd(AdminAction.PAUSE_HEARTBEATS, seconds=1e9)  # beyond what a message may even carry


def test_signed_bytes_cover_a_domain_tag() -> None:
    assert signed_bytes(_cmd()).startswith(b"dejavu-admin-command-v1\x00")


def test_admin_tool_sends_signed_orders_and_reports_status(redis_url, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DEJAVU_ADMIN__SIGNING_KEY", SIGNING)
    client = redis.Redis.from_url(redis_url)
    info = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=1, instance="i", data_address="",
                      metrics_url="http://h:9400/metrics")  # fmt: skip
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
    assert cmd.action is AdminAction.PAUSE_HEARTBEATS and cmd.seconds == 2.5 and cmd.instance == "i"
    verifier = CommandVerifier(VERIFY, "t0", "i", max_ttl_s=30, max_pause_s=60, clock_skew_s=5)
    verifier.check(cmd)
    assert dejavu(["admin", "--redis-url", redis_url, "kill-worker", "nobody"]) == 2  # unknown worker: refused

    capsys.readouterr()
    assert dejavu(["admin", "--redis-url", redis_url, "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["epoch"] == 3
    assert status["workers"]["t0"]["stage"] == {"stage": 0, "layers": [0, 4]}
    assert status["workers"]["t0"]["metrics_url"] == "http://h:9400/metrics"
    assert status["watermarks"] == {"0": {"7": 12}}


@pytest.mark.parametrize("raw", [b"{}", b'{"command_id": 1}', b"not json"])
def test_malformed_admin_commands_do_not_decode(raw) -> None:
    with pytest.raises(ValueError):
        AdminCommand.decode(raw)


@pytest.mark.parametrize(
    "admin", [{"verify_key": "not-a-key"}, {"signing_key": "c2hvcnQ="}, {"verify_key": VERIFY[:-2]}]
)
def test_malformed_admin_keys_are_refused_when_settings_are_built(admin: dict) -> None:
    from pydantic import ValidationError

    from dejavu_common.settings import Settings

    with pytest.raises(ValidationError, match="admin"):
        Settings(admin=admin)
    Settings(admin={"signing_key": SIGNING, "verify_key": VERIFY})
