"""The streaming thread: FIFO order, bounded bytes in flight (back-pressure with a deadline), failures per job."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import BackPressureTimeout, PeerError
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header
from dejavulib.streamer import Streamer
from dejavulib.transport.fake import FakeTransport


class HeldTransport(FakeTransport):
    """A fake whose sends complete only when the test releases them (a slow network, deterministically)."""

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self.held: list[Handle] = []

    def send_message(self, peer_id: str, header: bytes, payload: np.ndarray) -> Handle:
        super().send_message(peer_id, header, payload)
        handle = Handle(payload.nbytes)
        self.held.append(handle)
        return handle


def _wait_held(held: HeldTransport, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(held.held) < n:
        assert time.monotonic() < deadline, "the streaming thread did not send"
        time.sleep(0.001)


def _pair() -> tuple[Endpoint, Endpoint, HeldTransport]:
    held = HeldTransport("a")
    a, b = Endpoint(held, "s"), Endpoint(FakeTransport("b"), "s")
    a.connect("b", b.address)
    return a, b, held


def test_fifo_and_back_pressure() -> None:
    a, b, held = _pair()
    streamer = Streamer(a, max_inflight_bytes=2000)
    h1 = streamer.submit("b", Header(Channel.KV_REPLICA, step=1), np.zeros(1000, np.uint8), deadline_s=5)
    h2 = streamer.submit("b", Header(Channel.KV_REPLICA, step=2), np.zeros(1000, np.uint8), deadline_s=5)
    with pytest.raises(BackPressureTimeout):
        streamer.submit("b", Header(Channel.KV_REPLICA, step=3), np.zeros(1000, np.uint8), 5, admit_deadline_s=0.2)
    assert streamer.inflight_bytes == 2000
    _wait_held(held, 1)  # the streaming thread has reached the first send
    held.held[0].set_done()
    h1.wait(5)
    h3 = streamer.submit("b", Header(Channel.KV_REPLICA, step=3), np.zeros(1000, np.uint8), deadline_s=5)
    for i in (1, 2):
        _wait_held(held, i + 1)
        held.held[i].set_done()
    h2.wait(5)
    h3.wait(5)
    assert [b.recv(Channel.KV_REPLICA, 1).header.step for _ in range(3)] == [1, 2, 3]
    streamer.close()


def test_failed_job_fails_only_its_handle() -> None:
    a, _b, _held = _pair()
    streamer = Streamer(a, max_inflight_bytes=1 << 20)
    bad = streamer.submit("nobody", Header(Channel.TOKENS), np.zeros(4, np.uint8), deadline_s=1)
    with pytest.raises(PeerError):
        bad.wait(5)
    assert streamer.inflight_bytes == 0
    streamer.close()
