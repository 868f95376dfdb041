"""A replacement uses restored caches only when what arrived is what the survivor sent: the end
marker's count and checksum (recovery.restore_digest) over every cache, checked before use."""

from __future__ import annotations

import dataclasses
import queue

import numpy as np
import pytest
import torch

from dejavu_token_worker import recovery
from dejavulib.endpoint import Message
from dejavulib.errors import IntegrityError
from dejavulib.header import Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout


class Wire:
    """The two ends of one restore: ``send``/``send_packed`` as the survivor's endpoint, ``recv_message``
    as the replacement's; ``alter`` may drop (None) or change each restore message on the way."""

    def __init__(self, alter=lambda i, message: message) -> None:
        self.q: queue.Queue[Message] = queue.Queue()
        self.alter, self.sent = alter, 0

    def _put(self, message: Message) -> None:
        message = self.alter(self.sent, message)
        self.sent += 1
        if message is not None:
            self.q.put(message)

    def send(self, peer: str, channel, payload: bytes) -> None:
        data = np.frombuffer(payload, dtype=np.uint8).copy()
        self._put(Message(Header(channel, nbytes=data.nbytes), data))

    def send_packed(self, peer: str, header: Header, packed: torch.Tensor) -> None:
        data = packed.reshape(-1).view(torch.uint8).numpy().copy()
        self._put(Message(dataclasses.replace(header, nbytes=data.nbytes), data))

    def recv_message(self, channel, timeout_s: float) -> Message | None:
        try:
            return self.q.get(timeout=timeout_s)
        except queue.Empty:
            return None


def _caches() -> list[tuple[int, KVCache, int]]:
    torch.manual_seed(0)
    out = []
    for mb in (7, 8, 9):
        cache = KVCache.allocate(KVLayout(2, 3, 1, 5, 4, first_layer=4))
        cache.k.copy_(torch.randn_like(cache.k))
        cache.v.copy_(torch.randn_like(cache.v))
        out.append((mb, cache, mb + 4))
    return out


def _restore(wire: Wire):
    recovery.send_caches(wire, "t1", _caches(), "primary")  # type: ignore[arg-type]
    return recovery.receive_caches(wire, {"primary"}, deadline_s=2.0, abandon=lambda: False)  # type: ignore[arg-type]


def test_a_complete_restore_is_used() -> None:
    primary, replica = _restore(Wire())
    assert replica == [] and [r.region.microbatch for r in primary] == [7, 8, 9]
    for got, (_mb, sent, step) in zip(primary, _caches(), strict=True):
        assert got.step == step and got.region == sent.whole(got.region.microbatch)
        back = KVCache.allocate(sent.layout)
        back.unpack(got.region, torch.from_numpy(got.message.payload))
        assert torch.equal(back.k, sent.k) and torch.equal(back.v, sent.v)


def _corrupt(message: Message) -> Message:
    data = message.payload.copy()
    data[-3] ^= 0xFF  # a byte of the V tensor
    return Message(message.header, data)


@pytest.mark.parametrize(
    "alter",
    [
        lambda i, m: None if i == 1 else m,  # a cache lost
        lambda i, m: _corrupt(m) if i == 2 else m,  # a cache altered after the wire's own check
    ],
    ids=["lost", "altered"],
)
def test_a_restore_that_differs_from_what_was_sent_is_refused(alter) -> None:
    with pytest.raises(IntegrityError, match="primary caches"):
        _restore(Wire(alter))


def test_the_digest_covers_where_each_cache_goes() -> None:
    parts = [(cache.whole(mb), step, cache.k.reshape(-1).view(torch.uint8)) for mb, cache, step in _caches()]
    region, step, data = parts[0]
    moved = [(dataclasses.replace(region, rows=(1, 3)), step, data), *parts[1:]]
    assert recovery.restore_digest(moved) != recovery.restore_digest(parts)
    assert recovery.restore_digest([(region, step + 1, data), *parts[1:]]) != recovery.restore_digest(parts)
    assert recovery.restore_digest(parts[::-1]) != recovery.restore_digest(parts)
