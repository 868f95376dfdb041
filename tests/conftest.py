"""Fixtures shared by the whole suite: a real redis-server on a free port, stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine-device",
        default=os.environ.get("DEJAVU_TEST_DEVICE", "cpu"),
        help="device the engine tests run their stages on (cpu, cuda, cuda:1; env DEJAVU_TEST_DEVICE): on a device "
        "other than the CPU, the device-generic engine tests run there and the rest of tests/engine is skipped",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process this test session owns."""

    def __init__(self, port: int | None = None) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise RuntimeError("redis-server not found on PATH; run `make setup`")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="dejavu-redis-")
        self._spawn()

    def _spawn(self) -> None:
        """Start redis-server without persistence (as ``dejavu up`` runs it) and wait for PONG."""
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # the port may still be held by a process going away
                time.sleep(0.1)
                self.proc = subprocess.Popen(self.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                continue
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start within 10 s")

    def kill(self) -> None:
        """SIGKILL the server: every key is lost (no persistence)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def restart(self, down_s: float = 0.0) -> None:
        """SIGKILL the server and start an empty one on the same port after ``down_s`` seconds."""
        self.kill()
        time.sleep(down_s)
        self._spawn()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database on the session's server for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test alone (it may kill or restart it: ``restart``), stopped after."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
