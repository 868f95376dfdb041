"""The UCX transport's I/O thread outlives a failing pass, and a persistently failing one closes the
transport (waiters fail at once, not at their deadlines) and reports through ``on_failure``; a control
message claiming a huge length is not allocated for."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dejavulib.errors import ClosedError
from dejavulib.handle import Handle
from dejavulib.transport.ucx import KIND_HEADER, UcxTransport, make_tag

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


def test_a_control_message_longer_than_a_header_is_dropped_not_allocated() -> None:
    receiver, sender = UcxTransport("rx"), UcxTransport("tx")
    delivered: list[bytes] = []
    receiver.set_message_sink(lambda header, payload: delivered.append(header))
    try:
        sender.connect("rx", receiver.address)
        sent = Handle()
        huge = np.zeros(1 << 20, np.uint8)  # a "header" of 1 MiB
        sender._submit(
            lambda: sender._post_send(sender._ep("rx"), huge, make_tag(KIND_HEADER, sender._hash, 0), sent.set_done),
            sent,
        )
        sent.wait(10)
        time.sleep(0.3)
        assert not delivered and not receiver._awaiting_payload
        assert receiver._thread.is_alive()
        # The receiver still works.
        ok = threading.Event()
        receiver.set_message_sink(lambda header, payload: ok.set())
        sender.send_message("rx", b"h" * 64, np.zeros(8, np.uint8)).wait(10)
        assert ok.wait(10)
    finally:
        sender.close()
        receiver.close()
