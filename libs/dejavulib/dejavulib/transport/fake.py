"""In-memory transport between objects of one process, for testing the layers above transports.

Addresses are ``b"fake:<n>"`` names in a process-wide registry. Chunks and messages are copied, so a
sender may reuse its buffer as soon as a call returns, exactly like a real transport.
"""

from __future__ import annotations

import numpy as np

from dejavulib.buffers import Buffer, as_bytes
from dejavulib.errors import ClosedError, IntegrityError
from dejavulib.handle import Handle
from dejavulib.transport.base import MAX_HEADER_BYTES, MessageAdmit, MessageSink, MessageTransport, check_key
from dejavulib.transport.directory import Directory
from dejavulib.transport.slots import SlotStore

_DIRECTORY: Directory[FakeTransport] = Directory("fake")


class FakeTransport(MessageTransport):
    """Slot semantics for chunks; messages are delivered synchronously on the sender's thread."""

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self._slots: SlotStore[bytes] = SlotStore()
        self._peers: dict[str, bytes] = {}
        self._admit: MessageAdmit | None = None
        self._sink: MessageSink | None = None
        self._closed = False
        self._address = _DIRECTORY.register(self)

    @property
    def address(self) -> bytes:
        return self._address

    def connect(self, peer_id: str, address: bytes) -> None:
        _DIRECTORY.check(address)
        self._peers[peer_id] = address

    def _peer(self, peer_id: str) -> FakeTransport:
        if self._closed:
            raise ClosedError("transport closed")
        return _DIRECTORY.peer(self._peers, peer_id)

    def flush(self, peer_id: str, key: int, src: Buffer, deadline_s: float) -> None:
        check_key(key)
        self._peer(peer_id)._slots.put(self.self_id, key, as_bytes(src).tobytes())

    def fetch(self, peer_id: str, key: int, dst: Buffer, deadline_s: float) -> None:
        check_key(key)
        data = self._slots.get(peer_id, key, deadline_s)
        out = as_bytes(dst)
        if len(data) != out.nbytes:
            raise IntegrityError(f"chunk {key} from {peer_id!r} has {len(data)} bytes, buffer {out.nbytes}")
        out[:] = np.frombuffer(data, dtype=np.uint8)

    def send_message(self, peer_id: str, header: bytes, payload: np.ndarray) -> Handle:
        peer = self._peer(peer_id)
        if peer._admit is not None and peer._sink is not None and len(header) <= MAX_HEADER_BYTES:
            admitted = peer._admit(bytes(header))
            if admitted is not None and admitted.nbytes == payload.nbytes:
                peer._sink(admitted, np.array(payload, dtype=np.uint8, copy=True))
        return Handle.completed(payload.nbytes)

    def set_message_sink(self, admit: MessageAdmit, sink: MessageSink) -> None:
        self._admit, self._sink = admit, sink

    def discard(self, peer_id: str, key: int) -> None:
        check_key(key)
        self._slots.pop(peer_id, key)

    def close(self) -> None:
        self._closed = True
        _DIRECTORY.unregister(self._address)
