"""What an endpoint admits before a payload buffer is sized: authenticated, fresh (never replayed) and
bounded messages only. In-process, over the fake transport; the UCX side is in test_endpoint.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import TransferTimeout
from dejavulib.header import Channel, Header, secret_key
from dejavulib.replay import ReplayGuard

from .fake_transport import FakeTransport

SECRET = "admission-secret"


class Recorder(FakeTransport):
    """A fake transport that keeps a copy of every message it sends (an on-path recorder)."""

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self.sent: list[tuple[bytes, np.ndarray]] = []

    def send_message(self, peer_id, header, payload):
        self.sent.append((bytes(header), payload.copy()))
        return super().send_message(peer_id, header, payload)


def _pair(max_message_bytes: int = 1 << 20) -> tuple[Endpoint, Recorder, Endpoint]:
    receiver = Endpoint(FakeTransport("receiver"), SECRET, max_message_bytes=max_message_bytes)
    transport = Recorder("sender")
    sender = Endpoint(transport, SECRET)
    sender.connect("receiver", receiver.address)
    return sender, transport, receiver


def _drain(endpoint: Endpoint, channel: Channel) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(endpoint.recv(channel, 0.05).payload.tobytes())
        except TransferTimeout:
            return out


def test_a_replayed_message_is_delivered_once() -> None:
    sender, recorder, receiver = _pair()
    sender.send("receiver", Header(Channel.TOKENS), np.arange(8, dtype=np.uint8)).wait()
    header, payload = recorder.sent[-1]
    for _ in range(3):  # the recorded message, injected again
        recorder.send_message("receiver", header, payload)
    assert _drain(receiver, Channel.TOKENS) == [bytes(range(8))]
    assert receiver.stats["rejected_replay"] == 3 and receiver.stats["delivered"] == 1


def test_later_messages_and_a_restarted_sender_are_not_replays() -> None:
    sender, _recorder, receiver = _pair()
    for i in range(5):
        sender.send("receiver", Header(Channel.TOKENS, step=i), np.full(4, i, np.uint8)).wait()
    restarted = Endpoint(FakeTransport("sender"), SECRET)  # same id and epoch, new process
    restarted.connect("receiver", receiver.address)
    restarted.send("receiver", Header(Channel.TOKENS, step=5), np.full(4, 5, np.uint8)).wait()
    assert len(_drain(receiver, Channel.TOKENS)) == 6
    assert receiver.stats["rejected_replay"] == 0


def test_an_authenticated_oversized_message_is_refused_before_its_payload() -> None:
    sender, _recorder, receiver = _pair(max_message_bytes=1024)
    sender.send("receiver", Header(Channel.KV_PROMPT), np.zeros(1025, np.uint8)).wait()
    sender.send("receiver", Header(Channel.KV_PROMPT), np.zeros(1024, np.uint8)).wait()
    assert [len(p) for p in _drain(receiver, Channel.KV_PROMPT)] == [1024]
    assert receiver.stats["rejected_size"] == 1


def test_a_payload_of_another_size_than_declared_is_not_delivered() -> None:
    sender, recorder, receiver = _pair()
    sender.send("receiver", Header(Channel.TOKENS), np.zeros(16, np.uint8)).wait()
    _drain(receiver, Channel.TOKENS)
    key = secret_key(SECRET)
    sealed = Header(Channel.TOKENS).with_payload(
        memoryview(np.zeros(16, np.uint8)), key, epoch=0, seq=time.time_ns(), sender="sender"
    )
    recorder.send_message("receiver", sealed.pack(key), np.zeros(1 << 16, np.uint8))  # declares 16, sends 64 KiB
    assert _drain(receiver, Channel.TOKENS) == []


def test_replay_guard_window() -> None:
    guard = ReplayGuard(window=4)
    assert guard.accept("a", 1, 100)
    assert not guard.accept("a", 1, 100)
    assert guard.accept("a", 1, 98)  # late, inside the window: once
    assert not guard.accept("a", 1, 98)
    assert not guard.accept("a", 1, 96)  # older than the window
    assert guard.accept("a", 2, 100) and guard.accept("b", 1, 100)  # other epoch, other sender
    for seq in range(101, 120):
        assert guard.accept("a", 1, seq)
    assert not guard.accept("a", 1, 110)
    guard.forget_before(2)
    assert guard.accept("a", 1, 100)  # forgotten: but epoch 1 is fenced by the endpoint by then
    with pytest.raises(ValueError):
        ReplayGuard(window=0)
