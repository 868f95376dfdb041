"""Per-pair data-plane keys: who can derive which key, look-ups of senders' published keys, and what an
endpoint with per-pair keys admits. In-process, over the fake transport; real endpoints over UCX are in
tests/worker/test_pair_keys.py."""

from __future__ import annotations

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import PeerError, SenderError, TransferTimeout
from dejavulib.header import Channel, Header, secret_key, sender_field
from dejavulib.peerkeys import PeerKeys, decode_public_key, key_id

from .fake_transport import FakeTransport

SECRET = "pair-secret"


def _header(sender: PeerKeys, to: str) -> Header:
    """A header ``sender`` seals for ``to`` (with the pair's key) for an empty payload."""
    key, kid = sender.sending(to)
    return Header(Channel.TOKENS).with_payload(memoryview(b""), key, epoch=0, seq=1, sender=sender.self_id, key_id=kid)


def test_both_ends_of_a_pair_derive_its_key_and_each_direction_has_its_own() -> None:
    a, b = PeerKeys("a", SECRET), PeerKeys("b", SECRET)
    a.learn("b", b.public)
    b.learn("a", a.public)
    a_to_b, a_id = a.sending("b")
    b_to_a, _ = b.sending("a")
    assert a_id == a.key_id == key_id(a.public)
    assert b.receiving(_header(a, "b")) == a_to_b
    assert a.receiving(_header(b, "a")) == b_to_a
    assert a_to_b != b_to_a


def test_the_secret_alone_derives_no_pair_key_and_a_private_key_alone_is_no_membership() -> None:
    a, b = PeerKeys("a", SECRET), PeerKeys("b", SECRET)
    a.learn("b", b.public)
    a_to_b, _ = a.sending("b")
    member = PeerKeys("a", SECRET)  # holds the secret and calls itself a, but not a's private key
    member.learn("b", b.public)
    assert member.sending("b")[0] != a_to_b
    outsider = PeerKeys("a", "another-secret", private_key=a._private)  # a's private key, not the secret
    outsider.learn("b", b.public)
    assert outsider.sending("b")[0] != a_to_b


def test_a_pair_key_is_bound_to_both_ids() -> None:
    a, b = PeerKeys("a", SECRET), PeerKeys("b", SECRET)
    a.learn("b", b.public)
    a.learn("c", b.public)  # b's key published under another id
    assert a.sending("b")[0] != a.sending("c")[0]


def test_sending_to_a_peer_whose_key_is_unknown_raises() -> None:
    with pytest.raises(PeerError, match="no data-plane key"):
        PeerKeys("a", SECRET).sending("b")


def test_a_sender_is_looked_up_once_per_refresh_and_a_failing_look_up_refuses() -> None:
    a, b = PeerKeys("a", SECRET), PeerKeys("b", SECRET)
    a.learn("b", b.public)
    asked: list[str] = []
    published: dict[str, tuple[str, bytes]] = {}

    def resolve(field: str) -> tuple[str, bytes] | None:
        asked.append(field)
        if field == "broken":
            raise ConnectionError("registry unreachable")
        return published.get(field)

    b.resolve, b.refresh_s = resolve, 3600.0
    for _ in range(5):  # a stream of headers naming an unknown sender: one look-up
        with pytest.raises(SenderError, match="publishes no data-plane key"):
            b.receiving(_header(a, "b"))
    assert asked == ["a"]
    b.refresh_s = 0.0
    published["a"] = ("a", a.public)
    assert b.receiving(_header(a, "b")) == a.sending("b")[0]
    with pytest.raises(SenderError):
        b.receiving(Header(Channel.TOKENS, sender="broken"))
    assert asked == ["a", "a", "broken"]


def test_a_restarted_sender_is_learned_and_its_earlier_process_refused() -> None:
    receiver = PeerKeys("r", SECRET)
    old, new = PeerKeys("s", SECRET), PeerKeys("s", SECRET)
    for sender in (old, new):
        sender.learn("r", receiver.public)
    published = {"s": ("s", old.public)}
    receiver.resolve, receiver.refresh_s = published.get, 0.0
    old_header = _header(old, "r")
    assert receiver.receiving(old_header) == old.sending("r")[0]
    published["s"] = ("s", new.public)  # the worker restarted: a new process publishes a new key
    assert receiver.receiving(_header(new, "r")) == new.sending("r")[0]
    with pytest.raises(SenderError, match="earlier process"):
        receiver.receiving(old_header)


