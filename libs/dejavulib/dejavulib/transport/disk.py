"""Disk transport: persistent replicas, one directory per destination stage, one file per (sender, key).

``flush(peer, key, src)`` writes ``<peer root>/<sender>.<key>.kv`` atomically (temporary file, fsync
optional, rename), so a crash never leaves a half-written chunk behind. ``fetch(peer, key, dst)`` reads
``<own root>/<peer>.<key>.kv``, waiting for it up to the deadline. A peer's address is its root folder
on a filesystem both sides share.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from dejavulib.buffers import Buffer, as_bytes
from dejavulib.errors import IntegrityError, PeerError, TransferTimeout
from dejavulib.transport.base import Transport, check_key

_POLL_S = 0.001


def _safe(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"peer id {name!r} cannot name a file")
    return name


class DiskTransport(Transport):
    """Files under ``base_dir/<self_id>``; ``durable=True`` fsyncs every chunk before renaming it."""

    def __init__(self, self_id: str, base_dir: Path, durable: bool = False) -> None:
        super().__init__(self_id)
        self.root = Path(base_dir) / _safe(self_id)
        self.root.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self._peers: dict[str, Path] = {}

    @property
    def address(self) -> bytes:
        return os.fsencode(self.root)

    def connect(self, peer_id: str, address: bytes) -> None:
        root = Path(os.fsdecode(address))
        if not root.is_dir():
            raise PeerError(f"replica folder {root} of {peer_id!r} does not exist")
        self._peers[peer_id] = root

    def _file(self, root: Path, sender: str, key: int) -> Path:
        return root / f"{_safe(sender)}.{key}.kv"

    def flush(self, peer_id: str, key: int, src: Buffer, deadline_s: float) -> None:
        check_key(key)
        root = self._peers.get(peer_id)
        if root is None:
            raise PeerError(f"peer {peer_id!r} is not connected")
        final = self._file(root, self.self_id, key)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(as_bytes(src).data)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:  # e.g. the disk is full: no half-written file stays behind
            tmp.unlink(missing_ok=True)
            raise

    def discard(self, peer_id: str, key: int) -> None:
        check_key(key)
        self._file(self.root, peer_id, key).unlink(missing_ok=True)

    def fetch(self, peer_id: str, key: int, dst: Buffer, deadline_s: float) -> None:
        check_key(key)
        path, out = self._file(self.root, peer_id, key), as_bytes(dst)
        end = time.monotonic() + deadline_s
        while not path.exists():
            if time.monotonic() >= end:
                raise TransferTimeout(f"no chunk {key} from {peer_id!r} on disk within {deadline_s} s")
            time.sleep(_POLL_S)
        with open(path, "rb") as f:
            n = f.readinto(out.data)
            if n != out.nbytes or f.read(1):
                raise IntegrityError(f"chunk file {path} does not hold exactly {out.nbytes} bytes")
