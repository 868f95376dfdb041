"""What authenticating data-plane payloads costs (``dejavu bench integrity``): prints a table, writes
results/integrity.json.

The payload MAC (HMAC-SHA256 under the deployment key, ``dejavulib.header.payload_mac``) replaced a
crc32, which detects accidents but not an attacker. Per payload size this measures, in one process on
one core, the throughput of: crc32 (what it replaced), the payload MAC, sealing a header for a payload
(``Header.with_payload`` + ``pack``: one payload MAC and one header MAC) and verifying it on receipt
(``Header.unpack`` + ``verify_payload``), next to memcpy of the same bytes. Best of ``--repeat`` runs.
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
