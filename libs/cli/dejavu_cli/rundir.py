"""The launcher's private run directory: state file, admin signing key, Redis config.

A local deployment's files hold PIDs that ``dejavu down`` signals and secrets the children must not
put on a command line, so they live in a directory only this user can enter, never in a shared
world-writable place such as ``/tmp`` where another user could plant or swap them. The directory is
``$XDG_RUNTIME_DIR/dejavu`` when that is set (a per-user tmpfs), else ``<cache>/run``; it is created
0700 and, if it exists, used only if it is ours, not a symlink and closed to group and others.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from dejavu_common.settings import default_cache_dir


class UnsafeRunDirError(RuntimeError):
    """The run directory (or a file in it) could be read or changed by another user."""


def run_dir() -> Path:
    """The checked, private run directory (created if missing); raises :class:`UnsafeRunDirError`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(runtime) / "dejavu" if runtime else default_cache_dir() / "run"
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # an existing one is checked below, never trusted
        path.mkdir(mode=0o700)
    check_private(path, directory=True)
    return path


def check_private(path: Path, *, directory: bool = False) -> None:
    """Raise :class:`UnsafeRunDirError` unless ``path`` is a real file/directory of ours, closed to others."""
    info = path.lstat()
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise UnsafeRunDirError(f"{path} is not a plain {'directory' if directory else 'file'} (a symlink?)")
    if info.st_uid != os.getuid():
        raise UnsafeRunDirError(f"{path} belongs to uid {info.st_uid}, not to us (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise UnsafeRunDirError(f"{path} is open to group or others (mode {stat.S_IMODE(info.st_mode):o})")


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
