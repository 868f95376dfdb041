"""Files and folders only this user may touch: for PIDs another process will signal, secrets, replicas.

A path in a shared, world-writable place (``/tmp``) can be planted, swapped or read by another user of
the host. These helpers create what they need closed to group and others (0700 folders, 0600 files)
and refuse an existing path that is not a plain file/folder of ours, or that others could change.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


class UnsafePathError(RuntimeError):
    """A path could be read or changed by another user (or is a symlink where none should be)."""


def check_private(path: Path, *, directory: bool = False) -> None:
    """Raise :class:`UnsafePathError` unless ``path`` is a real file/folder of ours, closed to others."""
    info = path.lstat()
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise UnsafePathError(f"{path} is not a plain {'directory' if directory else 'file'} (a symlink?)")
    if info.st_uid != os.getuid():
        raise UnsafePathError(f"{path} belongs to uid {info.st_uid}, not to us (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise UnsafePathError(f"{path} is open to group or others (mode {stat.S_IMODE(info.st_mode):o})")


def ensure_private_dir(path: Path) -> Path:
    """``path`` as a checked private folder, created 0700 if missing (parents as usual)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # an existing one is checked below, never trusted
        path.mkdir(mode=0o700)
    check_private(path, directory=True)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by us only (0600), replacing it atomically; never follows a
    symlink planted at the temporary name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_private(path: Path) -> str | None:
    """``path``'s text if it exists (checked private first), else None."""
    if not path.exists():
        return None
    check_private(path)
    return path.read_text()
