"""The wire header: round trip, sealing, and every way a header or payload can be wrong."""

from __future__ import annotations

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import IntegrityError
from dejavulib.header import Channel, DType, Header, secret_key, sender_field
from dejavulib.transport.fake import FakeTransport

KEY = secret_key("deployment-secret")


def _sealed() -> tuple[Header, np.ndarray]:
    payload = np.arange(1000, dtype=np.float32).view(np.uint8)
    header = Header(Channel.KV_REPLICA, dtype=DType.FLOAT32, shape=(10, 100), which=3, microbatch=2, step=41,
                    layers=(10, 20), rows=(0, 4), positions=(1000, 1001), user=7)  # fmt: skip
    return header.with_payload(memoryview(payload), epoch=5, seq=9, sender="token-stage-1"), payload


def test_round_trip_keeps_every_field() -> None:
    header, payload = _sealed()
    raw = header.pack(KEY)
    assert len(raw) == Header.SIZE
    back = Header.unpack(raw, KEY)
    assert back == header
    back.verify_payload(memoryview(payload))


def test_wrong_secret_fails_the_mac() -> None:
    header, _ = _sealed()
    with pytest.raises(IntegrityError, match="MAC"):
        Header.unpack(header.pack(secret_key("other")), KEY)


@pytest.mark.parametrize("offset", [0, 4, 20, Header.SIZE - 1])
def test_any_flipped_header_byte_is_rejected(offset: int) -> None:
    raw = bytearray(_sealed()[0].pack(KEY))
    raw[offset] ^= 0x01
    with pytest.raises(IntegrityError):
        Header.unpack(bytes(raw), KEY)


def test_payload_corruption_and_truncation_are_detected() -> None:
    header, payload = _sealed()
    corrupted = payload.copy()
    corrupted[123] ^= 0x80
    with pytest.raises(IntegrityError, match="checksum"):
        header.verify_payload(memoryview(corrupted))
    with pytest.raises(IntegrityError, match="bytes"):
        header.verify_payload(memoryview(payload[:-4]))


def test_header_limits() -> None:
    with pytest.raises(ValueError):
        Header(Channel.TOKENS, shape=(1, 2, 3, 4, 5))
    with pytest.raises(ValueError):
        Header(Channel.TOKENS, sender="x" * 33)


@pytest.mark.parametrize(
    "worker_id",
    ["t0", "x" * 32, "ip-10-0-12-34.eu-west-1.compute.internal-token-worker-7", "ü" * 40, "日本語のホスト名" * 3],
)
def test_worker_ids_of_any_length_travel_in_a_header(worker_id: str) -> None:
    a, b = Endpoint(FakeTransport(worker_id), "s"), Endpoint(FakeTransport("peer"), "s")
    a.connect("peer", b.address)
    a.send("peer", Header(Channel.TOKENS), np.arange(4, dtype=np.uint8)).wait(5)
    sender = b.recv(Channel.TOKENS, 5).header.sender
    assert sender == sender_field(worker_id) and len(sender.encode()) <= 32
    if len(worker_id.encode()) <= 32:
        assert sender == worker_id
    else:  # readable head, and a longer id with the same head gets another field
        assert sender[0] == worker_id[0] and sender_field(worker_id + "-2") != sender
