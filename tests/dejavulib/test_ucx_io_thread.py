"""The UCX transport's I/O thread outlives a failing pass, and a persistently failing one closes the
transport (waiters fail at once, not at their deadlines) and reports through ``on_failure``."""

from __future__ import annotations

import time

import pytest

from dejavulib.errors import ClosedError
from dejavulib.handle import Handle
from dejavulib.transport.ucx import UcxTransport

pytestmark = pytest.mark.ucx


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_one_failing_pass_is_survived_and_persistent_failure_closes_the_transport() -> None:
    transport = UcxTransport("io-test")
    failed: list[BaseException] = []
    transport.on_failure = failed.append
    real_probe, calls = transport._probe, [0]

    def flaky_probe() -> bool:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("one bad pass")
        return real_probe()

    try:
        transport._probe = flaky_probe
        _wait(lambda: calls[0] > 10)
        assert transport._thread.is_alive() and not failed

        waiter = Handle()
        transport._ops.append((lambda: None, waiter))  # never run: the loop breaks before

        def broken() -> bool:
            raise RuntimeError("UCX worker broken")

        transport._run_ops = broken
        transport._thread.join(10)
        assert not transport._thread.is_alive()
        assert len(failed) == 1 and "UCX worker broken" in str(failed[0])
        with pytest.raises(ClosedError):
            waiter.wait(1)
    finally:
        transport.close()


def test_workers_leave_out_cross_memory_attach_unless_told_otherwise() -> None:
    """With cma, a receiver reads a rendezvous message out of the sender's memory; a sender SIGKILLed
    mid-message then made UCX abort the receiver (process_vm_readv: No such process), turning one
    failure into two in the failure tests. Workers use shared-memory segments instead."""
    import os

    if "UCX_TLS" in os.environ:
        pytest.skip("UCX_TLS is set in the environment, which wins")
    a, b = UcxTransport("tls-a"), UcxTransport("tls-b")
    try:
        a.connect("tls-b", b.address)
        assert "cma" not in a.selected["tls-b"] and a.selected["tls-b"]
    finally:
        a.close()
        b.close()
    c, d = UcxTransport("tls-c", tls=None), UcxTransport("tls-d", tls=None)
    try:
        c.connect("tls-d", d.address)  # UCX's own choice still works (and may take cma)
        assert c.selected["tls-d"]
    finally:
        c.close()
        d.close()
