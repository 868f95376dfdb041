"""An endpoint's per-channel backlog (admitted, not yet received) is bounded, and every way a message
leaves it (received, dropped in transfer, fenced by an epoch) gives its room back. In-process, over the
fake transport; the UCX side is in test_ucx_leaks.py. Also: a released buffer's pages read as zeros."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import TransferTimeout
from dejavulib.header import Channel, Header, secret_key
from dejavulib.transport.pages import release_pages

from .fake_transport import FakeTransport

SECRET = "backlog-secret"


def _pair(**bounds: int) -> tuple[Endpoint, Endpoint]:
    receiver = Endpoint(FakeTransport("receiver"), SECRET, **bounds)
    sender = Endpoint(FakeTransport("sender"), SECRET)
    sender.connect("receiver", receiver.address)
    return sender, receiver


def _send(sender: Endpoint, channel: Channel, nbytes: int, count: int = 1) -> None:
    for _ in range(count):
        sender.send("receiver", Header(channel), np.zeros(nbytes, np.uint8)).wait()


def test_messages_past_a_channels_bound_are_dropped_and_counted() -> None:
    sender, receiver = _pair(max_queued_messages=3, max_queued_bytes=1000)
    _send(sender, Channel.TOKENS, 10, count=5)
    assert receiver.backlog(Channel.TOKENS) == (3, 30) and receiver.stats["rejected_backlog"] == 2
    _send(sender, Channel.ACTIVATION, 10)  # another channel has its own room
    assert receiver.backlog(Channel.ACTIVATION) == (1, 10)
    receiver.recv(Channel.TOKENS, 1)
    _send(sender, Channel.TOKENS, 10)  # a message taken makes room for one
    assert receiver.backlog(Channel.TOKENS) == (3, 30) and receiver.stats["rejected_backlog"] == 2


def test_the_byte_bound_holds_and_an_empty_channel_always_takes_one_message() -> None:
    sender, receiver = _pair(max_queued_bytes=100, max_message_bytes=1000)
    _send(sender, Channel.KV_PROMPT, 60)
    _send(sender, Channel.KV_PROMPT, 60)  # 120 > 100: dropped
    assert receiver.backlog(Channel.KV_PROMPT) == (1, 60) and receiver.stats["rejected_backlog"] == 1
    receiver.recv(Channel.KV_PROMPT, 1)
    _send(sender, Channel.KV_PROMPT, 900)  # over the byte bound, alone: admitted (the largest message fits)
    assert receiver.recv(Channel.KV_PROMPT, 1).payload.nbytes == 900
    assert receiver.backlog(Channel.KV_PROMPT) == (0, 0)


def test_a_message_dropped_after_admission_gives_its_room_back() -> None:
    """Admitted for 16 bytes, then a payload of another size: the transport drops it and says so."""
    import time

    sender, receiver = _pair(max_queued_messages=1)
    key = secret_key(SECRET)
    sealed = Header(Channel.TOKENS).with_payload(
        memoryview(np.zeros(16, np.uint8)), key, epoch=0, seq=time.time_ns(), sender="sender"
    )
    sender.transport.send_message("receiver", sealed.pack(key), np.zeros(64, np.uint8))
    assert receiver.backlog(Channel.TOKENS) == (0, 0) and receiver.stats["dropped_in_transfer"] == 1
    _send(sender, Channel.TOKENS, 8)
    assert receiver.recv(Channel.TOKENS, 1).payload.nbytes == 8


def test_messages_fenced_by_a_new_epoch_give_their_room_back() -> None:
    sender, receiver = _pair(max_queued_messages=2)
    _send(sender, Channel.KV_REPLICA, 8, count=2)
    receiver.set_epoch(1)
    assert receiver.backlog(Channel.KV_REPLICA) == (0, 0)
    with pytest.raises(TransferTimeout):
        receiver.recv(Channel.KV_REPLICA, 0.05)


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Endpoint(FakeTransport("x"), SECRET, max_queued_messages=0)


def test_a_sender_refuses_a_payload_its_peers_would_drop() -> None:
    sender = Endpoint(FakeTransport("sender"), SECRET, max_message_bytes=1024)
    with pytest.raises(ValueError, match="over max_message_bytes"):
        sender.send("receiver", Header(Channel.KV_PROMPT), np.zeros(1025, np.uint8))


def test_released_pages_read_as_zeros_and_the_partial_ends_are_kept() -> None:
    buffer = np.ones(16 * mmap.PAGESIZE + 100, np.uint8)[50:]  # unaligned at both ends
    released = release_pages(buffer)
    start = -(-buffer.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE - buffer.ctypes.data
    assert released % mmap.PAGESIZE == 0 and released >= 14 * mmap.PAGESIZE
    assert not buffer[start : start + released].any()
    assert buffer[:start].all() and buffer[start + released :].all()
    buffer[start] = 7  # still ours to write
    assert buffer[start] == 7
    assert release_pages(np.ones(10, np.uint8)) == 0
