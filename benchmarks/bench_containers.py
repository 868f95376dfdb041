"""UCX between DejaVu containers (``dejavu bench containers``): prints a table, writes results/containers.json.

What the Compose deployment's data plane costs: throughput of DejaVuLib's UCX transport (tagged sends of
1-64 MiB, back to back, then a 1-byte acknowledgement) between two token-worker containers on one Docker
network with ``UCX_TLS=tcp`` (what infra/compose/compose.yaml runs), next to the same two processes inside
one container with UCX's default transports (shared memory), the ceiling a shared IPC namespace would give.

Needs a Docker engine and the image ``dejavu-token-worker:VERSION-cpu`` (``make images``). Each role runs
this file inside a container (``--peer``); every container and the network are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
SIZES_MIB = (1, 4, 16, 64)
DEADLINE_S = 60.0
ACK_KEY = 0xFFFF_FFFF


def peer(role: str, folder: Path, sizes_mib: list[int]) -> None:
    """One end: 'send' streams every size ``reps`` times and reports GB/s; 'recv' fetches and acknowledges."""
    import numpy as np

    from dejavulib.transport.ucx import UcxTransport

    other = "recv" if role == "send" else "send"
    transport = UcxTransport(role, progress="polling")
    (folder / f"{role}.tmp").write_bytes(transport.address)
    os.rename(folder / f"{role}.tmp", folder / f"{role}.addr")
    deadline = time.monotonic() + DEADLINE_S
    while not (folder / f"{other}.addr").exists():
        assert time.monotonic() < deadline, f"{other} never wrote its address"
        time.sleep(0.05)
    transport.connect(other, (folder / f"{other}.addr").read_bytes())
    ack = np.zeros(1, np.uint8)
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        reps = max(3, min(20, 256 // mib))
        buf = np.ones(nbytes, np.uint8)
        for attempt in ("warm", "timed"):
            count = 1 if attempt == "warm" else reps
            start = time.monotonic()
            for key in range(count):
                if role == "send":
                    transport.flush(other, key, buf, DEADLINE_S)
                else:
                    transport.fetch(other, key, buf, DEADLINE_S)
            if role == "send":
                transport.fetch(other, ACK_KEY, ack, DEADLINE_S)
            else:
                transport.flush(other, ACK_KEY, ack, DEADLINE_S)
            elapsed = time.monotonic() - start
        rows.append({"mib": mib, "reps": reps, "gbps": reps * nbytes / elapsed / 1e9})
    if role == "send":
        print(json.dumps({"transports": sorted(transport.selected[other]), "rows": rows}))
    transport.close()


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600, check=check)


def measure(image: str, two_containers: bool, sizes_mib: list[int]) -> dict:
    tag = f"dejavu-bench-{os.getpid()}-{'two' if two_containers else 'one'}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        folder.chmod(0o777)  # the containers run as uid 10001
        (folder / "bench.py").write_text(Path(__file__).read_text())
        sizes = ",".join(map(str, sizes_mib))
        common = ["--rm", "-v", f"{folder}:/bench", "--entrypoint", "python"]
        script = ["/bench/bench.py", "--sizes", sizes, "--dir", "/bench", "--peer"]
        try:
            if two_containers:
                docker("network", "create", tag)
                env = ["--network", tag, "-e", "UCX_TLS=tcp"]
                docker("run", "-d", "--name", f"{tag}-recv", *common, *env, image, *script, "recv")
                out = docker("run", "--name", f"{tag}-send", *common, *env, image, *script, "send").stdout
            else:
                both = f"python {' '.join(script)} recv & python {' '.join(script)} send; wait"
                out = docker(
                    "run", "--name", tag, "--rm", "-v", f"{folder}:/bench", "--entrypoint", "sh", image, "-c", both
                ).stdout
        finally:
            for name in (f"{tag}-recv", f"{tag}-send", tag):
                docker("rm", "-f", name, check=False)
            if two_containers:
                docker("network", "rm", tag, check=False)
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=["send", "recv"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="Message sizes in MiB.")
    parser.add_argument("--image", help="Worker image (default: dejavu-token-worker:VERSION-cpu).")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.peer:
        peer(args.peer, Path(args.dir), sizes)
        return 0
    version = tomllib.loads((REPO / "services/token_worker/pyproject.toml").read_text())["project"]["version"]
    image = args.image or f"dejavu-token-worker:{version}-cpu"
    result = {"image": image, "tcp_two_containers": measure(image, True, sizes)}
    result["default_one_container"] = measure(image, False, sizes)
    print(f"{'MiB':>5} {'TCP, 2 containers':>20} {'default, 1 container':>22}")
    for a, b in zip(result["tcp_two_containers"]["rows"], result["default_one_container"]["rows"], strict=True):
        print(f"{a['mib']:>5} {a['gbps']:>15.2f} GB/s {b['gbps']:>17.2f} GB/s")
    print(
        f"transports: {result['tcp_two_containers']['transports']} vs {result['default_one_container']['transports']}"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "containers.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
