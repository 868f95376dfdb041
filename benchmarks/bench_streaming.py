"""DejaVuLib streaming benchmarks (``dejavu bench streaming``): prints a table, writes results/streaming.json.

SmolLM2-135M's real cache shape: 30 layers, 3 KV heads, head_dim 64, float32, batch 8, prompt 1000.

1. One decode step's KV update (1,440 chunks of 256 B): buffered copy vs one copy per chunk, into a host
   buffer (torch copies) and to another process over UCX (the transport's keyed flush/fetch).
2. Prompt KV to another process: stream after prefill vs layer by layer during prefill; time from
   prefill start until the receiver holds the whole cache. Prefill is a synthetic per-layer matmul
   workload (``--prefill-s`` in total; the real model takes ~5 s on this machine).
3. Decode with each step's KV update streamed to another process vs no streaming (synthetic ~40 ms steps).
4. UCX throughput between two processes, 1-256 MiB, next to memcpy bandwidth measured in the same run.

Sections 2 and 3 run the path serving runs: a prompt worker's placement (``plan_pieces``) streamed by
``LayerStreamer`` / a token stage's ``Streamer.submit_region`` (packing on the streaming thread), received
with ``stream_in``. Section 1's per-chunk baseline (``per_chunk.py``) is what the buffered copy replaces; serving
never uses it.

The receiving process is this script run with ``--peer``; it is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.*

from benchmarks.per_chunk import contiguous_runs, copy_buffered, copy_per_chunk, scatter
from dejavulib.endpoint import Endpoint
from dejavulib.header import Channel, Header
from dejavulib.kvcache import KVCache, StagingBuffer
from dejavulib.layout import KVLayout
from dejavulib.streamer import Streamer
from dejavulib.streaming import LayerStreamer, stream_in
from dejavulib.topology import Piece, plan_pieces
from dejavulib.transport.ucx import UcxTransport

LAYERS, HEADS, HEAD_DIM, BATCH, PROMPT = 30, 3, 64, 8, 1000
SECRET = "bench-secret"
DEADLINE = 60.0
RESULTS = Path(__file__).resolve().parent / "results" / "streaming.json"


def layout(max_len: int = PROMPT + 64) -> KVLayout:
    return KVLayout(LAYERS, BATCH, HEADS, max_len, HEAD_DIM)


# ---- the peer process ---------------------------------------------------------------------------


def serve_peer(address_file: str, progress: str) -> None:
    """Receive what the driver sends; reply on CONTROL with the monotonic time the data was complete."""
    torch.set_num_threads(1)
    transport = UcxTransport("peer", progress=progress)
    endpoint = Endpoint(transport, SECRET)
    Path(address_file + ".tmp").write_text(transport.address.hex())
    os.rename(address_file + ".tmp", address_file)
    transport.connect("driver", bytes.fromhex(sys.stdin.readline()))
    scratch = np.empty(0, np.uint8)
    cache = KVCache.allocate(layout())
    while True:
        cmd = json.loads(endpoint.recv(Channel.CONTROL, 600).payload.tobytes())
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "recv_chunks":  # into one reused buffer, back to back
            need = max(n for _, n in cmd["specs"])
            if scratch.nbytes < need:
                scratch = np.empty(need, np.uint8)
            for key, nbytes in cmd["specs"]:
                transport.fetch("driver", key, scratch[:nbytes], DEADLINE)
        elif cmd["op"] == "recv_prompt":  # what a token stage does with prompt KV: one message per layer
            for _ in range(LAYERS):
                stream_in(cache, endpoint.recv(Channel.KV_PROMPT, DEADLINE))
        elif cmd["op"] == "recv_steps":  # ... and with replicated steps
            for _ in range(cmd["count"]):
                stream_in(cache, endpoint.recv(Channel.KV_REPLICA, DEADLINE))
        done = time.monotonic()
        endpoint.send("driver", Header(Channel.CONTROL), json.dumps({"t": done}).encode(), DEADLINE).wait()
    endpoint.close()


class Peer:
    """The peer process and this process's endpoint to it."""

    def __init__(self, progress: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="dejavu-bench-")
        address_file = Path(self.dir) / "address"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--peer", str(address_file), "--progress", progress],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not address_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("benchmark peer did not start")
            time.sleep(0.02)
        self.transport = UcxTransport("driver", progress=progress)
        self.endpoint = Endpoint(self.transport, SECRET)
        self.transport.connect("peer", bytes.fromhex(address_file.read_text()))
        self.proc.stdin.write(self.transport.address.hex() + "\n")
        self.proc.stdin.flush()

    def command(self, **cmd: object) -> None:
        self.endpoint.send("peer", Header(Channel.CONTROL), json.dumps(cmd).encode(), DEADLINE).wait()

    def done_at(self) -> float:
        """The peer's monotonic clock when it finished (CLOCK_MONOTONIC is shared by processes of one host)."""
        return json.loads(self.endpoint.recv(Channel.CONTROL, DEADLINE).payload.tobytes())["t"]

    def stop(self) -> None:
        try:
            self.command(op="exit")
            self.proc.wait(10)
        except Exception:
            pass
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.endpoint.close()