def test_a_long_worker_id_is_resolved_by_its_header_field() -> None:
    long_id = "token-worker-0.a-rather-long-hostname.example.internal"
    sender, receiver = PeerKeys(long_id, SECRET), PeerKeys("r", SECRET)
    sender.learn("r", receiver.public)
    field = sender_field(long_id)
    receiver.resolve = {field: (long_id, sender.public)}.get
    key, kid = sender.sending("r")
    header = Header(Channel.TOKENS).with_payload(memoryview(b""), key, epoch=0, seq=1, sender=field, key_id=kid)
    assert receiver.receiving(header) == key


def test_published_keys_are_validated() -> None:
    good = PeerKeys("a", SECRET).public_key
    assert len(decode_public_key(good)) == 32
    for bad in ("", "not base64!", "AAAA"):
        with pytest.raises(ValueError):
            decode_public_key(bad)


# -- endpoints --------------------------------------------------------------------------------------------


def _endpoint(name: str, directory: dict[str, PeerKeys]) -> Endpoint:
    """An endpoint with per-pair keys that looks senders up in ``directory`` (a stand-in registry)."""
    keys = PeerKeys(
        name, SECRET, resolve=lambda field: (field, directory[field].public) if field in directory else None
    )
    directory[name] = keys
    return Endpoint(FakeTransport(name), SECRET, keys=keys)


def test_a_member_cannot_seal_a_message_as_another_and_the_receiver_keeps_serving() -> None:
    directory: dict[str, PeerKeys] = {}
    b, c, m = _endpoint("b", directory), _endpoint("c", directory), _endpoint("m", directory)
    for sender in (b, m):
        sender.connect("c", c.address)
        sender.keys.learn("c", c.keys.public)  # type: ignore[union-attr]
    payload = np.arange(16, dtype=np.uint8)
    member = secret_key(SECRET)
    forgeries = [  # what m, which holds the secret and b's public key, can seal as b
        (member, b.keys.key_id),  # type: ignore[union-attr]  # the deployment key: what any member could before
        (m.keys.sending("c")[0], b.keys.key_id),  # type: ignore[union-attr]  # its own pair key with c
        (m.keys.sending("c")[0], m.keys.key_id),  # type: ignore[union-attr]  # ... and its own key id
    ]
    for seq, (key, kid) in enumerate(forgeries):
        forged = Header(Channel.TOKENS).with_payload(memoryview(payload), key, epoch=0, seq=seq, sender="b", key_id=kid)
        m.transport.send_message("c", forged.pack(member, key), payload)
    assert c.stats["rejected_sender"] == 3 and c.stats["delivered"] == 0
    b.send("c", Header(Channel.TOKENS), payload).wait()
    m.send("c", Header(Channel.TOKENS), payload[:4]).wait()
    got = [c.recv(Channel.TOKENS, 1.0) for _ in range(2)]
    assert [(g.header.sender, g.payload.nbytes) for g in got] == [("b", 16), ("m", 4)]
    with pytest.raises(TransferTimeout):
        c.recv(Channel.TOKENS, 0.05)


def test_a_message_sealed_for_another_receiver_is_refused() -> None:
    directory: dict[str, PeerKeys] = {}
    b, c, d = _endpoint("b", directory), _endpoint("c", directory), _endpoint("d", directory)
    b.connect("c", c.address)
    b.keys.learn("d", d.keys.public)  # type: ignore[union-attr]
    payload = np.ones(8, np.uint8)
    key, kid = b.keys.sending("d")  # type: ignore[union-attr]
    for_d = Header(Channel.TOKENS).with_payload(memoryview(payload), key, epoch=0, seq=1, sender="b", key_id=kid)
    b.transport.send_message("c", for_d.pack(secret_key(SECRET), key), payload)
    assert c.stats["rejected_sender"] == 1 and c.stats["delivered"] == 0
