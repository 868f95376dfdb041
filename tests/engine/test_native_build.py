"""``python -m dejavu_engine.native`` (``make kernels``): a failed build with a compiler at hand is an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {**os.environ, "DEJAVU_KERNEL_CACHE": str(tmp_path / "cache")}
    base["DEJAVU_KERNEL_PREBUILT"] = str(tmp_path / "none")  # no build made ahead to fall back on
    return subprocess.run(
        [sys.executable, "-m", "dejavu_engine.native"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failing_compiler_fails_the_build(tmp_path: Path) -> None:
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'broken-c++: internal error' >&2\nexit 1\n")
    compiler.chmod(0o755)
    done = _run(tmp_path, CXX=str(compiler))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed to build" in done.stderr


def test_no_compiler_falls_back_with_a_note(tmp_path: Path) -> None:
    done = _run(tmp_path, CXX="no-such-compiler", PATH=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no C++ compiler" in done.stdout
