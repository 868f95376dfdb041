"""Microbatch swapping on one token stage: per-step swap-in / swap-out / compute, and B vs 2B throughput.

Run with ``dejavu bench swapping [--batches 2 8] [--lengths 128 1024] [--depth 4] [--rounds 6]``.

The stage is a middle stage of a ``depth``-deep token pipeline of the default model (SmolLM2-135M):
layers ``[L/D, 2L/D)``, fed random hidden states, with ``depth`` microbatches in flight round-robin,
as a pipeline stage sees them. Caches are filled with constant values up to ``length`` positions (a
decode step's cost does not depend on the values). For each (B, length):

* without swapping, ``depth`` microbatches of B rows stay resident (the device KV budget is exactly
  what they need, plus one position per row of 2B rows for the swap staging buffer);
* with swapping, ``depth`` microbatches of 2B rows under the same budget (checked with
  ``dejavu_common.kv_budget``), through :class:`dejavu_worker.swap.SwapManager`.

Both runs are measured in the same process, back to back. The paper's appendix inequality for
swapping to pay off is evaluated with the measured compute times and the measured bandwidth between
the host and device pools. On a CPU-only host "device" and "host" are the same DRAM: the transfers
are memory copies competing with compute for the same cores and bandwidth, and nothing is saved.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dejavu_common.kv_budget import KVBudget
from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_worker.swap import SwapManager
from dejavulib.kvcache import KVCache

RESULTS = Path(__file__).resolve().parent / "results" / "swapping.json"


@dataclass(frozen=True)
class RunResult:
    """One round-robin run of ``depth`` microbatches of ``batch`` rows for ``rounds`` steps each."""

    batch: int
    swapping: bool
    steps: int
    wall_s: float
    compute_s: float  # median per step
    swap_in_s: float  # median per swap-in on the background thread (0 without swapping)
    swap_out_s: float  # median per commit (buffered copy-back)
    acquire_wait_s: float  # mean per step: compute time lost waiting for a swap-in
    device_kv_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.batch / self.wall_s


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 8], help="Microbatch sizes B (swapped: 2B).")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024], help="Context lengths of the steps.")
    parser.add_argument("--depth", type=int, default=4, help="Token pipeline depth D (microbatches in flight).")
    parser.add_argument("--rounds", type=int, default=6, help="Measured decode steps per microbatch.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each mode; the median one is reported.")
    parser.add_argument("--gen-tokens", type=int, default=128, help="N of the appendix inequality.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of compute (1: the swap thread gets the other core).",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def middle_stage(depth: int) -> Stage:
    folder = ensure_default_model(Settings())
    probe = Stage(folder, (0, 1))
    layers = probe.spec.num_layers
    return Stage(folder, (layers // depth, 2 * layers // depth))


def touch_cache(cache: KVCache, length: int) -> None:
    """Write positions ``[0, length)`` (a decode step's cost does not depend on the values; pages must be mapped)."""
    cache.k[:, :, :, :length].fill_(0.5)
    cache.v[:, :, :, :length].fill_(-0.5)


def decode(stage: Stage, cache: KVCache, geometry: BatchGeometry) -> float:
    """One decode step; returns its compute time."""
    hidden = torch.randn(geometry.batch, 1, stage.spec.hidden_size)
    start = time.perf_counter()
    stage.decode(StageIO(hidden=hidden), cache, geometry)
    return time.perf_counter() - start


def run_resident(stage: Stage, batch: int, length: int, depth: int, rounds: int) -> RunResult:
    """Round-robin decode with every microbatch's cache resident; round 0 is an unmeasured warm-up."""
    layout = stage.kv_layout(batch, length + rounds + 1)
    caches = [KVCache.allocate(layout) for _ in range(depth)]
    for cache in caches:
        touch_cache(cache, length)
    computes: list[float] = []
    for step in range(rounds + 1):
        if step == 1:
            start = time.perf_counter()
        for cache in caches:
            elapsed = decode(stage, cache, BatchGeometry((0,) * batch, length + step))
            computes += [elapsed] if step else []
    wall = time.perf_counter() - start
    return RunResult(
        batch, False, len(computes), wall, statistics.median(computes), 0.0, 0.0, 0.0, depth * layout.bytes_total
    )


def run_swapped(stage: Stage, batch: int, length: int, depth: int, rounds: int) -> RunResult:
    """The token worker's step protocol, acquire -> prefetch(next) -> decode -> commit; round 0 warms up."""
    layout = stage.kv_layout(batch, length + rounds + 1)
    with SwapManager(layout, depth, "cpu") as swap:
        for mb in range(depth):
            touch_cache(swap.add(mb, layout), length)
        swap.prefetch(0, length - 1)
        computes, commits = [], []
        for step in range(rounds + 1):
            if step == 1:
                start, warm = time.perf_counter(), swap.stats()
            for mb in range(depth):
                geometry = BatchGeometry((0,) * batch, length + step)
                cache = swap.acquire(mb)
                nxt, nxt_step = (mb + 1) % depth, step + (mb + 1) // depth
                if nxt_step <= rounds:
                    swap.prefetch(nxt, length + nxt_step - 1)
                elapsed = decode(stage, cache, geometry)
                t0 = time.perf_counter()
                swap.commit(mb, (geometry.cur_len - 1, geometry.cur_len))
                if step:
                    computes.append(elapsed)
                    commits.append(time.perf_counter() - t0)
        wall = time.perf_counter() - start
        stats = swap.stats()
        swap_ins = stats.swap_ins - warm.swap_ins
        return RunResult(
            batch,
            True,
            len(computes),
            wall,
            statistics.median(computes),
            (stats.swap_in_s - warm.swap_in_s) / swap_ins,
            statistics.median(commits),
            (stats.acquire_wait_s - warm.acquire_wait_s) / len(computes),
            swap.device_bytes,
        )


def isolated_swap_in_bytes_per_s(stage: Stage, batch: int, length: int, repeats: int = 3) -> float:
    """Bandwidth of the swap-in copy alone (host pool -> device pool, the filled prefix), nothing else running."""
    layout = stage.kv_layout(batch, length + 1)
    host, device = KVCache.allocate(layout), KVCache.allocate(layout)
    touch_cache(host, length)
    touch_cache(device, length)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        device.k[:, :, :, :length].copy_(host.k[:, :, :, :length])
        device.v[:, :, :, :length].copy_(host.v[:, :, :, :length])
        times.append(time.perf_counter() - start)
    return batch * length * layout.bytes_per_token / statistics.median(times)


def appendix_inequality(
    t_b: float, t_2b: float, batch2: int, bytes_per_token: int, bandwidth: float, prompt: int, tokens: int
) -> dict[str, float | bool]:
    """The paper's condition ``2 N t >= sum_{i=p}^{p+N} max(t, i B C / bw)`` with measured numbers.

    The left side is two microbatches of B generating N tokens each without swapping (``t = t_B``); the
    right side one microbatch of 2B (``t = t_2B``) whose step ``i`` waits for the swap-in of ``i``
    positions. The paper assumes ``t_B == t_2B`` (true on GPUs); on a CPU they differ, so both are used.
    """
    rhs = sum(max(t_2b, i * batch2 * bytes_per_token / bandwidth) for i in range(prompt, prompt + tokens))
    lhs = 2 * tokens * t_b
    return {"lhs_s": lhs, "rhs_s": rhs, "pays_off": lhs >= rhs}


def same_budget(stage: Stage, batch: int, length: int, depth: int, rounds: int) -> tuple[int, int, int]:
    """A device KV budget that admits B without swapping and 2B with it; returns (budget, B, 2B admitted)."""
    bpt, max_len = stage.kv_layout(1, 1).bytes_per_token, length + rounds + 1
    budget = depth * batch * max_len * bpt + 2 * batch * bpt
    plain = KVBudget(budget, bpt, max_len, depth, swapping=False).max_batch()
    swapped = KVBudget(budget, bpt, max_len, depth, swapping=True).max_batch()
    return budget, plain, swapped


def median_run(runs: list[RunResult]) -> RunResult:
    """The run of median throughput."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def measure(stage: Stage, batch: int, length: int, args: argparse.Namespace) -> dict:
    budget, plain_batch, swapped_batch = same_budget(stage, batch, length, args.depth, args.rounds)
    resident_runs, swapped_runs = [], []
    for _ in range(args.repeats):  # alternated, so load from other processes hits both alike
        resident_runs.append(run_resident(stage, plain_batch, length, args.depth, args.rounds))
        swapped_runs.append(run_swapped(stage, swapped_batch, length, args.depth, args.rounds))
    resident, swapped = median_run(resident_runs), median_run(swapped_runs)
    bandwidth = isolated_swap_in_bytes_per_s(stage, swapped_batch, length)
    bpt = stage.kv_layout(1, 1).bytes_per_token
    isolated_swap_in = swapped_batch * length * bpt / bandwidth
    assert resident.device_kv_bytes <= budget and swapped.device_kv_bytes <= budget
    return {
        "batch": batch,
        "length": length,
        "device_kv_budget_bytes": budget,
        "admitted": {"without_swapping": plain_batch, "with_swapping": swapped_batch},
        "without_swapping": {**asdict(resident), "tokens_per_s": resident.tokens_per_s},
        "with_swapping": {**asdict(swapped), "tokens_per_s": swapped.tokens_per_s},
        "isolated_swap_in_s": isolated_swap_in,
        "host_to_device_bytes_per_s": bandwidth,
        "swap_in_hidden": isolated_swap_in <= swapped.compute_s,
        "exposed_wait_fraction": swapped.acquire_wait_s / swapped.compute_s,
        "speedup": swapped.tokens_per_s / resident.tokens_per_s,
        "appendix": appendix_inequality(
            resident.compute_s, swapped.compute_s, swapped_batch, bpt, bandwidth, length, args.gen_tokens
        ),
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'B':>3} {'len':>5} | {'2B':>3} {'swap-in ms':>10} {'(alone)':>8} {'swap-out ms':>11} "
        f"{'compute ms':>10} {'wait %':>6} {'hidden':>6} | {'tok/s B':>8} {'tok/s 2B+swap':>13} {'x':>5} "
        f"| {'GB/s':>5} {'appendix':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        s, p = r["with_swapping"], r["without_swapping"]
        print(
            f"{r['batch']:>3} {r['length']:>5} | {s['batch']:>3} {s['swap_in_s'] * 1e3:>10.2f} "
            f"{r['isolated_swap_in_s'] * 1e3:>8.2f} {s['swap_out_s'] * 1e3:>11.3f} {s['compute_s'] * 1e3:>10.2f} "
            f"{r['exposed_wait_fraction'] * 100:>6.1f} {'yes' if r['swap_in_hidden'] else 'no':>6} | "
            f"{p['tokens_per_s']:>8.1f} {s['tokens_per_s']:>13.1f} {r['speedup']:>5.2f} | "
            f"{r['host_to_device_bytes_per_s'] / 1e9:>5.1f} {'pays' if r['appendix']['pays_off'] else 'no':>8}"
        )


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    stage = middle_stage(args.depth)
    print(
        f"stage layers {stage.layers} of SmolLM2-135M, depth {args.depth}, {args.rounds} steps per microbatch, "
        f"torch threads {args.threads}, KV {stage.kv_layout(1, 1).bytes_per_token} B per token"
    )
    print("CPU host: 'device' and 'host' pools are the same DRAM; swap transfers are memory copies.")
    rows = [measure(stage, b, n, args) for n in args.lengths for b in args.batches]
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "swapping",
        "model": "SmolLM2-135M-Instruct",
        "stage_layers": list(stage.layers),
        "depth": args.depth,
        "rounds": args.rounds,
        "gen_tokens": args.gen_tokens,
        "torch_threads": args.threads,
        "device": "cpu",
        "host": platform.processor() or platform.machine(),
        "note": "CPU-only: device and host pools are separate tensors in the same memory; nothing is saved, "
        "transfers are DRAM copies sharing the cores with compute.",
        "configs": rows,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
