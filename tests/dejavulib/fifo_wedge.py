"""Reproduce, outside the serving system, a receiver's shared-memory FIFO wedged by a sender SIGKILLed mid-write.

Run as ``python tests/dejavulib/fifo_wedge.py [ITERATIONS] [MESSAGE_BYTES]`` (not collected by pytest: the
event is a race, not something a test can count on). Each iteration makes a fresh receiver transport in this
process, starts a sender process streaming eager-sized messages to it, SIGKILLs the sender at a random moment,
and asks the receiver ``receive_path_ok()`` (a second UCX worker of this process sends it one byte through the
same FIFO). A sender killed between reserving a FIFO element and marking it written leaves the element
unfinished, and the receiver then reads nothing past it from anyone: ``receive path ok: False``. Every process
it starts, it stops by PID.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time

import numpy as np

SECRET = "fifo-wedge"


def _sender(address_hex: str, pids: mp.Queue, nbytes: int) -> None:
    from dejavulib.endpoint import Endpoint
    from dejavulib.header import Channel, Header
    from dejavulib.transport.ucx import UcxTransport

    endpoint = Endpoint(UcxTransport("sender", progress="thread", host="127.0.0.1"), SECRET)
    endpoint.connect("receiver", bytes.fromhex(address_hex))
    pids.put(os.getpid())
    payload = np.ones(nbytes, np.uint8)
    while True:
        for _ in range(200):
            endpoint.send("receiver", Header(Channel.KV_PROMPT), payload, 10)
        time.sleep(0.001)


def main(iterations: int, nbytes: int) -> int:
    from dejavulib.endpoint import Endpoint
    from dejavulib.transport.ucx import UcxTransport

    ctx = mp.get_context("spawn")
    wedged = 0
    for i in range(iterations):
        endpoint = Endpoint(UcxTransport("receiver", progress="thread", host="127.0.0.1"), SECRET)
        pids: mp.Queue = ctx.Queue()
        sender = ctx.Process(target=_sender, args=(endpoint.address.hex(), pids, nbytes))
        sender.start()
        try:
            pid = pids.get(timeout=60)
            time.sleep(0.3 + 0.3 * random.random())
            os.kill(pid, signal.SIGKILL)
            sender.join(10)
            ok = endpoint.transport.receive_path_ok(2.0)
            print(f"iteration {i}: {endpoint.stats['delivered']} messages delivered, receive path ok: {ok}", flush=True)
            wedged += not ok
        finally:
            if sender.is_alive():
                os.kill(sender.pid, signal.SIGKILL)
                sender.join(10)
            endpoint.close()
    print(f"wedged {wedged} of {iterations}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20, int(sys.argv[2]) if len(sys.argv) > 2 else 8000))
