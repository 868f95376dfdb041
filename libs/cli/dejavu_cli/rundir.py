"""The launcher's private run directory: state file, admin signing key, Redis config.

A local deployment's files hold PIDs that ``dejavu down`` signals and secrets the children must not
put on a command line, so they live in a directory only this user can enter, never in a shared
world-writable place such as ``/tmp`` where another user could plant or swap them. The directory is
``$XDG_RUNTIME_DIR/dejavu`` when that is set (a per-user tmpfs), else ``<cache>/run``; it is created
0700 and, if it exists, used only if it is ours, not a symlink and closed to group and others
(:mod:`dejavu_common.private`).
"""

from __future__ import annotations

import os
from pathlib import Path

from dejavu_common.private import UnsafePathError, ensure_private_dir, read_private, write_private
from dejavu_common.settings import default_cache_dir

__all__ = ["UnsafePathError", "read_private", "run_dir", "write_private"]


def run_dir() -> Path:
    """The checked, private run directory (created if missing); raises :class:`UnsafePathError`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return ensure_private_dir(Path(runtime) / "dejavu" if runtime else default_cache_dir() / "run")
