"""The streaming thread: FIFO order, bounded bytes in flight (back-pressure with a deadline), failures per job."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import BackPressureTimeout, PeerError, TransferTimeout
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header
from dejavulib.streamer import Streamer

from .fake_transport import FakeTransport


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


def test_sends_are_pipelined_and_staging_buffers_are_reused() -> None:
    """The thread packs and sends the next region while earlier sends are still in flight, and a staging
    buffer is reused only once the transport is done with it."""
    import torch

    from dejavulib.kvcache import KVCache
    from dejavulib.layout import KVLayout, Which

    a, b, held = _pair()
    streamer = Streamer(a, max_inflight_bytes=1 << 20)
    cache = KVCache.allocate(KVLayout(2, 2, 1, 8, 4))
    cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
    regions = [cache.layout.region(positions=(p, p + 1)) for p in range(3)]
    handles = [
        streamer.submit_region("b", Header(Channel.KV_REPLICA, step=i), cache, r, 5) for i, r in enumerate(regions)
    ]
    _wait_held(held, 3)  # all three sent though none has completed
    payloads = [b.recv(Channel.KV_REPLICA, 1) for _ in range(3)]
    for i, m in enumerate(payloads):
        want = cache.view(regions[i], Which.K).contiguous().view(-1)
        assert torch.equal(m.tensor()[: want.numel()], want), "a buffer still in flight was overwritten"
    for h in held.held:
        h.set_done()
    for h in handles:
        h.wait(5)
    assert streamer.inflight_bytes == 0
    assert len(streamer._pool._free) == 3  # back in the pool once their sends completed
    streamer.close()


def test_a_send_that_never_completes_fails_at_its_deadline_and_frees_the_bound() -> None:
    a, _b, held = _pair()
    streamer = Streamer(a, max_inflight_bytes=1000)
    stuck = streamer.submit("b", Header(Channel.KV_REPLICA), np.zeros(1000, np.uint8), deadline_s=0.2)
    _wait_held(held, 1)
    with pytest.raises(TransferTimeout):
        stuck.wait(5)
    assert streamer.inflight_bytes == 0
    # The next job is admitted at once, though the stuck send never completed.
    streamer.submit("b", Header(Channel.KV_REPLICA), np.zeros(1000, np.uint8), deadline_s=5, admit_deadline_s=0.5)
    streamer.close()


def test_a_failure_of_the_thread_itself_is_reported_and_closes_the_streamer() -> None:
    """Not one job's failure (that fails its handle only) but the thread's: nothing would leave any more,
    so the owner is told (a worker ends its process, its lease expires) and new jobs are refused."""
    import threading

    from dejavulib.errors import ClosedError

    class Broken(Streamer):
        armed = threading.Event()

        def _expire(self) -> None:  # breaks on the streaming thread only, outside any job
            if self.armed.is_set() and threading.current_thread() is self._thread:
                raise RuntimeError("the streaming thread broke")
            super()._expire()

    a, _b, _held = _pair()
    streamer = Broken(a, max_inflight_bytes=1 << 20)
    failed: list[BaseException] = []
    reported = threading.Event()
    streamer.on_failure = lambda exc: (failed.append(exc), reported.set())
    Broken.armed.set()
    streamer.submit("b", Header(Channel.KV_REPLICA), np.zeros(8, np.uint8), deadline_s=5)  # wakes the thread
    assert reported.wait(5) and "broke" in str(failed[0])
    with pytest.raises(ClosedError):
        streamer.submit("b", Header(Channel.KV_REPLICA), np.zeros(8, np.uint8), deadline_s=1)
