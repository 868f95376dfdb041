"""What a dead, stopped or flooding peer leaves behind in a UCX receiver: nothing that grows.

A sender SIGKILLed in the middle of a large message leaves a receive UCX never completes and cannot cancel:
giving it up releases its buffer's pages and takes it off the outstanding requests. Forgotten dead peers
leave no endpoint or send behind. A peer that sends faster than the receiver consumes fills its channel's
backlog up to the bound and no further; an oversized message is refused before any buffer is sized.
"""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import PeerError
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header

from .conftest import SECRET, UcxPeer

pytestmark = pytest.mark.ucx


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached within {timeout_s} s: {what}"
        time.sleep(0.02)


def test_a_sender_killed_mid_message_leaves_no_payload_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver's I/O thread is held once 64 KiB of a 256 MiB payload have landed, the sender is SIGKILLed
    and the thread let go: the receive never completes. Once given up, no outstanding request keeps the
    buffer, the transport and the endpoint account for none of it, and its pages read as released."""
    from dejavulib.transport import ucx

    monkeypatch.setattr(ucx, "_INBOUND_GIVE_UP_S", 0.5)
    monkeypatch.setattr(ucx, "_HOUSEKEEPING_S", 0.1)
    nbytes, landed = 256 << 20, 64 << 10
    transport = ucx.UcxTransport("driver", progress="thread")
    endpoint = Endpoint(transport, SECRET)
    peer = UcxPeer(endpoint=endpoint, name="peer")
    gate, held = threading.Event(), threading.Event()
    buffers: list[np.ndarray] = []
    payload_done = transport._payload_done

    def hold_mid_message(sender: int, slot: ucx._Inbound, payload: np.ndarray):  # on the I/O thread
        def hold() -> None:
            deadline = time.monotonic() + 20
            while payload[landed] != 1 and time.monotonic() < deadline:  # the peer sends ones
                transport._worker.progress()
            held.set()
            gate.wait(30)

        buffers.append(payload)
        transport._ops.append((hold, Handle()))
        return payload_done(sender, slot, payload)

    try:
        transport._payload_done = hold_mid_message
        peer.command(op="send_kv", count=1, nbytes=nbytes, interval_s=0)
        assert held.wait(30), "the payload's receive was never posted"
        (buffer,) = buffers
        assert buffer[landed] == 1 and transport.held_bytes == nbytes
        assert endpoint.backlog(Channel.KV_PROMPT) == (1, nbytes)
        peer.kill()
        gate.set()
        _wait(lambda: transport.held_bytes == 0, "the given-up payload released")
        assert transport._call(lambda: [p.nbytes for p in transport._pending if p.nbytes >= nbytes], 5) == []
        assert transport._call(lambda: [p.keepalive[0] is buffer for p in transport._stranded], 5) == [True]
        page = -(-buffer.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE - buffer.ctypes.data
        assert not buffer[page : page + mmap.PAGESIZE].any(), "the landed bytes' page was not handed back"
        assert endpoint.backlog(Channel.KV_PROMPT) == (0, 0)
        assert endpoint.stats["dropped_in_transfer"] == 1 and endpoint.stats["delivered"] == 0
    finally:
        gate.set()
        peer.stop()
        endpoint.close()


def test_forgotten_dead_peers_leave_nothing_behind() -> None:
    """Peers stopped with sends outstanding, SIGKILLed and forgotten, one after another: their endpoints and
    sends are let go once UCX settles them, instead of accumulating for the life of the process."""
    from dejavulib.transport.ucx import UcxTransport

    transport = UcxTransport("driver", progress="thread")
    endpoint = Endpoint(transport, SECRET)
    try:
        for i in range(3):
            victim = UcxPeer(endpoint=endpoint, name=f"victim-{i}")
            try:
                os.kill(victim.proc.pid, signal.SIGSTOP)  # stops reading: what it is sent stays outstanding
                handles = [
                    endpoint.send(victim.name, Header(Channel.KV_REPLICA), np.ones(800 << 10, np.uint8), 30.0)
                    for _ in range(2)
                ]
                victim.kill()
                endpoint.forget(victim.name)
                for handle in handles:
                    with pytest.raises(PeerError):  # failed now, not at its deadline
                        handle.wait(5)
            finally:
                victim.stop()
        _wait(lambda: transport._call(lambda: len(transport._abandoned), 5) == 0, "forgotten peers let go")
    finally:
        endpoint.close()


def test_a_flooding_peer_fills_its_channel_backlog_to_the_bound_and_no_further() -> None:
    """A peer sends 40 messages that nobody receives: 8 are admitted (the bound), the rest are dropped unread
    and counted; the receiver holds 8 payloads, and once it takes them the channel admits again."""
    from dejavulib.transport.ucx import UcxTransport

    transport = UcxTransport("driver", progress="thread")
    endpoint = Endpoint(transport, SECRET, max_queued_messages=8)
    peer = UcxPeer(endpoint=endpoint, name="peer")
    try:
        peer.command(op="send_kv", count=40, nbytes=256 << 10, interval_s=0)
        _wait(lambda: endpoint.stats["rejected_backlog"] == 32, "the flood past the bound dropped")
        assert endpoint.backlog(Channel.KV_PROMPT) == (8, 8 * (256 << 10))
        assert endpoint.pending(Channel.KV_PROMPT) == 8 and transport.held_bytes == 0
        for _ in range(8):
            endpoint.recv(Channel.KV_PROMPT, 5)
        assert endpoint.backlog(Channel.KV_PROMPT) == (0, 0)
        peer.command(op="send_kv", count=1, nbytes=1024, interval_s=0)
        assert endpoint.recv(Channel.KV_PROMPT, 10).payload.nbytes == 1024
    finally:
        peer.stop()
        endpoint.close()


def test_an_oversized_message_is_refused_before_its_payload_is_sized() -> None:
    """A 64 MiB message to a receiver that accepts 1 MiB: dropped unread (no buffer, nothing held), counted,
    and the sender's next message is delivered. The receiver's own endpoint refuses to send one."""
    from dejavulib.transport.ucx import UcxTransport

    receiver = Endpoint(UcxTransport("receiver"), SECRET, max_message_bytes=1 << 20)
    sender = Endpoint(UcxTransport("sender"), SECRET)
    big = np.ones(64 << 20, np.uint8)
    try:
        sender.connect("receiver", receiver.address)
        tracemalloc.start()
        sender.send("receiver", Header(Channel.KV_PROMPT), big)
        sender.send("receiver", Header(Channel.KV_PROMPT), big[:1024])
        message = receiver.recv(Channel.KV_PROMPT, 20)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert message.payload.nbytes == 1024 and receiver.stats["rejected_size"] == 1
        assert peak < 4 << 20, f"the receiver allocated {peak} bytes"
        assert receiver.transport.held_bytes == 0 and receiver.backlog(Channel.KV_PROMPT) == (0, 0)
        with pytest.raises(ValueError, match="over max_message_bytes"):
            receiver.send("sender", Header(Channel.KV_PROMPT), big)
    finally:
        tracemalloc.stop()
        sender.close()
        receiver.close()


def _queued_kinds(transport) -> list[int]:
    """Kinds of the messages waiting in ``transport``'s UCX unexpected queue."""
    from dejavulib.transport.ucx import _KIND_MASK

    def probe() -> list[int]:
        mask = transport._api.UCXXTagMask(_KIND_MASK)
        return [
            kind
            for kind in range(16)
            if transport._worker.tag_probe(transport._api.UCXXTag(kind << 60), mask, remove=False).matched
        ]

    return transport._call(probe, 5)