# ---- workloads ----------------------------------------------------------------------------------


class Compute:
    """A real matmul workload calibrated to take about ``seconds`` per call."""

    def __init__(self, seconds: float, n: int = 384) -> None:
        self.a, self.b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(5):  # warm up thread pools and caches before timing
            torch.mm(self.a, self.b)
        per_mm = median_time(lambda: torch.mm(self.a, self.b), 30)
        self.reps = max(1, round(seconds / per_mm))

    def __call__(self) -> torch.Tensor:
        out = self.a
        for _ in range(self.reps):
            out = torch.mm(self.a, self.b)
        return out


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_buffered(peer: Peer, reps: int) -> dict:
    lay = layout()
    cache = KVCache.allocate(lay)
    cache.k.normal_()
    region = lay.region(positions=(PROMPT, PROMPT + 1))
    runs = list(contiguous_runs(lay, region))
    staging = StagingBuffer()
    sink = torch.empty(region.nbytes(lay), dtype=torch.uint8).view(cache.k.dtype)
    out = {"chunks": len(runs), "bytes": region.nbytes(lay)}
    out["host_unbuffered_s"] = median_time(lambda: copy_per_chunk(cache, region, sink), reps)
    out["host_buffered_s"] = median_time(lambda: copy_buffered(cache, region, staging, sink), reps)

    def over_ucx(buffered: bool) -> None:
        specs = [(0, region.nbytes(lay))] if buffered else [(i, r.count * lay.itemsize) for i, r in enumerate(runs)]
        peer.command(op="recv_chunks", specs=specs)
        scatter(peer.transport, "peer", 0, cache, region, DEADLINE, staging if buffered else None)
        peer.done_at()

    out["ucx_unbuffered_s"] = median_time(lambda: over_ucx(False), reps)
    out["ucx_buffered_s"] = median_time(lambda: over_ucx(True), reps)
    out["host_speedup"] = out["host_unbuffered_s"] / out["host_buffered_s"]
    out["ucx_speedup"] = out["ucx_unbuffered_s"] / out["ucx_buffered_s"]
    return out


