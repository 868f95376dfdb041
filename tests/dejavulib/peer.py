"""A UCX peer process driven over the CONTROL channel, for tests and benchmarks.

Run as ``python peer.py SECRET PROGRESS ADDRESS_FILE``: writes its UCX address (hex) to ADDRESS_FILE
(UCX prints its protocol tables on stdout), reads the driver's address (hex) from stdin, then serves
JSON commands arriving as CONTROL messages from peer id ``driver`` until ``{"op": "exit"}``.
No pickle: commands and replies are JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from dejavulib.endpoint import Endpoint
from dejavulib.header import Channel, Header, secret_key
from dejavulib.transport.ucx import UcxTransport

DRIVER = "driver"


def reply(endpoint: Endpoint, obj: object) -> None:
    endpoint.send(DRIVER, Header(Channel.CONTROL), json.dumps(obj).encode(), 10).wait()


def serve(endpoint: Endpoint, transport: UcxTransport) -> None:
    while True:
        cmd = json.loads(endpoint.recv(Channel.CONTROL, 120).payload.tobytes())
        op = cmd["op"]
        if op == "exit":
            return
        if op == "echo_chunks":  # fetch every chunk, then flush each back under the same key
            bufs = [(key, np.empty(nbytes, np.uint8)) for key, nbytes in cmd["specs"]]
            for key, buf in bufs:
                transport.fetch(DRIVER, key, buf, 10)
            for key, buf in bufs:
                transport.flush(DRIVER, key, buf, 10)
        elif op == "echo_messages":  # send back each message of a channel with the same header fields
            for _ in range(cmd["count"]):
                m = endpoint.recv(Channel(cmd["channel"]), 10)
                endpoint.send(DRIVER, m.header, m.payload, 10).wait()
        elif op == "set_epoch":  # the ack is stamped with the new epoch
            endpoint.set_epoch(cmd["epoch"])
            reply(endpoint, {"epoch": endpoint.epoch})
        elif op == "stats":
            reply(endpoint, dict(endpoint.stats))
        elif op == "send_kv":  # slow producer: `count` KV_PROMPT messages of `nbytes`, `interval_s` apart
            payload = np.ones(cmd["nbytes"], np.uint8)
            for i in range(cmd["count"]):
                endpoint.send(DRIVER, Header(Channel.KV_PROMPT, microbatch=i), payload, 10).wait()
                time.sleep(cmd["interval_s"])
        elif op == "send_corrupt":  # a correctly sealed header, then one payload byte flipped on the way out
            payload = np.arange(cmd["nbytes"], dtype=np.uint8)
            key = secret_key(sys.argv[1])
            header = Header(Channel.TOKENS).with_payload(
                memoryview(payload), key, epoch=endpoint.epoch, seq=time.time_ns(), sender="peer"
            )
            payload[0] ^= 0xFF
            transport.send_message(DRIVER, header.pack(key), payload).wait(10)
        elif op == "replay":  # one correctly sealed message, sent `count` times (as an on-path recorder would)
            payload = np.arange(cmd["nbytes"], dtype=np.uint8)
            key = secret_key(sys.argv[1])
            header = Header(Channel(cmd["channel"])).with_payload(
                memoryview(payload), key, epoch=endpoint.epoch, seq=time.time_ns(), sender="peer"
            )
            for _ in range(cmd["count"]):
                transport.send_message(DRIVER, header.pack(key), payload).wait(10)
        else:
            reply(endpoint, {"error": f"unknown op {op}"})


def main() -> None:
    transport = UcxTransport("peer", progress=sys.argv[2])
    endpoint = Endpoint(transport, sys.argv[1])
    tmp = Path(sys.argv[3] + ".tmp")
    tmp.write_text(transport.address.hex())
    tmp.rename(sys.argv[3])
    transport.connect(DRIVER, bytes.fromhex(sys.stdin.readline().strip()))
    try:
        serve(endpoint, transport)
    finally:
        endpoint.close()


if __name__ == "__main__":
    main()
