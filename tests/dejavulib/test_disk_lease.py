"""Folders under a shared base, each leased by the process that owns it: a sweep removes the folders of
owners that died (SIGKILL included), and never a live owner's or an unleased one's."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dejavulib.errors import PeerError
from dejavulib.transport import disk
from dejavulib.transport.disk import FolderLease, sweep_orphans

_HOLDER = """
import sys, time
from pathlib import Path
from dejavulib.transport.disk import FolderLease
base, owner = Path(sys.argv[1]), sys.argv[2]
lease = FolderLease(base, owner)
(base / owner).mkdir()
(base / owner / "chunk.kv").write_bytes(b"kv")
print("held", flush=True)
time.sleep(60)
"""


def _holder(base: Path, owner: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(base), owner], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_dead_owners_folder_is_swept_and_a_live_ones_is_not(tmp_path: Path) -> None:
    dead, alive = _holder(tmp_path, "w1.10"), _holder(tmp_path, "w2.20")
    try:
        (tmp_path / "legacy").mkdir()  # a folder nobody leases: not ours to judge
        assert sweep_orphans(tmp_path) == []  # both owners live
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert sweep_orphans(tmp_path) == ["w1.10"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".owners", "legacy", "w2.20"]
        assert [p.name for p in (tmp_path / ".owners").iterdir()] == ["w2.20"]
        assert (tmp_path / "w2.20" / "chunk.kv").read_bytes() == b"kv"
        assert sweep_orphans(tmp_path) == []
    finally:
        for proc in (dead, alive):
            proc.kill()
            proc.wait(10)


def test_a_lease_is_exclusive_until_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "_LEASE_WAIT_S", 0.05)
    lease = FolderLease(tmp_path, "w1.10")
    with pytest.raises(PeerError, match="held by another live process"):
        FolderLease(tmp_path, "w1.10")
    (tmp_path / "w1.10").mkdir()
    assert sweep_orphans(tmp_path) == []  # held (by this process): a live owner's
    lease.release()
    assert not any((tmp_path / ".owners").iterdir())  # the lock file goes with the lease
    again = FolderLease(tmp_path, "w1.10")  # and the owner can lease it again
    again.release()
    with pytest.raises(ValueError):
        FolderLease(tmp_path, "../escape")
