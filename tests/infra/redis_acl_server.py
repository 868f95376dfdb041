"""A redis-server started the way the deployments start it: through infra/redis/start.sh."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from .conftest import INFRA

START = INFRA / "redis" / "start.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def password_variable(user: str) -> str:
    """The variable start.sh reads ``user``'s password from."""
    return "REDIS_PASSWORD_" + user.upper().replace("-", "_").replace(".", "_")


class AclRedis:
    """redis-server with DejaVu's redis.conf and rendered ACL users, on a free loopback port.

    ``passwords`` maps user name to password (``worker-<id>`` users come from the ids in ``worker_ids``).
    The process is this object's: ``stop`` ends it by PID.
    """

    def __init__(self, workdir: Path, passwords: Mapping[str, str], worker_ids: tuple[str, ...] = ()) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found on PATH; run `make setup`")
        self.port = _free_port()
        self.data_dir = workdir / "data"
        self.data_dir.mkdir()
        self.acl_file = workdir / "users.acl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
        env.update({password_variable(user): pw for user, pw in passwords.items()})
        if worker_ids:
            env["REDIS_WORKER_IDS"] = ",".join(worker_ids)
        env.update(REDIS_DATA_DIR=str(self.data_dir), REDIS_ACL_FILE=str(self.acl_file))
        # start.sh execs redis-server, so this PID is the server's.
        self.proc = subprocess.Popen(
            ["sh", str(START), "--port", str(self.port), "--bind", "127.0.0.1", "--logfile", str(workdir / "log")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"start.sh exited with {self.proc.returncode}: {self.proc.stderr.read()!r}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
