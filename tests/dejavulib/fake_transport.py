"""The tests' in-memory transport between objects of one process, for the layers above transports.

Addresses are ``b"fake:<n>"`` names in a process-wide registry. Chunks and messages are copied, so a
sender may reuse its buffer as soon as a call returns, exactly like a real transport. Chunks follow the
slot contract (``transport/base.py``): the last flush per (sender, key) stays until discarded.
Serving never runs it: it lives with the tests (the library holds what serving runs).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from dejavulib.buffers import Buffer, as_bytes
from dejavulib.errors import ClosedError, IntegrityError, PeerError, TransferTimeout
from dejavulib.handle import Handle
from dejavulib.transport.base import (
    MAX_HEADER_BYTES,
    MessageAdmit,
    MessageDrop,
    MessageSink,
    MessageTransport,
    check_key,
)


class _Directory:
    """The process-wide address book of fake transports. Thread-safe."""

    def __init__(self) -> None:
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._by_address: dict[bytes, FakeTransport] = {}

    def register(self, transport: FakeTransport) -> bytes:
        address = b"fake:" + str(next(self._names)).encode()
        with self._lock:
            self._by_address[address] = transport
        return address

    def check(self, address: bytes) -> None:
        if not address.startswith(b"fake:"):
            raise PeerError(f"not a fake transport address: {address!r}")

    def peer(self, peers: dict[str, bytes], peer_id: str) -> FakeTransport:
        with self._lock:
            found = self._by_address.get(peers.get(peer_id, b""))
        if found is None:
            raise PeerError(f"peer {peer_id!r} is not connected or has closed")
        return found

    def unregister(self, address: bytes) -> None:
        with self._lock:
            self._by_address.pop(address, None)


class _Slots:
    """The last chunk per (sender, key); ``get`` waits for one up to a deadline."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, int], bytes] = {}
        self._cond = threading.Condition()

    def put(self, sender: str, key: int, value: bytes) -> None:
        with self._cond:
            self._slots[(sender, key)] = value
            self._cond.notify_all()

    def pop(self, sender: str, key: int) -> None:
        with self._cond:
            self._slots.pop((sender, key), None)

    def get(self, sender: str, key: int, deadline_s: float) -> bytes:
        end = time.monotonic() + deadline_s
        with self._cond:
            while (sender, key) not in self._slots:
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no chunk {key} from {sender!r} within {deadline_s} s")
                self._cond.wait(left)
            return self._slots[(sender, key)]


_DIRECTORY = _Directory()


class FakeTransport(MessageTransport):
    """Slot semantics for chunks; messages are delivered synchronously on the sender's thread."""

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self._slots = _Slots()
        self._peers: dict[str, bytes] = {}
        self._admit: MessageAdmit | None = None
        self._sink: MessageSink | None = None
        self._drop: MessageDrop | None = None
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
            elif admitted is not None and peer._drop is not None:  # admitted, then a payload of another size
                peer._drop(admitted)
        return Handle.completed(payload.nbytes)

    def set_message_sink(self, admit: MessageAdmit, sink: MessageSink, drop: MessageDrop | None = None) -> None:
        self._admit, self._sink, self._drop = admit, sink, drop

    def discard(self, peer_id: str, key: int) -> None:
        check_key(key)
        self._slots.pop(peer_id, key)

    def close(self) -> None:
        self._closed = True
        _DIRECTORY.unregister(self._address)