def bench_prompt(peer: Peer, prefill_s: float, reps: int) -> dict:
    lay = layout()
    cache = KVCache.allocate(lay)
    compute = Compute(prefill_s / LAYERS)
    # A prompt worker's placement of one batch into one token stage (as serving plans it).
    transfers = plan_pieces([Piece(0, (0, BATCH), PROMPT, PROMPT)], PROMPT, (0, LAYERS), [(0, LAYERS)])
    streamer = Streamer(peer.endpoint, max_inflight_bytes=256 << 20)

    def layer(i: int) -> None:
        x = compute()
        cache.k[i, :, :, :PROMPT].copy_(x.reshape(-1)[0].expand(BATCH, HEADS, PROMPT, HEAD_DIM))
        cache.v[i, :, :, :PROMPT].copy_(cache.k[i, :, :, :PROMPT])

    def after_prefill() -> float:  # the same per-layer messages, sent only once prefill has finished
        peer.command(op="recv_prompt")
        t0 = time.monotonic()
        for i in range(LAYERS):
            layer(i)
        hook = LayerStreamer(streamer, cache, transfers, {0: "peer"}, DEADLINE)
        for i in range(LAYERS):
            hook.on_layer_done(i)
        hook.wait()
        return peer.done_at() - t0

    def layer_by_layer() -> float:
        peer.command(op="recv_prompt")
        t0 = time.monotonic()
        hook = LayerStreamer(streamer, cache, transfers, {0: "peer"}, DEADLINE)
        for i in range(LAYERS):
            layer(i)
            hook.on_layer_done(i)
        hook.wait()
        return peer.done_at() - t0

    t0 = time.monotonic()
    for i in range(LAYERS):
        layer(i)
    prefill_only = time.monotonic() - t0
    after = statistics.median(after_prefill() for _ in range(reps))
    lbl = statistics.median(layer_by_layer() for _ in range(reps))
    streamer.close()
    return {
        "cache_bytes": 2 * LAYERS * BATCH * HEADS * PROMPT * HEAD_DIM * 4,
        "prefill_only_s": prefill_only,
        "after_prefill_s": after,
        "layer_by_layer_s": lbl,
        "after_prefill_overhead_s": after - prefill_only,
        "layer_by_layer_overhead_s": lbl - prefill_only,
    }


def bench_decode(peer: Peer, step_s: float, steps: int, reps: int) -> dict:
    lay = layout()
    cache = KVCache.allocate(lay)
    compute = Compute(step_s)
    streamer = Streamer(peer.endpoint, max_inflight_bytes=64 << 20)

    cpu = {False: [], True: []}

    def run(stream: bool) -> float:
        if stream:
            peer.command(op="recv_steps", count=steps)
        t0, c0 = time.monotonic(), time.process_time()
        for j in range(steps):
            x = compute()
            pos = PROMPT + (j % 64)
            cache.k[:, :, :, pos].fill_(float(x[0, 0]))
            cache.v[:, :, :, pos].fill_(float(x[0, 1]))
            if stream:  # step j's update leaves on the streaming thread while step j+1 computes
                region = lay.region(positions=(pos, pos + 1))
                streamer.submit_region("peer", Header(Channel.KV_REPLICA, step=j), cache, region, DEADLINE)
        compute_done = time.monotonic() - t0
        if stream:
            streamer.drain(DEADLINE)
            peer.done_at()
        cpu[stream].append(time.process_time() - c0)
        return compute_done

    base, streamed = [], []
    for _ in range(reps):  # interleaved, so machine noise hits both alike
        base.append(run(False))
        streamed.append(run(True))
    streamer.close()
    b, s = statistics.median(base), statistics.median(streamed)
    extra_cpu = (statistics.median(cpu[True]) - statistics.median(cpu[False])) / steps
    return {"steps": steps, "step_s": b / steps, "no_streaming_s": b, "streaming_s": s,
            "slowdown_percent": 100 * (s - b) / b, "sender_cpu_per_step_s": extra_cpu,
            "min_slowdown_percent": 100 * (min(streamed) - min(base)) / min(base)}  # fmt: skip


