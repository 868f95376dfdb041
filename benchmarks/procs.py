"""What the benchmarks that start their own deployments share: a free port, a process's memory, and
stopping what they started when they are themselves stopped."""

from __future__ import annotations

import signal
import socket
import threading
from pathlib import Path


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C (``KeyboardInterrupt``), so the ``finally`` that stops a
    benchmark's deployment runs: by default SIGTERM ends the process at once and leaves its
    controller, workers and Redis running. Main thread only (a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MB (None: gone, or no /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
