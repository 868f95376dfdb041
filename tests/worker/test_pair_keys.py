"""Per-pair data-plane keys between real worker endpoints (UCX between endpoints of this process, each
published in a real Redis registry): a worker that holds the deployment secret cannot speak for another,
a message sealed for another pair or by an unpublished sender is dropped and counted while the receiver
keeps serving, and a restarted worker's new key is learned."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from dejavu_common import keys
from dejavu_common.messages import WorkerInfo
from dejavu_common.settings import TransportSettings
from dejavu_worker.endpoint import DataEndpoint
from dejavulib.header import Channel, Header, secret_key, sender_field
from tests.worker.records import register

pytestmark = pytest.mark.ucx

LONG_ID = "token-worker-b.a-rather-long-hostname.example.internal"  # its headers carry a head and a digest
SETTINGS = TransportSettings()
MEMBER = secret_key(SETTINGS.secret.get_secret_value())  # what every member of the deployment holds


@pytest.fixture
def registry(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def workers(registry: redis.Redis) -> Iterator[Callable[..., DataEndpoint]]:
    """Makes a worker's endpoint over UCX and publishes its record (``instance``); closes them all."""
    from dejavulib.transport.ucx import UcxTransport

    made: list[DataEndpoint] = []

    def make(worker_id: str, instance: str = "i", publish: bool = True) -> DataEndpoint:
        endpoint = DataEndpoint(SETTINGS, worker_id, transport=UcxTransport(worker_id), registry=registry)
        made.append(endpoint)
        register(registry, endpoint, instance)
        if not publish:  # a record without a data-plane key
            info = WorkerInfo.decode(registry.hget(keys.worker(worker_id), "info"))
            registry.hset(keys.worker(worker_id), "info", info.model_copy(update={"data_key": ""}).encode())
        return endpoint

    yield make
    for endpoint in made:
        endpoint.close()


def _wait(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


def _inject(via: DataEndpoint, to: str, sender: str, key: bytes, key_id: bytes, payload: bytes, seq: int) -> None:
    """Put a message sealed with ``key`` and naming ``sender`` on ``via``'s link to ``to`` (what a compromised
    worker can do: it holds the deployment secret and writes its own headers)."""
    data = np.frombuffer(payload, np.uint8)
    header = Header(Channel.TOKENS).with_payload(memoryview(data), key, epoch=0, seq=seq, sender=sender, key_id=key_id)
    via._ep.transport.send_message(to, header.pack(MEMBER, key), data).wait(10)


def _received(endpoint: DataEndpoint, count: int) -> set[tuple[str, bytes]]:
    got = set()
    for _ in range(count):
        message = endpoint.recv_message(Channel.TOKENS, 10.0)
        assert message is not None
        got.add((message.header.sender, message.payload.tobytes()))
    return got


def test_a_worker_holding_the_secret_cannot_get_a_message_accepted_as_another_workers(registry, workers) -> None:
    b, c, m = workers(LONG_ID), workers("c"), workers("m")
    b.connect_all(registry, ["c"])
    m.connect_all(registry, ["c"])
    as_b = sender_field(LONG_ID)
    forgeries = [  # m knows the secret, b's id and b's published key, not b's private key
        (MEMBER, b.keys.key_id),  # the deployment key, which any member held to seal as any other
        (m.keys.sending("c")[0], b.keys.key_id),  # its own pair key with c, under b's key id
        (m.keys.sending("c")[0], m.keys.key_id),  # ... and under its own
    ]
    for seq, (key, kid) in enumerate(forgeries):
        _inject(m, "c", as_b, key, kid, b"text in b's name", seq)
    _wait(lambda: c.stats["rejected_sender"] == 3)
    b.send("c", Channel.TOKENS, b"from b")
    m.send("c", Channel.TOKENS, b"from m")
    assert _received(c, 2) == {(as_b, b"from b"), ("m", b"from m")}
    assert c.recv_message(Channel.TOKENS, 0.2) is None
    assert c.stats["rejected_sender"] == 3 and c.corrupt["TOKENS"] == 0


def test_a_wrong_pair_key_or_an_unpublished_sender_is_dropped_and_counted_and_the_receiver_serves_on(
    registry, workers
) -> None:
    b, c, _d, n = workers("b"), workers("c"), workers("d"), workers("n", publish=False)
    b.connect_all(registry, ["c", "d"])
    n.connect_all(registry, ["c"])
    key_for_d, kid = b.keys.sending("d")
    _inject(b, "c", "b", key_for_d, kid, b"sealed for d", 1)  # b's own message, but for another receiver
    n.send("c", Channel.TOKENS, b"from a worker that publishes no key")
    _wait(lambda: c.stats["rejected_sender"] == 2)
    b.send("c", Channel.TOKENS, b"next")
    assert _received(c, 1) == {("b", b"next")}
    assert c.stats["rejected_sender"] == 2 and c.stats["delivered"] == 1


def test_a_restarted_worker_is_sent_to_and_heard_with_its_new_key_and_its_old_key_is_refused(registry, workers) -> None:
    old, c = workers("b"), workers("c")
    old.connect_all(registry, ["c"])
    c.connect_all(registry, ["b"])
    old.send("c", Channel.TOKENS, b"before")
    c.send("b", Channel.TOKENS, b"to the first b")
    assert _received(c, 1) == {("b", b"before")}
    assert old.recv(Channel.TOKENS, 10.0) is not None
    old_key, old_kid = old.keys.sending("c")
    old.close()

    new = workers("b", instance="i2")  # the same worker id, a new process: a new key pair and address
    assert new.keys.key_id != old_kid
    new.connect_all(registry, ["c"])
    new.send("c", Channel.TOKENS, b"after")
    assert _received(c, 1) == {("b", b"after")}  # c looked the new key up on its first message
    c.connect_all(registry, ["b"])  # the next epoch: c reconnects to b's new address, with its new key
    c.send("b", Channel.TOKENS, b"to the second b")
    got = new.recv(Channel.TOKENS, 10.0)
    assert got is not None and bytes(got) == b"to the second b"
    _inject(new, "c", "b", old_key, old_kid, b"sealed by the first process", 99)
    _wait(lambda: c.stats["rejected_sender"] == 1)
    assert c.recv_message(Channel.TOKENS, 0.2) is None
