"""A message channel for the serving layer: authenticated, epoch-fenced, per-channel receive queues.

``Endpoint`` wraps a ``MessageTransport`` (UCX between processes, fake in tests). ``send`` seals a
``Header`` (size, crc32, epoch, sequence, sender, HMAC with the deployment secret) and starts the
transfer; ``recv(channel)`` blocks until a message on that channel arrives.

Thread-safety: every method may be called from any thread; different threads may wait on different
channels at once; messages of one channel from one sender are received in send order.

Failure behaviour:

* a message whose header MAC does not verify (wrong secret, corrupted header) or whose epoch is older
  than ``set_epoch``'s is dropped, logged and counted in ``stats``; it is never delivered;
* a payload that does not match its header's checksum/size raises ``IntegrityError`` from ``recv``;
* ``recv`` raises ``TransferTimeout`` past its deadline; ``send``'s handle fails with ``PeerError``
  or ``TransferTimeout`` (its deadline). A dead peer never blocks either call beyond its deadline.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from dejavulib.buffers import Buffer, as_bytes
from dejavulib.errors import ClosedError, IntegrityError, TransferTimeout
from dejavulib.handle import Handle
from dejavulib.header import Channel, DType, Header, secret_key, sender_field
from dejavulib.transport.base import MessageTransport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_NUMPY = {DType.UINT8: np.uint8, DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.INT64: np.int64,
          DType.INT32: np.int32}  # fmt: skip


@dataclass(frozen=True)
class Message:
    """A received message: its verified header and its raw payload bytes."""

    header: Header
    payload: np.ndarray

    def tensor(self) -> torch.Tensor:
        """The payload as a CPU tensor of the header's dtype and shape (zero-copy)."""
        import torch

        t = torch.from_numpy(self.payload).view(getattr(torch, self.header.dtype.name.lower()))
        return t.view(self.header.shape) if self.header.shape else t

    def array(self) -> np.ndarray:
        """The payload as a numpy array of the header's dtype and shape (not for bfloat16)."""
        a = self.payload.view(_NUMPY[self.header.dtype])
        return a.reshape(self.header.shape) if self.header.shape else a


def describe(payload: Buffer) -> tuple[DType, tuple[int, ...]]:
    """Wire dtype and shape of a tensor or array."""
    name = str(payload.dtype)
    return DType.from_name(name), tuple(payload.shape)


class Endpoint:
    """See the module docstring."""

    def __init__(self, transport: MessageTransport, secret: str | bytes, epoch: int = 0) -> None:
        self.transport = transport
        self._key = secret_key(secret)
        self._epoch = epoch
        self._queues: dict[Channel, collections.deque[tuple[Header, np.ndarray]]] = {
            c: collections.deque() for c in Channel
        }
        self._cond = threading.Condition()
        self._seq = 0
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        transport.set_message_sink(self._on_message)

    @property
    def self_id(self) -> str:
        return self.transport.self_id

    @property
    def address(self) -> bytes:
        return self.transport.address

    @property
    def epoch(self) -> int:
        return self._epoch

    def connect(self, peer_id: str, address: bytes) -> None:
        self.transport.connect(peer_id, address)

    def set_epoch(self, epoch: int) -> None:
        """Reject, from now on, messages whose sender epoch is older than ``epoch``; drops queued ones too."""
        with self._cond:
            self._epoch = epoch
            for channel, queue in self._queues.items():
                kept = collections.deque(m for m in queue if m[0].epoch >= epoch)
                self.stats["rejected_stale_epoch"] += len(queue) - len(kept)
                self._queues[channel] = kept

    def send(self, peer_id: str, header: Header, payload: Buffer | None = None, deadline_s: float = 10.0) -> Handle:
        """Seal ``header`` for ``payload`` and start sending; returns at once.

        If ``header.shape`` is empty and ``payload`` is a tensor/array, its dtype and shape are recorded so
        ``Message.tensor()`` rebuilds it. Keep ``payload`` unchanged until the handle completes.
        """
        if self._closed:
            raise ClosedError("endpoint closed")
        data = as_bytes(payload) if payload is not None else np.empty(0, np.uint8)
        if payload is not None and not header.shape and not isinstance(payload, bytes | bytearray | memoryview):
            dtype, shape = describe(payload)
            header = replace(header, dtype=dtype, shape=shape)
        with self._cond:
            seq, self._seq = self._seq, self._seq + 1
        sealed = header.with_payload(memoryview(data), epoch=self._epoch, seq=seq, sender=sender_field(self.self_id))
        inner = self.transport.send_message(peer_id, sealed.pack(self._key), data)
        outer = Handle(data.nbytes, deadline_s)
        inner.add_done_callback(lambda h: outer.set_done(h.error))
        return outer

    def recv(self, channel: Channel, deadline_s: float) -> Message:
        """The next message on ``channel``; ``TransferTimeout`` if none within ``deadline_s``,
        ``IntegrityError`` if its payload does not match its header (the message is consumed)."""
        end = time.monotonic() + deadline_s
        with self._cond:
            while not self._queues[channel]:
                left = end - time.monotonic()
                if self._closed:
                    raise ClosedError("endpoint closed")
                if left <= 0:
                    raise TransferTimeout(f"no {channel.name} message within {deadline_s} s")
                self._cond.wait(left)
            queue = self._queues[channel]
            header, payload = queue.popleft()
        try:
            header.verify_payload(memoryview(payload))
        except IntegrityError:
            self.stats["integrity_errors"] += 1
            raise
        return Message(header, payload)

    def pending(self, channel: Channel) -> int:
        """Messages waiting on ``channel``."""
        with self._cond:
            return len(self._queues[channel])

    def close(self) -> None:
        """Wake every waiter with ``ClosedError`` and close the transport."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.transport.close()

    def _on_message(self, raw_header: bytes, payload: np.ndarray) -> None:
        """Runs on the transport's thread: authenticate, fence by epoch, enqueue. Never raises."""
        try:
            header = Header.unpack(raw_header, self._key)
        except IntegrityError as exc:
            self.stats["rejected_auth"] += 1
            log.warning("dropped a message on %s: %s", self.self_id, exc)
            return
        with self._cond:
            if header.epoch < self._epoch:
                self.stats["rejected_stale_epoch"] += 1
                log.warning("dropped a %s message of epoch %d from %r (current epoch %d)", header.channel.name,
                            header.epoch, header.sender, self._epoch)  # fmt: skip
                return
            self._queues[header.channel].append((header, payload))
            self.stats["delivered"] += 1
            self._cond.notify_all()