def bench_throughput(peer: Peer, sizes_mib: list[int]) -> list[dict]:
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        reps = max(2, min(20, 512 // mib))
        peer.command(op="recv_chunks", specs=[(i, nbytes) for i in range(1)])  # warm the peer's buffer
        peer.transport.flush("peer", 0, src, DEADLINE)
        peer.done_at()
        peer.command(op="recv_chunks", specs=[(i, nbytes) for i in range(reps)])
        t0 = time.monotonic()
        for i in range(reps):
            peer.transport.flush("peer", i, src, DEADLINE)
        elapsed = peer.done_at() - t0
        dst_t, src_t = torch.empty(nbytes, dtype=torch.uint8), torch.from_numpy(src)
        memcpy = median_time(lambda d=dst_t, s=src_t: d.copy_(s), reps)
        rows.append({"mib": mib, "ucx_gbps": reps * nbytes / elapsed / 1e9, "memcpy_gbps": nbytes / memcpy / 1e9})
    return rows


def print_table(r: dict) -> None:
    print(f"\nDejaVuLib streaming ({r['ucx_progress']} progress; UCX transports {r['ucx_transports']};"
          f" load average {r['load_average_before']:.1f} on {os.cpu_count()} cores)")  # fmt: skip
    if "buffered_copies" in r:
        print_buffered(r["buffered_copies"])
    if "prompt_streaming" in r:
        print_prompt(r["prompt_streaming"])
    if "decode_streaming" in r:
        print_decode(r["decode_streaming"])
    if "throughput" in r:
        print("4. size      UCX GB/s   memcpy GB/s")
        for row in r["throughput"]:
            print(f"   {row['mib']:4d} MiB  {row['ucx_gbps']:8.2f}   {row['memcpy_gbps']:8.2f}")


def print_buffered(b: dict) -> None:
    print(f"1. one decode step's update ({b['chunks']} chunks, {b['bytes']} B):")
    print(f"   host  per-chunk {b['host_unbuffered_s'] * 1e3:8.3f} ms   buffered {b['host_buffered_s'] * 1e3:7.3f} ms"
          f"   speedup {b['host_speedup']:6.1f}x")  # fmt: skip
    print(f"   UCX   per-chunk {b['ucx_unbuffered_s'] * 1e3:8.3f} ms   buffered {b['ucx_buffered_s'] * 1e3:7.3f} ms"
          f"   speedup {b['ucx_speedup']:6.1f}x")  # fmt: skip


def print_prompt(p: dict) -> None:
    print(f"2. prompt KV ({p['cache_bytes'] / 2**20:.0f} MiB): prefill alone {p['prefill_only_s']:.3f} s; until the"
          f" receiver holds it: after prefill {p['after_prefill_s']:.3f} s (+{p['after_prefill_overhead_s']:.3f}),"
          f" layer by layer {p['layer_by_layer_s']:.3f} s (+{p['layer_by_layer_overhead_s']:.3f})")  # fmt: skip


def print_decode(d: dict) -> None:
    print(f"3. decode, {d['steps']} steps of {d['step_s'] * 1e3:.1f} ms: no streaming {d['no_streaming_s']:.3f} s,"
          f" streaming each step {d['streaming_s']:.3f} s: slowdown {d['slowdown_percent']:+.2f}% (medians),"
          f" {d['min_slowdown_percent']:+.2f}% (best runs); streaming costs the sender"
          f" {d['sender_cpu_per_step_s'] * 1e3:.2f} ms CPU per step")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--progress", default="polling", choices=["polling", "thread"])
    parser.add_argument("--prefill-s", type=float, default=1.5, help="Synthetic prefill time (all 30 layers).")
    parser.add_argument("--step-ms", type=float, default=40.0, help="Synthetic decode step time.")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the driver (compute workload).")
    parser.add_argument("--sections", default="buffered_copies,prompt_streaming,decode_streaming,throughput")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.peer:
        serve_peer(args.peer, args.progress)
        return 0
    torch.set_num_threads(args.threads)
    peer = Peer(args.progress)
    try:
        results = {
            "ucx_progress": args.progress,
            "ucx_transports": sorted(peer.transport.selected["peer"]),
            "torch_threads": args.threads,
            "load_average_before": os.getloadavg()[0],
        }
        sections = {
            "buffered_copies": lambda: bench_buffered(peer, reps=max(5, args.reps)),
            "prompt_streaming": lambda: bench_prompt(peer, args.prefill_s, args.reps),
            "decode_streaming": lambda: bench_decode(peer, args.step_ms / 1e3, args.steps, args.reps),
            "throughput": lambda: bench_throughput(peer, [int(s) for s in args.sizes_mib.split(",")]),
        }
        for name in args.sections.split(","):
            results[name] = sections[name]()
    finally:
        peer.stop()
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
