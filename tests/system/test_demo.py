"""``make run``'s command, ``dejavu up --demo``: the whole system answers the demo request, the console shows our
lines and the answer but no library's log lines, and every process it started stops with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]


def test_demo_answers_and_prints_no_library_log_lines(tmp_path: Path) -> None:
    dejavu = Path(sys.executable).parent / "dejavu"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}  # its own run directory, beside any running system
    argv = [str(dejavu), "up", "--demo", "--exit-after-demo", "--port", str(free_port())]
    argv += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console
    assert "<<< " in console and "Paris" in console, console
    library_lines = [line for line in console.splitlines() if " INFO " in line and " dejavu." not in line]
    assert not library_lines, library_lines
    started = [int(pid) for pid in re.findall(r"started .* \(pid (\d+)\)", console)]
    assert started, console
    for pid in started:  # each was waited for by the launcher, so its pid is gone (or reused by another program)
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/cmdline").read_bytes().find(b"dejavu") < 0


def test_json_logs_of_every_service(tmp_path: Path) -> None:
    """With ``DEJAVU_LOG_FORMAT=json`` every line a service logs (libraries' and uvicorn's included) is one JSON
    object naming the service (and the worker); UCX, a C library, writes its own lines beside them."""
    dejavu = Path(sys.executable).parent / "dejavu"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "DEJAVU_LOG_FORMAT": "json"}
    argv = [str(dejavu), "up", "--demo", "--exit-after-demo", "--port", str(free_port())]
    argv += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = Path(re.search(r"logs in (\S+)", done.stdout + done.stderr).group(1))
    ucx = re.compile(r"^\[\d+\.\d+\] \[")
    services = set()
    for log_file in folder.glob("*.log"):
        for line in log_file.read_text().splitlines():
            if ucx.match(line):
                continue
            record = json.loads(line)
            services.add((record["service"], record.get("worker_id")))
    assert services == {("controller", None), ("token-worker", "t0")}
