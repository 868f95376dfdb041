"""Private files and folders: created closed to others, refused when another user could change them."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dejavu_common.private import UnsafePathError, ensure_private_dir
from dejavu_common.settings import Settings


def test_a_private_folder_is_created_closed_and_checked(tmp_path: Path) -> None:
    path = ensure_private_dir(tmp_path / "a" / "replicas")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert ensure_private_dir(path) == path  # an existing private folder is fine
    path.chmod(0o1777)  # what /tmp looks like
    with pytest.raises(UnsafePathError, match="open to group or others"):
        ensure_private_dir(path)
    path.rmdir()
    (tmp_path / "theirs").mkdir(mode=0o700)
    path.symlink_to(tmp_path / "theirs")
    with pytest.raises(UnsafePathError, match="symlink"):
        ensure_private_dir(path)


def test_replicas_are_not_kept_in_a_shared_folder() -> None:
    replica_dir = Settings().recovery.replica_dir
    assert not str(replica_dir).startswith("/tmp"), replica_dir
