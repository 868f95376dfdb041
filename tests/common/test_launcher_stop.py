"""Stopping a whole deployment stops its workers at once (a second SIGTERM), not with a drain: a drain
waits for a hand-over no controller will make, and the worker would be SIGKILLed at the grace period
without deregistering or cleaning up. Processes not named in ``stop_now`` get one SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

from dejavu_cli.launcher import terminate_all

# A worker's SIGTERM handling in small: the first SIGTERM drains (goes on), a second one stops it.
_WORKER = """
import signal, sys, time
seen = []
def on_term(*_):
    seen.append(1)
    if len(seen) == 2:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
while True:
    time.sleep(0.01)
"""


def _start() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_workers_told_to_stop_now_exit_cleanly_and_others_drain_until_the_grace_period() -> None:
    worker, drainer = _start(), _start()
    try:
        started = time.monotonic()
        terminate_all([worker, drainer], grace_s=3.0, stop_now=[worker])
        assert worker.returncode == 0  # stopped by its own handler, not killed
        assert drainer.returncode == -9  # one SIGTERM: still draining at the grace period
        assert time.monotonic() - started < 10
    finally:
        for p in (worker, drainer):
            if p.poll() is None:
                p.kill()
                p.wait()