def test_messages_nothing_will_receive_do_not_stay_in_ucxs_unexpected_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that knows the address sends what no receive will ever match: a kind no sender uses, chunks to
    a transport that takes none, receive-path probes nobody awaits, payloads without a header; eager-sized
    and rendezvous-sized. The receiver discards them all, and still delivers a real message."""
    from dejavulib.transport import ucx

    monkeypatch.setattr(ucx, "_HOUSEKEEPING_S", 0.1)
    victim = Endpoint(ucx.UcxTransport("victim", progress="thread", chunks=False), SECRET)
    rogue = ucx.UcxTransport("rogue")
    sender = Endpoint(ucx.UcxTransport("sender"), SECRET)
    strays = [np.ones(n, np.uint8) for n in (16, 1 << 20)]
    try:
        rogue.connect("victim", victim.address)
        sender.connect("victim", victim.address)
        post = rogue._post_send
        for kind in (9, ucx.KIND_CHUNK, ucx.KIND_PROBE, ucx.KIND_PAYLOAD):
            for seq, data in enumerate(strays):
                tag = ucx.make_tag(kind, ucx.peer_hash("rogue"), 1000 + seq)
                rogue._submit(lambda t=tag, d=data: post(rogue._ep("victim"), d, t, lambda e: None, "victim"), Handle())
        _wait(lambda: victim.transport.swept == 8, "the strays discarded")
        assert _queued_kinds(victim.transport) == []
        sender.send("victim", Header(Channel.TOKENS), np.arange(64, dtype=np.uint8))
        assert victim.recv(Channel.TOKENS, 10).payload.tobytes() == bytes(range(64))
        with pytest.raises(ValueError, match="no chunks"):
            victim.transport.fetch("rogue", 1000, np.empty(16, np.uint8), 1.0)
    finally:
        rogue.close()
        sender.close()
        victim.close()


def test_sweeping_at_every_pass_takes_no_message_that_has_a_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large payloads, header-only messages and small ones, interleaved, with the sweep running at every I/O
    pass: every one is delivered, in order, and nothing is discarded."""
    from dejavulib.transport import ucx

    monkeypatch.setattr(ucx, "_HOUSEKEEPING_S", 0.0)
    receiver = Endpoint(ucx.UcxTransport("receiver", chunks=False), SECRET)
    sender = Endpoint(ucx.UcxTransport("sender"), SECRET)
    try:
        sender.connect("receiver", receiver.address)
        big = np.arange(4 << 20, dtype=np.uint8)
        for i in range(10):
            sender.send("receiver", Header(Channel.KV_RESTORE, microbatch=i, step=0), big)
            sender.send("receiver", Header(Channel.KV_RESTORE, microbatch=i, step=1))
            sender.send("receiver", Header(Channel.KV_RESTORE, microbatch=i, step=2), big[:100])
        got = [receiver.recv(Channel.KV_RESTORE, 20).header for _ in range(30)]
        assert [(h.microbatch, h.step) for h in got] == [(i, s) for i in range(10) for s in range(3)]
        assert receiver.transport.swept == 0 and receiver.stats["dropped_in_transfer"] == 0
    finally:
        sender.close()
        receiver.close()
