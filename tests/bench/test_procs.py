"""A benchmark stopped with SIGTERM still runs the ``finally`` that stops the deployment it started
(by default SIGTERM ends a Python process at once, leaving its controller, workers and Redis behind)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

_BENCH = """
import sys, time
from benchmarks.procs import stop_on_sigterm
stop_on_sigterm()
try:
    print("started", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("deployment stopped")
"""


def test_sigterm_unwinds_a_benchmark_through_its_finally(tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-c", _BENCH, str(marker)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 5
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "deployment stopped"
    assert proc.returncode != 0  # still reported as interrupted
