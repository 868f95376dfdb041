"""The process-wide address book of in-process transports (local and fake): names, connects, lookups."""

from __future__ import annotations

import itertools
import threading
from typing import Generic, TypeVar

from dejavulib.errors import PeerError

T = TypeVar("T")


class Directory(Generic[T]):
    """Addresses ``b"<scheme>:<n>"`` of live transports of one kind. Thread-safe."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self._prefix = f"{scheme}:".encode()
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._by_address: dict[bytes, T] = {}

    def register(self, transport: T) -> bytes:
        """A fresh address for ``transport``, reachable until :meth:`unregister`."""
        address = self._prefix + str(next(self._names)).encode()
        with self._lock:
            self._by_address[address] = transport
        return address

    def check(self, address: bytes) -> None:
        """Raise ``PeerError`` unless ``address`` is one of this kind's."""
        if not address.startswith(self._prefix):
            raise PeerError(f"not a {self.scheme} transport address: {address!r}")

    def peer(self, peers: dict[str, bytes], peer_id: str) -> T:
        """The live transport ``peer_id`` was connected to; ``PeerError`` if none (or it closed)."""
        with self._lock:
            found = self._by_address.get(peers.get(peer_id, b""))
        if found is None:
            raise PeerError(f"peer {peer_id!r} is not connected or has closed")
        return found

    def unregister(self, address: bytes) -> None:
        with self._lock:
            self._by_address.pop(address, None)
