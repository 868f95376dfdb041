"""A message channel for the serving layer: authenticated, epoch-fenced, per-channel receive queues.

``Endpoint`` wraps a ``MessageTransport`` (UCX between processes, fake in tests). ``send`` seals a
``Header`` (size, payload MAC, epoch, sequence, sender and its key id, the member MAC with the
deployment secret and the sender MAC with the pair's key) and starts the transfer; ``recv(channel)``
blocks until a message on that channel arrives.

With ``keys`` (:class:`PeerKeys`, what workers use), a message from A to B is sealed with the key of
the pair (A, B) (:mod:`dejavulib.peerkeys`), so a member that holds the deployment secret still cannot
seal a message that B accepts as another member's. Without, every member seals with the deployment
key, and any member can speak for any other (single-process tools and tests).

Thread-safety: every method may be called from any thread; different threads may wait on different
channels at once; messages of one channel from one sender are received in send order.

Failure behaviour:

* a message whose header MAC does not verify (wrong secret, corrupted header: ``rejected_auth``),
  whose sender cannot be authenticated (it publishes no key, or the message is not sealed with the
  key of the pair it names: ``rejected_sender``), whose epoch is older
  than ``set_epoch``'s, whose (sender, epoch, seq) was seen before (a replay, :mod:`dejavulib.replay`),
  whose payload is over ``max_message_bytes``, or that would take its channel's backlog past its bound
  is dropped, logged and counted in ``stats`` before the transport sizes any buffer for its payload; it
  is never delivered;
* a channel's backlog is what was admitted on it and not yet taken by ``recv`` (payloads in flight
  and queued): at most ``max_queued_messages`` messages and ``max_queued_bytes`` bytes (an empty
  channel always admits one message up to ``max_message_bytes``), so a peer that sends faster than
  this endpoint consumes, or floods it, costs bounded memory; what is over is dropped and counted
  (``rejected_backlog``), and each consumer's deadline covers what it carried;
* ``send`` refuses a payload over ``max_message_bytes`` with ``ValueError``: peers of one deployment
  share the bound, so the receiver would drop it;
* a payload that does not match its header's size and MAC raises ``IntegrityError`` from ``recv``,
  before any of its bytes is interpreted;
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
from dejavulib.errors import ClosedError, IntegrityError, SenderError, TransferTimeout
from dejavulib.handle import Handle
from dejavulib.header import NO_KEY_ID, Channel, DType, Header, secret_key, sender_field
from dejavulib.peerkeys import PeerKeys
from dejavulib.replay import ReplayGuard
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


#: Largest payload an endpoint accepts by default (a whole stage's KV of a long microbatch fits).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
#: Default bound of one channel's backlog in messages (admitted, not yet received); in bytes, by default
#: twice ``max_message_bytes`` (a consumer one largest message behind loses nothing).
DEFAULT_MAX_QUEUED_MESSAGES = 4096


@dataclass(frozen=True)
class _Admitted:
    """An admitted message's header and the key its payload is verified with (the pair's)."""

    header: Header
    key: bytes

    @property
    def nbytes(self) -> int:
        return self.header.nbytes


class Endpoint:
    """See the module docstring."""

    def __init__(
        self,
        transport: MessageTransport,
        secret: str | bytes,
        epoch: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_queued_bytes: int | None = None,
        max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
        keys: PeerKeys | None = None,
    ) -> None:
        """``keys``: this process's per-pair keys (see the module docstring); None: the deployment key only."""
        if max_queued_bytes is None:
            max_queued_bytes = 2 * max_message_bytes
        if min(max_message_bytes, max_queued_bytes, max_queued_messages) < 1:
            raise ValueError("max_message_bytes, max_queued_bytes and max_queued_messages must be positive")
        self.transport = transport
        self._key = secret_key(secret)
        self.keys = keys
        self._epoch = epoch
        self.max_message_bytes = max_message_bytes
        self.max_queued_bytes, self.max_queued_messages = max_queued_bytes, max_queued_messages
        # Each channel's backlog (see the module docstring), kept under ``_cond``.
        self._backlog_bytes: collections.Counter[Channel] = collections.Counter()
        self._backlog_messages: collections.Counter[Channel] = collections.Counter()
        self._replay = ReplayGuard()
        self._queues: dict[Channel, collections.deque[tuple[_Admitted, np.ndarray]]] = {
            c: collections.deque() for c in Channel
        }
        self._cond = threading.Condition()
        # Wall-clock nanoseconds: a restarted sender (same id, same epoch) numbers above its predecessor,
        # so receivers do not take its messages for replays.
        self._seq = time.time_ns()
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        transport.set_message_sink(self._admit, self._on_message, self._on_drop)

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

    def forget(self, peer_id: str) -> None:
        """Stop sending to ``peer_id`` (see :meth:`Transport.forget`); messages from it still arrive."""
        self.transport.forget(peer_id)

    def set_epoch(self, epoch: int) -> None:
        """Reject, from now on, messages whose sender epoch is older than ``epoch``; drops queued ones too."""
        with self._cond:
            self._epoch = epoch
            for channel, queue in self._queues.items():
                kept = collections.deque(m for m in queue if m[0].header.epoch >= epoch)
                for admitted, _payload in queue:
                    if admitted.header.epoch < epoch:
                        self._unqueue(admitted.header)
                self.stats["rejected_stale_epoch"] += len(queue) - len(kept)
                self._queues[channel] = kept
        self._replay.forget_before(epoch)

    def send(self, peer_id: str, header: Header, payload: Buffer | None = None, deadline_s: float = 10.0) -> Handle:
        """Seal ``header`` for ``payload`` and start sending; returns at once. With per-pair keys, raises
        ``PeerError`` for a peer whose key this endpoint was not given (``keys.learn``).

        If ``header.shape`` is empty and ``payload`` is a tensor/array, its dtype and shape are recorded so
        ``Message.tensor()`` rebuilds it. Keep ``payload`` unchanged until the handle completes.
        """
        if self._closed:
            raise ClosedError("endpoint closed")
        data = as_bytes(payload) if payload is not None else np.empty(0, np.uint8)
        if data.nbytes > self.max_message_bytes:
            raise ValueError(
                f"a {header.channel.name} payload of {data.nbytes} bytes is over max_message_bytes "
                f"({self.max_message_bytes}): peers drop it unread"
            )
        if payload is not None and not header.shape and not isinstance(payload, bytes | bytearray | memoryview):
            dtype, shape = describe(payload)
            header = replace(header, dtype=dtype, shape=shape)
        key, key_id = self.keys.sending(peer_id) if self.keys is not None else (self._key, NO_KEY_ID)
        with self._cond:
            seq, self._seq = self._seq, self._seq + 1
        sender = sender_field(self.self_id)
        sealed = header.with_payload(memoryview(data), key, epoch=self._epoch, seq=seq, sender=sender, key_id=key_id)  # type: ignore[arg-type]  # numpy arrays are buffers
        inner = self.transport.send_message(peer_id, sealed.pack(self._key, key), data)
        outer = Handle(data.nbytes, deadline_s)
        inner.add_done_callback(lambda h: outer.set_done(h.error))
        return outer

    def recv(self, channel: Channel, deadline_s: float) -> Message:
        """The next message on ``channel``; ``TransferTimeout`` if none within ``deadline_s``,
        ``IntegrityError`` if its payload does not match its header's size and MAC (the message is consumed)."""
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
            admitted, payload = queue.popleft()
            header = admitted.header
            self._unqueue(header)
        try:
            header.verify_payload(memoryview(payload), admitted.key)  # type: ignore[arg-type]  # numpy arrays are buffers
        except IntegrityError:
            self.stats["integrity_errors"] += 1
            raise
        return Message(header, payload)

    def pending(self, channel: Channel) -> int:
        """Messages waiting on ``channel``."""
        with self._cond:
            return len(self._queues[channel])

    def backlog(self, channel: Channel) -> tuple[int, int]:
        """``channel``'s backlog: (messages, payload bytes) admitted and not yet taken by ``recv``."""
        with self._cond:
            return self._backlog_messages[channel], self._backlog_bytes[channel]

    def close(self) -> None:
        """Wake every waiter with ``ClosedError`` and close the transport."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.transport.close()

    def _admit(self, raw_header: bytes) -> _Admitted | None:
        """Runs on the transport's thread before any payload buffer is sized: the header, authenticated,
        and its pair's key, if its message may be received; None to drop it. Never raises. The first
        message of a sender process this endpoint does not know yet looks its key up
        (``PeerKeys.receiving``)."""
        try:
            header, key = self._authenticate(raw_header)
        except SenderError as exc:
            self.stats["rejected_sender"] += 1
            log.warning("dropped a message on %s: %s", self.self_id, exc)
            return None
        except IntegrityError as exc:
            self.stats["rejected_auth"] += 1
            log.warning("dropped a message on %s: %s", self.self_id, exc)
            return None
        if header.epoch < self._epoch:
            self.stats["rejected_stale_epoch"] += 1
            log.warning("dropped a %s message of epoch %d from %r (current epoch %d)", header.channel.name,
                        header.epoch, header.sender, self._epoch)  # fmt: skip
            return None
        if header.nbytes > self.max_message_bytes:
            self.stats["rejected_size"] += 1
            log.warning("dropped a %s message of %d bytes from %r (limit %d)", header.channel.name, header.nbytes,
                        header.sender, self.max_message_bytes)  # fmt: skip
            return None
        if not self._enqueue(header):
            self.stats["rejected_backlog"] += 1
            log.warning("dropped a %s message of %d bytes from %r: the channel's backlog is full (%d messages, "
                        "%d bytes)", header.channel.name, header.nbytes, header.sender,
                        *self.backlog(header.channel))  # fmt: skip
            return None
        if not self._replay.accept(header.sender, header.epoch, header.seq):
            self._unqueue(header)
            self.stats["rejected_replay"] += 1
            log.warning("dropped a replayed %s message (seq %d, epoch %d) from %r", header.channel.name,
                        header.seq, header.epoch, header.sender)  # fmt: skip
            return None
        return _Admitted(header, key)

    def _authenticate(self, raw_header: bytes) -> tuple[Header, bytes]:
        """The header, its member and sender MACs verified, and the key of its pair."""
        keys = self.keys
        if keys is None:
            return Header.unpack(raw_header, self._key), self._key
        pair: list[bytes] = []

        def sender_key(header: Header) -> bytes:
            pair.append(keys.receiving(header))
            return pair[0]

        return Header.unpack(raw_header, self._key, sender_key), pair[0]

    def _enqueue(self, header: Header) -> bool:
        """Count ``header``'s message into its channel's backlog if the bounds allow it."""
        channel = header.channel
        with self._cond:
            messages, nbytes = self._backlog_messages[channel], self._backlog_bytes[channel]
            if messages >= self.max_queued_messages or (messages and nbytes + header.nbytes > self.max_queued_bytes):
                return False
            self._backlog_messages[channel] += 1
            self._backlog_bytes[channel] += header.nbytes
            return True

    def _unqueue(self, header: Header) -> None:
        """``header``'s message leaves its channel's backlog (received or dropped)."""
        with self._cond:
            self._backlog_messages[header.channel] -= 1
            self._backlog_bytes[header.channel] -= header.nbytes

    def _on_drop(self, admitted: _Admitted) -> None:
        """Runs on the transport's thread for an admitted message that will never be delivered."""
        self._unqueue(admitted.header)
        self.stats["dropped_in_transfer"] += 1

    def _on_message(self, admitted: _Admitted, payload: np.ndarray) -> None:
        """Runs on the transport's thread with an admitted header: fence by epoch (it may have moved
        since admission), enqueue. Never raises."""
        header = admitted.header
        with self._cond:
            if header.epoch < self._epoch:
                self._unqueue(header)
                self.stats["rejected_stale_epoch"] += 1
                return
            self._queues[header.channel].append((admitted, payload))
            self.stats["delivered"] += 1
            self._cond.notify_all()
