"""Fixtures of the DejaVuLib tests: a real UCX peer process (stopped by PID) and in-process transport pairs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dejavulib.endpoint import Endpoint
from dejavulib.header import Channel, Header

SECRET = "test-secret"
PEER_SCRIPT = Path(__file__).with_name("peer.py")


@pytest.fixture(autouse=True, scope="session")
def _few_threads() -> None:
    torch.set_num_threads(1)


class UcxPeer:
    """``tests/dejavulib/peer.py`` in its own process, and this process's ``driver`` endpoint to it."""

    def __init__(self, progress: str = "polling", endpoint: Endpoint | None = None, name: str = "peer") -> None:
        """``endpoint``: a driver endpoint of the test's own, which several peers can share (each connected
        under its ``name``); by default the peer gets a driver endpoint of its own."""
        from dejavulib.transport.ucx import UcxTransport

        self.name, self._owns_endpoint = name, endpoint is None
        self._dir = tempfile.mkdtemp(prefix="dejavu-peer-")
        address_file = Path(self._dir) / "address"
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), SECRET, progress, str(address_file)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            address = bytes.fromhex(self._wait_for(address_file))
            self.proc_address = address
            if endpoint is None:
                self.transport = UcxTransport("driver", progress=progress)
                self.endpoint = Endpoint(self.transport, SECRET)
            else:
                self.endpoint = endpoint
                self.transport = endpoint.transport  # type: ignore[assignment]
            self.transport.connect(name, address)
            self.proc.stdin.write(self.transport.address.hex() + "\n")
            self.proc.stdin.flush()
        except BaseException:
            self.kill()
            raise

    def _wait_for(self, path: Path) -> str:
        deadline = time.monotonic() + 60
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"UCX peer did not start (exit code {self.proc.poll()})")
            time.sleep(0.02)
        return path.read_text()

    def command(self, **cmd: object) -> None:
        self.endpoint.send(self.name, Header(Channel.CONTROL), json.dumps(cmd).encode(), 10).wait()

    def reply(self) -> dict:
        return json.loads(self.endpoint.recv(Channel.CONTROL, 10).payload.tobytes())

    def kill(self) -> None:
        """SIGKILL the peer by PID (a crash, as far as UCX can tell)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command(op="exit")
                self.proc.wait(10)
            except Exception:
                pass
        self.kill()
        if self._owns_endpoint:
            self.endpoint.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ucx_peer() -> Iterator[UcxPeer]:
    """One peer process shared by a module's tests (tests leave it idle)."""
    peer = UcxPeer()
    try:
        yield peer
    finally:
        peer.stop()


@pytest.fixture
def fresh_ucx_peer() -> Iterator[UcxPeer]:
    """A peer process of the test's own, for tests that kill it."""
    peer = UcxPeer()
    try:
        yield peer
    finally:
        peer.stop()
