"""The message channel over real UCX between processes: round trips, auth, epochs, integrity, dead peers."""

from __future__ import annotations

import collections
import contextlib
import time
import tracemalloc

import numpy as np
import pytest
import torch

from dejavulib.endpoint import Endpoint
from dejavulib.errors import IntegrityError, PeerError, TransferTimeout, TransportUnavailable
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header, secret_key
from dejavulib.streamer import Streamer
from dejavulib.transport.ucx import satisfies

from .conftest import UcxPeer

pytestmark = pytest.mark.ucx


def test_tensors_round_trip_per_channel(ucx_peer) -> None:
    activation = torch.randn(2, 5, 16)
    tokens = torch.tensor([[3, 1, 4]], dtype=torch.int64)
    ucx_peer.command(op="echo_messages", channel=int(Channel.ACTIVATION), count=1)
    ucx_peer.command(op="echo_messages", channel=int(Channel.TOKENS), count=1)
    ucx_peer.endpoint.send("peer", Header(Channel.ACTIVATION, microbatch=7, step=2), activation).wait()
    ucx_peer.endpoint.send("peer", Header(Channel.TOKENS, microbatch=7), tokens).wait()
    tok = ucx_peer.endpoint.recv(Channel.TOKENS, 10)
    act = ucx_peer.endpoint.recv(Channel.ACTIVATION, 10)
    assert torch.equal(act.tensor(), activation) and (act.header.microbatch, act.header.step) == (7, 2)
    assert torch.equal(tok.tensor(), tokens) and tok.header.sender == "peer"


def test_wrong_secret_is_rejected_and_counted(ucx_peer) -> None:
    payload = np.arange(64, dtype=np.uint8)
    wrong = secret_key("not-the-secret")
    forged = Header(Channel.CONTROL).with_payload(memoryview(payload), wrong, epoch=0, seq=0, sender="driver")
    ucx_peer.transport.send_message("peer", forged.pack(wrong), payload).wait(10)
    ucx_peer.command(op="stats")
    stats = ucx_peer.reply()
    assert stats["rejected_auth"] == 1, stats


def test_stale_epoch_is_rejected(ucx_peer) -> None:
    # The peer fences on arrival, so wait for each epoch change's ack before relying on it.
    ucx_peer.command(op="set_epoch", epoch=3)
    assert ucx_peer.reply() == {"epoch": 3}
    ucx_peer.endpoint.send("peer", Header(Channel.ACTIVATION), np.full(8, 1, np.uint8)).wait()  # epoch 0: stale
    ucx_peer.endpoint.set_epoch(3)
    ucx_peer.endpoint.send("peer", Header(Channel.ACTIVATION), np.full(8, 2, np.uint8)).wait()
    ucx_peer.command(op="echo_messages", channel=int(Channel.ACTIVATION), count=1)
    echoed = ucx_peer.endpoint.recv(Channel.ACTIVATION, 10)
    assert echoed.payload.tolist() == [2] * 8 and echoed.header.epoch == 3
    ucx_peer.command(op="stats")
    assert ucx_peer.reply()["rejected_stale_epoch"] == 1
    # Both sides stay at epoch 3: later tests of this module's peer need no reset (epochs only move forward).


def test_corrupted_payload_raises_integrity_error(ucx_peer) -> None:
    ucx_peer.command(op="send_corrupt", nbytes=100_000)
    with pytest.raises(IntegrityError):
        ucx_peer.endpoint.recv(Channel.TOKENS, 10)


def test_a_replayed_message_is_delivered_once(ucx_peer) -> None:
    ucx_peer.command(op="replay", channel=int(Channel.TOKENS), nbytes=64, count=3)
    assert ucx_peer.endpoint.recv(Channel.TOKENS, 10).payload.tolist() == list(range(64))
    deadline = time.monotonic() + 10
    while ucx_peer.endpoint.stats["rejected_replay"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ucx_peer.endpoint.stats["rejected_replay"] == 2
    with pytest.raises(TransferTimeout):
        ucx_peer.endpoint.recv(Channel.TOKENS, 0.2)


def test_an_unauthenticated_peer_cannot_make_the_receiver_allocate() -> None:
    """Oversized "headers" and a forged header announcing 64 MiB: the receiver sizes no buffer for them."""
    from dejavulib.transport.ucx import KIND_HEADER, UcxTransport, make_tag, peer_hash

    victim = Endpoint(UcxTransport("victim"), "the-secret")
    rogue = UcxTransport("rogue")
    try:
        rogue.connect("victim", victim.address)
        big = np.ones(64 << 20, np.uint8)
        wrong = secret_key("not-the-secret")
        forged = Header(Channel.KV_PROMPT).with_payload(memoryview(big), wrong, epoch=0, seq=1, sender="rogue")
        tracemalloc.start()
        rogue._submit(  # a 1 MiB message posing as a header
            lambda: rogue._post_send(
                rogue._ep("victim"),
                big[: 1 << 20],
                make_tag(KIND_HEADER, peer_hash("rogue"), 7),
                lambda e: None,
                "victim",
            ),
            Handle(),
        )
        handle = rogue.send_message("victim", forged.pack(wrong), big)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
            victim.stats["rejected_auth"] == 1 and not victim.transport._refused and victim.transport._pending == []
        ):
            time.sleep(0.01)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert victim.stats["rejected_auth"] == 1 and not victim.transport._refused
        assert peak < 4 << 20, f"the receiver allocated {peak} bytes"
        assert victim.stats["delivered"] == 0
        with contextlib.suppress(TransferTimeout, PeerError):
            handle.wait(1)
    finally:
        tracemalloc.stop()
        rogue.close()
        victim.close()


