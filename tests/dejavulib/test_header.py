"""The wire header: round trip, sealing, and every way a header or payload can be wrong."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import IntegrityError
from dejavulib.header import Channel, DType, Header, secret_key, sender_field

from .fake_transport import FakeTransport

KEY = secret_key("deployment-secret")


def _sealed() -> tuple[Header, np.ndarray]:
    """A serving-shaped header: microbatch ids carry the controller incarnation in their top 32 bits."""
    payload = np.arange(1000, dtype=np.float32).view(np.uint8)
    header = Header(Channel.KV_REPLICA, dtype=DType.FLOAT32, shape=(10, 100), which=3, microbatch=(3 << 32) + 2,
                    step=41, layers=(10, 20), rows=(0, 4), positions=(1000, 1001), user=7)  # fmt: skip
    return header.with_payload(memoryview(payload), KEY, epoch=5, seq=9, sender="token-stage-1"), payload


def test_round_trip_keeps_every_field() -> None:
    header, payload = _sealed()
    raw = header.pack(KEY)
    assert len(raw) == Header.SIZE
    back = Header.unpack(raw, KEY)
    assert back == header
    back.verify_payload(memoryview(payload), KEY)


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
    with pytest.raises(IntegrityError, match="MAC"):
        header.verify_payload(memoryview(corrupted), KEY)
    with pytest.raises(IntegrityError, match="bytes"):
        header.verify_payload(memoryview(payload[:-4]), KEY)
    with pytest.raises(IntegrityError, match="MAC"):  # a payload is bound to the deployment's key
        header.verify_payload(memoryview(payload), secret_key("other"))


def _crc_preserving_patch(original: bytes, modified: bytearray, at: int) -> bytes:
    """``modified`` with 4 bytes at ``at`` rewritten so its crc32 equals ``original``'s: crc32 is affine
    over GF(2), so 32 single-bit flips span every crc difference (Gaussian elimination)."""
    target = zlib.crc32(original) ^ zlib.crc32(bytes(modified))
    base = zlib.crc32(bytes(modified))
    columns = []  # (crc difference of flipping bit i, bit mask of i)
    for i in range(32):
        flipped = bytearray(modified)
        flipped[at + i // 8] ^= 1 << (i % 8)
        columns.append((zlib.crc32(bytes(flipped)) ^ base, 1 << i))
    basis: list[tuple[int, int]] = []
    for diff, mask in columns:
        for b_diff, b_mask in basis:
            if diff ^ b_diff < diff:
                diff, mask = diff ^ b_diff, mask ^ b_mask
        if diff:
            basis.append((diff, mask))
            basis.sort(reverse=True)
    flips = 0
    for b_diff, b_mask in basis:
        if target ^ b_diff < target:
            target, flips = target ^ b_diff, flips ^ b_mask
    assert target == 0
    for i in range(32):
        if flips >> i & 1:
            modified[at + i // 8] ^= 1 << (i % 8)
    return bytes(modified)


def test_a_forged_payload_with_a_fixed_up_crc_is_refused() -> None:
    """The attack a crc32 allows: an on-path attacker changes the payload and fixes its crc without the key."""
    header, payload = _sealed()
    original = payload.tobytes()
    tampered = bytearray(original)
    tampered[0:8] = b"\x00\x00\x80\x7f" * 2  # two float32 +inf, say
    forged = _crc_preserving_patch(original, tampered, at=len(tampered) - 4)
    assert forged != original and zlib.crc32(forged) == zlib.crc32(original)  # the crc no longer protects
    with pytest.raises(IntegrityError, match="MAC"):
        header.verify_payload(memoryview(forged), KEY)


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
