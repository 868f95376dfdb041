"""A replacement uses restored caches only when what arrived is what the survivor sent: the end
marker's count and checksum (recovery.restore_digest) over every chunk, checked before use."""

from __future__ import annotations

import dataclasses
import queue

import pytest
import torch

from dejavu_token_worker import recovery
from dejavu_worker.dataplane import KVChunk
from dejavulib.errors import IntegrityError


class Wire:
    """The two ends of one restore: ``send`` as the survivor's endpoint, ``recv`` as the replacement's;
    ``alter`` may drop (None) or change each restore message on the way."""

    def __init__(self, alter=lambda i, payload: payload) -> None:
        self.q: queue.Queue[bytes] = queue.Queue()
        self.alter, self.sent = alter, 0

    def send(self, peer: str, channel, payload: bytes) -> None:
        payload = self.alter(self.sent, payload)
        self.sent += 1
        if payload is not None:
            self.q.put(payload)

    def recv(self, channel, timeout_s: float) -> bytes | None:
        try:
            return self.q.get(timeout=timeout_s)
        except queue.Empty:
            return None


def _chunks() -> list[KVChunk]:
    torch.manual_seed(0)
    return [
        KVChunk(mb, (0, 2), (0, 3), (0, 5), torch.randn(2, 3, 1, 5, 4), torch.randn(2, 3, 1, 5, 4), step=mb + 4)
        for mb in (7, 8, 9)
    ]


def _restore(wire: Wire) -> tuple[list[KVChunk], list[KVChunk]]:
    recovery.send_caches(wire, "t1", _chunks(), "primary")  # type: ignore[arg-type]
    return recovery.receive_caches(wire, {"primary"}, deadline_s=2.0, abandon=lambda: False)  # type: ignore[arg-type]


def test_a_complete_restore_is_used() -> None:
    primary, replica = _restore(Wire())
    assert replica == [] and [c.mb_id for c in primary] == [7, 8, 9]
    for got, sent in zip(primary, _chunks(), strict=True):
        assert got.role == "primary" and got.step == sent.step and torch.equal(got.k, sent.k)


def _corrupt(payload: bytes) -> bytes:
    raw = bytearray(payload)
    raw[-3] ^= 0xFF  # a byte of the V tensor
    return bytes(raw)


@pytest.mark.parametrize(
    "alter",
    [
        lambda i, p: None if i == 1 else p,  # a chunk lost
        lambda i, p: _corrupt(p) if i == 2 else p,  # a chunk altered after the wire's own check
    ],
    ids=["lost", "altered"],
)
def test_a_restore_that_differs_from_what_was_sent_is_refused(alter) -> None:
    with pytest.raises(IntegrityError, match="primary caches"):
        _restore(Wire(alter))


def test_the_digest_covers_where_each_chunk_goes() -> None:
    chunks = _chunks()
    moved = [dataclasses.replace(chunks[0], rows=(1, 4)), *chunks[1:]]
    assert recovery.restore_digest(moved) != recovery.restore_digest(chunks)
    assert recovery.restore_digest(chunks[::-1]) != recovery.restore_digest(chunks)