def test_a_refused_header_without_payload_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged header whose payload never comes costs the receiver a bounded memory for a bounded time."""
    from dejavulib.transport import ucx
    from dejavulib.transport.ucx import KIND_HEADER, UcxTransport, make_tag, peer_hash

    monkeypatch.setattr(ucx, "_REFUSED_TTL_S", 0.3)
    victim = Endpoint(UcxTransport("victim"), "the-secret")
    rogue = UcxTransport("rogue")
    try:
        rogue.connect("victim", victim.address)
        wrong = secret_key("not-the-secret")
        head = np.frombuffer(Header(Channel.TOKENS).pack(wrong), np.uint8)
        post = rogue._post_send
        for seq in range(3):
            tag = make_tag(KIND_HEADER, peer_hash("rogue"), seq)
            rogue._submit(lambda t=tag: post(rogue._ep("victim"), head, t, lambda e: None, "victim"), Handle())
        deadline = time.monotonic() + 10
        while victim.stats["rejected_auth"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert victim.stats["rejected_auth"] == 3
        while victim.transport._refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not victim.transport._refused
    finally:
        rogue.close()
        victim.close()


def test_killed_receiver_gives_timeout_not_hang(fresh_ucx_peer) -> None:
    fresh_ucx_peer.kill()
    big = np.ones(16 << 20, np.uint8)  # rendezvous-sized: completes only if the peer takes it
    with pytest.raises((TransferTimeout, PeerError)):
        fresh_ucx_peer.endpoint.send("peer", Header(Channel.KV_PROMPT), big, deadline_s=1.0).wait()
    with pytest.raises((TransferTimeout, PeerError)):
        fresh_ucx_peer.transport.flush("peer", 5, big, deadline_s=1.0)
    streamer = Streamer(fresh_ucx_peer.endpoint, max_inflight_bytes=64 << 20)
    handle = streamer.submit("peer", Header(Channel.KV_PROMPT), big, deadline_s=1.0)
    with pytest.raises((TransferTimeout, PeerError)):
        handle.wait()
    streamer.close()


def test_sender_killed_mid_stream_gives_timeout(fresh_ucx_peer) -> None:
    endpoint: Endpoint = fresh_ucx_peer.endpoint
    fresh_ucx_peer.command(op="send_kv", count=200, nbytes=1 << 20, interval_s=0.05)
    endpoint.recv(Channel.KV_PROMPT, 10)
    fresh_ucx_peer.kill()
    received = 1
    with pytest.raises(TransferTimeout):
        while True:
            endpoint.recv(Channel.KV_PROMPT, 1.0)
            received += 1
    assert received < 200


def test_thread_progress_mode_round_trip() -> None:
    peer = UcxPeer(progress="thread")
    try:
        data = np.arange(1 << 16, dtype=np.int32)
        peer.command(op="echo_messages", channel=int(Channel.ACTIVATION), count=1)
        peer.endpoint.send("peer", Header(Channel.ACTIVATION), data).wait()
        assert np.array_equal(peer.endpoint.recv(Channel.ACTIVATION, 10).array(), data)
    finally:
        peer.stop()


def test_idle_thread_progress_sleeps_and_wakes_for_work() -> None:
    """In thread mode an idle I/O loop sleeps in epoll (a few passes a second, not a spin), and work
    enqueued meanwhile still goes out: the enqueue wakes it."""
    peer = UcxPeer(progress="thread")
    try:
        transport = peer.transport
        data = np.arange(1024, dtype=np.int32)
        for _ in range(3):
            time.sleep(0.3)  # longer than one epoll wait: the next send must wake the loop
            peer.command(op="echo_messages", channel=int(Channel.ACTIVATION), count=1)
            peer.endpoint.send("peer", Header(Channel.ACTIVATION), data).wait()
            assert np.array_equal(peer.endpoint.recv(Channel.ACTIVATION, 10).array(), data)
        time.sleep(0.3)
        before = transport.loop_iterations
        time.sleep(1.0)
        assert transport.loop_iterations - before < 100  # a 1 ms poll would pass ~1000 times
    finally:
        peer.stop()


def test_required_transport_is_enforced(ucx_peer) -> None:
    from dejavulib.transport.ucx import UcxTransport

    assert satisfies("sm", ucx_peer.transport.selected["peer"]), "one host must use shared memory"
    peer_address = ucx_peer.proc_address
    with UcxTransport("driver-2", require="sm") as ok:
        ok.connect("peer", peer_address)
    with UcxTransport("driver-3", require="tcp") as strict, pytest.raises(TransportUnavailable):
        strict.connect("peer", peer_address)


def test_messages_from_one_sender_arrive_in_the_order_sent() -> None:
    """A header-only message (a restore's end marker) sent after a large one must not overtake it: UCX
    completes the small eager message long before the large rendezvous one, and the transport's
    contract (MessageTransport.send_message) is delivery in the order sent."""
    from dejavulib.transport.ucx import UcxTransport

    receiver = Endpoint(UcxTransport("in-order-receiver"), "the-secret")
    sender = Endpoint(UcxTransport("in-order-sender"), "the-secret")
    try:
        sender.transport.connect("in-order-receiver", receiver.address)
        big = np.arange(8 << 20, dtype=np.uint8)
        sent = []
        for i in range(6):
            sent += [("big", i), ("end", i), ("small", i)]
            sender.send("in-order-receiver", Header(Channel.KV_RESTORE, microbatch=i, step=0), big)
            sender.send("in-order-receiver", Header(Channel.KV_RESTORE, microbatch=i, step=1))
            sender.send("in-order-receiver", Header(Channel.KV_RESTORE, microbatch=i, step=2), big[:100])
        got = []
        for _ in sent:
            msg = receiver.recv(Channel.KV_RESTORE, 20)
            kind = {0: "big", 1: "end", 2: "small"}[msg.header.step]
            got.append((kind, msg.header.microbatch))
            if kind == "big":
                assert np.array_equal(msg.payload, big)
        assert got == sent
    finally:
        sender.close()
        receiver.close()


def test_a_peer_killed_with_sends_outstanding_holds_up_no_send_to_another_peer() -> None:
    """A recovery's pattern (issue 14's one unexplained CI stall): a stage has sends outstanding to a peer that
    stops and is then SIGKILLed, and right after, its caches go to the spare that replaces that peer, in
    rendezvous-sized messages through the same streamer and UCX worker. The spare's sends complete at once;
    the dead peer's complete or fail, each by its deadline."""
    import os
    import signal

    from dejavulib.transport.ucx import UcxTransport

    from .conftest import SECRET

    endpoint = Endpoint(UcxTransport("driver", progress="thread"), SECRET)  # as workers run it
    victim = UcxPeer(endpoint=endpoint, name="victim")
    spare = UcxPeer(endpoint=endpoint, name="spare")
    streamer = Streamer(endpoint, max_inflight_bytes=64 << 20)
    try:
        for peer in ("victim", "spare"):
            streamer.submit(peer, Header(Channel.KV_REPLICA), np.ones(1024, np.uint8), 5.0).wait()
        os.kill(victim.proc.pid, signal.SIGSTOP)  # stops reading: what it is sent now stays outstanding
        outstanding = [
            streamer.submit("victim", Header(Channel.KV_REPLICA, microbatch=i), np.ones(n, np.uint8), 2.0)
            for i, n in enumerate((30 << 10, 30 << 10, 800 << 10))
        ]
        victim.kill()
        start = time.monotonic()
        restores = [
            streamer.submit("spare", Header(Channel.KV_RESTORE, microbatch=i), np.ones(n, np.uint8), 5.0)
            for i, n in enumerate((798_720, 952_320))
        ]
        for handle in restores:
            handle.wait()
        assert time.monotonic() - start < 2.0
        for handle in outstanding:
            with contextlib.suppress(TransferTimeout, PeerError):
                handle.wait()
        assert time.monotonic() - start < 4.0  # each settled by its own deadline (2 s)
    finally:
        streamer.close()
        victim.stop()
        spare.stop()
        endpoint.close()


