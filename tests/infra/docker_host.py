"""A Docker engine for the container tests: the one running, or a ``dockerd`` this test session starts.

``make test`` (its ``setup-dev``) installs Docker's Debian packages where it may (scripts/ensure-system-packages.sh); no
service is left running, so a test that needs the engine starts ``dockerd`` and stops it by PID after.
Every reason not to run (not Linux, not root and no engine to talk to, no ``dockerd``, a daemon that does
not come up) is returned as a sentence for ``pytest.skip``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 60.0


def engine_answers() -> bool:
    """Whether ``docker info`` reaches an engine."""
    if shutil.which("docker") is None:
        return False
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def compose_available() -> bool:
    """Whether ``docker compose`` (v2) or ``docker-compose`` (v1) is installed (the Makefile picks one)."""
    if shutil.which("docker-compose"):
        return True
    result = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return result.returncode == 0


class DockerDaemon:
    """``dockerd`` started by this process (with its own log), or nothing if an engine already answers."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None

    def why_not(self) -> str | None:
        """Make sure an engine answers; return why it cannot, or None."""
        if not sys.platform.startswith("linux"):
            return "the container test needs a Linux Docker host"
        if shutil.which("docker") is None:
            return "no docker client (make setup installs docker.io where it runs as root with apt-get)"
        if not compose_available():
            return "neither `docker compose` nor docker-compose is installed"
        if engine_answers():
            return None
        if os.geteuid() != 0:
            return "no Docker engine answers and only root may start dockerd here"
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            return "no Docker engine answers and dockerd is not installed (apt-get install docker.io)"
        handle, name = tempfile.mkstemp(prefix="dejavu-dockerd-", suffix=".log")
        self.log = Path(name)
        # A pid file of its own: a stale /var/run/docker.pid whose number a live process reuses would stop it.
        args = [dockerd, "--pidfile", str(self.log.with_suffix(".pid"))]
        with os.fdopen(handle, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"dockerd exited with code {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            if engine_answers():
                return None
            time.sleep(0.5)
        self.stop()
        return f"dockerd did not answer within {START_TIMEOUT_S:.0f} s"

    def stop(self) -> None:
        """Stop the dockerd this object started (SIGTERM stops its containers and its containerd too)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.log is not None:
            self.log.unlink(missing_ok=True)
            self.log.with_suffix(".pid").unlink(missing_ok=True)
