"""Disk transport: persistent replicas, one directory per destination stage, one file per (sender, key).

``flush(peer, key, src)`` writes ``<peer root>/<sender>.<key>.kv`` atomically (temporary file, fsync
optional, rename), so a crash never leaves a half-written chunk behind. ``fetch(peer, key, dst)`` reads
``<own root>/<peer>.<key>.kv``, waiting for it up to the deadline. A peer's address is its root folder
on a filesystem both sides share.

A process that keeps its folder under a shared base holds a :class:`FolderLease` on it; any process can
then :func:`sweep_orphans` the base, removing the folders of owners that died (SIGKILL included) without
touching a live one's.
"""

from __future__ import annotations

import contextlib
import fcntl
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


_LOCKS = ".owners"  # under the base: one lock file per owner (ids never start with a dot, so no folder is named so)
_LEASE_WAIT_S = 2.0  # a sweeper holds a dead owner's lock for the moment it takes to empty its folder


class FolderLease:
    """This process's ownership of ``base_dir/<owner>``: an exclusive ``flock`` on ``base_dir/.owners/<owner>``,
    held until :meth:`release` or until the process ends, however it ends (the kernel drops it), so
    :func:`sweep_orphans` can tell a dead owner's folder from a live one's. Raises ``PeerError`` when another
    live process holds it."""

    def __init__(self, base_dir: Path, owner: str) -> None:
        locks = Path(base_dir) / _LOCKS
        locks.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = locks / _safe(owner)
        end = time.monotonic() + _LEASE_WAIT_S
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= end:
                    raise PeerError(
                        f"the folder of {owner!r} under {base_dir} is held by another live process"
                    ) from None
                time.sleep(0.01)
                continue
            try:  # a sweeper may have removed the file between the open and the lock: then it locks nothing
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = -1
            if current == os.fstat(fd).st_ino:
                self._fd: int | None = fd
                return
            os.close(fd)

    def release(self) -> None:
        """Give the folder up (its lock file goes too, removed while still held)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def sweep_orphans(base_dir: Path) -> list[str]:
    """Remove the folders under ``base_dir`` whose owners are gone (a :class:`FolderLease` that no live
    process holds) and their lock files; returns those owners. Folders of live owners, and folders without
    a lock file, are left alone."""
    base = Path(base_dir)
    removed = []
    for lock in sorted((base / _LOCKS).glob("*")) if (base / _LOCKS).is_dir() else []:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            folder = base / lock.name
            if folder.is_dir() and not folder.is_symlink():
                for path in folder.iterdir():
                    if path.is_file() or path.is_symlink():
                        path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    folder.rmdir()
            lock.unlink(missing_ok=True)  # while held: an owner that opened it meanwhile sees it gone and retries
            removed.append(lock.name)
        finally:
            os.close(fd)
    return removed


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