def test_forgetting_a_peer_fails_its_outstanding_sends_at_once_and_a_new_one_of_its_name_connects() -> None:
    """A peer leaves the topology (here: stopped, then killed) with sends outstanding: forgetting it fails
    them now, not at their deadline, and nothing of it stays pending on the I/O thread; a worker that
    later registers under the same name is connected afresh and served."""
    import os
    import signal

    from dejavulib.transport.ucx import UcxTransport

    from .conftest import SECRET

    transport = UcxTransport("driver", progress="thread")
    endpoint = Endpoint(transport, SECRET)
    victim = UcxPeer(endpoint=endpoint, name="victim")
    successor = None
    try:
        os.kill(victim.proc.pid, signal.SIGSTOP)
        outstanding = [
            endpoint.send("victim", Header(Channel.KV_REPLICA, microbatch=i), np.ones(800 << 10, np.uint8), 30.0)
            for i in range(3)
        ]
        time.sleep(0.2)
        assert not any(h.done() for h in outstanding)
        start = time.monotonic()
        endpoint.forget("victim")
        for handle in outstanding:
            with pytest.raises(PeerError):
                handle.wait(5)
        assert time.monotonic() - start < 2.0
        assert not transport._call(lambda: [p for p in transport._pending if p.peer == "victim"], 5)
        with pytest.raises(PeerError):
            endpoint.send("victim", Header(Channel.KV_REPLICA), np.ones(8, np.uint8), 5.0).wait(5)
        victim.kill()
        successor = UcxPeer(endpoint=endpoint, name="victim")  # connects under the forgotten name
        data = np.arange(1 << 18, dtype=np.int32)
        successor.command(op="echo_messages", channel=int(Channel.ACTIVATION), count=1)
        endpoint.send("victim", Header(Channel.ACTIVATION), data).wait(10)
        assert np.array_equal(endpoint.recv(Channel.ACTIVATION, 10).array(), data)
    finally:
        victim.stop()
        if successor is not None:
            successor.stop()
        endpoint.close()


