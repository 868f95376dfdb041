"""The wire header: round trip, sealing, and every way a header or payload can be wrong."""

from __future__ import annotations

import numpy as np
import pytest

from dejavulib.errors import IntegrityError
from dejavulib.header import Channel, DType, Header, secret_key

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
