"""What authenticating data-plane payloads costs (``dejavu bench integrity``): prints a table, writes
results/integrity.json.

The payload MAC (HMAC-SHA256 under the deployment key, ``dejavulib.header.payload_mac``) replaced a
crc32, which detects accidents but not an attacker. Per payload size this measures, in one process on
one core, the throughput of: crc32 (what it replaced), the payload MAC, sealing a header for a payload
(``Header.with_payload`` + ``pack``: one payload MAC and one header MAC) and verifying it on receipt
(``Header.unpack`` + ``verify_payload``), next to memcpy of the same bytes. Best of ``--repeat`` runs.

Then, per message, what per-pair keys (``dejavulib.peerkeys``) add: sealing and opening a small message
with the deployment key only, and with the pair's key (the sender's key lookup, three MACs, the receiver's
key lookup by the header's sender and key id), in microseconds; and, once per peer process, deriving a
pair's keys (``PeerKeys.learn``: one X25519 and two HKDF-SHA256).
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dejavulib.header import Channel, Header, payload_mac, secret_key
from dejavulib.peerkeys import PeerKeys

KEY = secret_key("benchmark-secret")


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(nbytes: int, repeat: int) -> dict[str, float]:
    """GB/s of each operation on a payload of ``nbytes``."""
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    view = memoryview(payload)
    out = np.empty_like(payload)
    sealed = Header(Channel.KV_PROMPT).with_payload(view, KEY, epoch=1, seq=1, sender="bench")
    raw = sealed.pack(KEY)

    def verify() -> None:
        Header.unpack(raw, KEY).verify_payload(view, KEY)

    operations: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(out, payload),
        "crc32": lambda: zlib.crc32(view),
        "payload_mac": lambda: payload_mac(KEY, view),
        "seal": lambda: Header(Channel.KV_PROMPT).with_payload(view, KEY, epoch=1, seq=1, sender="bench").pack(KEY),
        "verify": verify,
    }
    return {name: nbytes / best_seconds(fn, repeat) / 1e9 for name, fn in operations.items()}


def per_message(repeat: int, count: int = 20_000, nbytes: int = 64) -> dict[str, float]:
    """Microseconds per small message: seal + open with the deployment key, and with per-pair keys; and per
    derivation of a pair's keys."""
    payload = memoryview(np.zeros(nbytes, np.uint8))
    sender, receiver = PeerKeys("sender", "benchmark-secret"), PeerKeys("receiver", "benchmark-secret")
    sender.learn("receiver", receiver.public)
    receiver.learn("sender", sender.public)

    def shared() -> None:
        for seq in range(count):
            sealed = Header(Channel.ACTIVATION).with_payload(payload, KEY, epoch=1, seq=seq, sender="sender")
            Header.unpack(sealed.pack(KEY), KEY).verify_payload(payload, KEY)

    def paired() -> None:
        for seq in range(count):
            key, kid = sender.sending("receiver")
            header = Header(Channel.ACTIVATION)
            sealed = header.with_payload(payload, key, epoch=1, seq=seq, sender="sender", key_id=kid)
            opened = Header.unpack(sealed.pack(KEY, key), KEY, receiver.receiving)
            opened.verify_payload(payload, receiver.receiving(opened))  # a second look-up: an upper bound

    def derive() -> None:  # a fresh key ring each run: ``learn`` skips a key it holds already
        ring = PeerKeys("receiver", "benchmark-secret")
        for i in range(count // 100):
            ring.learn(f"peer-{i}", sender.public)

    return {
        "shared_us": best_seconds(shared, repeat) / count * 1e6,
        "paired_us": best_seconds(paired, repeat) / count * 1e6,
        "derive_us": best_seconds(derive, repeat) / (count // 100) * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,262144,4194304,67108864", help="Payload sizes in bytes.")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/integrity.json"))
    args = parser.parse_args()
    rows = []
    print(f"{'bytes':>10}  {'memcpy':>8}  {'crc32':>8}  {'mac':>8}  {'seal':>8}  {'verify':>8}   (GB/s)")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        figures = measure(nbytes, args.repeat)
        rows.append({"bytes": nbytes, **{f"{k}_gb_s": round(v, 3) for k, v in figures.items()}})
        print(
            f"{nbytes:>10}  {figures['memcpy']:>8.2f}  {figures['crc32']:>8.2f}  {figures['payload_mac']:>8.2f}"
            f"  {figures['seal']:>8.2f}  {figures['verify']:>8.2f}"
        )
    message = per_message(args.repeat)
    print(
        f"per 64-byte message: deployment key {message['shared_us']:.2f} us, per-pair keys "
        f"{message['paired_us']:.2f} us (seal + open); deriving a pair's keys {message['derive_us']:.1f} us, "
        "once per peer process"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeat": args.repeat, "rows": rows, "per_message": message}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