def test_a_message_that_never_completes_stops_holding_up_its_senders_later_ones(monkeypatch) -> None:
    """Messages from one sender are delivered in order, so one whose transfer never completes (its sender
    died mid-message, or the transfer broke) would hold every later message of that sender (a worker
    restarted under the same name is the same sender) for ever: past ``_INBOUND_GIVE_UP_S`` it is given
    up and those behind it are delivered."""
    from dejavulib.transport import ucx

    monkeypatch.setattr(ucx, "_INBOUND_GIVE_UP_S", 0.5)
    monkeypatch.setattr(ucx, "_HOUSEKEEPING_S", 0.1)
    delivered: list[bytes] = []

    class Admitted:
        nbytes = 3

    transport = ucx.UcxTransport("receiver", progress="thread")
    transport.set_message_sink(lambda raw: Admitted(), lambda admitted, payload: delivered.append(payload.tobytes()))
    try:
        stuck, behind = ucx._Inbound(), ucx._Inbound()

        def arrive() -> None:  # what the I/O thread holds after two headers of one sender, the first never whole
            behind.admitted, behind.payload = Admitted(), np.frombuffer(b"abc", np.uint8)
            transport._inbox[7] = collections.deque([stuck, behind])
            transport._settle(7, behind, dropped=False)

        transport._call(arrive, 5)
        assert delivered == []  # held behind the incomplete one, in order
        deadline = time.monotonic() + 5
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert delivered == [b"abc"]
        assert transport._call(lambda: dict(transport._inbox), 5) == {}
    finally:
        transport.close()


@pytest.mark.parametrize("progress", ["thread", "polling"])
def test_the_receive_path_probe_sees_its_message_arrive(progress: str) -> None:
    """A second UCX worker of the process sends to this one over the host's transports: it arrives."""
    from dejavulib.transport.ucx import UcxTransport

    transport = UcxTransport("probed", progress=progress)
    try:
        assert all(transport.receive_path_ok(5.0) for _ in range(3))
        assert not transport._call(lambda: [p for p in transport._pending if not p.request.completed], 5)
    finally:
        transport.close()


def test_the_receive_path_probe_says_so_when_its_message_does_not_arrive(monkeypatch) -> None:
    """What a wedged receive FIFO looks like from here: the probe is sent and never read (sent under a tag
    nothing reads, as a message stuck behind a dead writer's unfinished element never is)."""
    from dejavulib.transport import ucx

    transport = ucx.UcxTransport("wedged", progress="thread")
    send_probe = transport._send_probe

    def send_unread(seq: int) -> None:  # the probe leaves under kind 6; the I/O thread reads kind 5
        monkeypatch.setattr(ucx, "KIND_PROBE", 6)
        try:
            send_probe(seq)
        finally:
            monkeypatch.setattr(ucx, "KIND_PROBE", 5)

    monkeypatch.setattr(transport, "_send_probe", send_unread)
    try:
        started = time.monotonic()
        assert transport.receive_path_ok(0.5) is False
        assert time.monotonic() - started < 2.0
    finally:
        transport.close()
