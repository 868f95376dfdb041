"""Engine benchmark: prefill and per-token decode time of our stage engine vs transformers' forward
with its own DynamicCache, on SmolLM2-135M-Instruct (float32), plus the memory-bandwidth bound of a
decode step, all measured in one run on this machine.

Usage: dejavu bench engine [--prompt-len 1000] [--batches 1 8] [--steps 16] [--threads 0]
Prints a table and writes benchmarks/results/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.threads import configure_torch_threads

os.environ["HF_HUB_OFFLINE"] = "1"
RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"


def memcpy_bandwidth(size_bytes: int = 256 << 20, repeats: int = 8) -> float:
    """Best observed memory traffic of a contiguous copy, bytes/s (read + write)."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * size_bytes / best


class OursRunner:
    """Our engine on one microbatch: prefill, then one greedy decode step per call."""

    def __init__(self, pipeline: Pipeline, ids: torch.Tensor, steps: int) -> None:
        batch, prompt = ids.shape
        self.pipeline, self.ids = pipeline, ids
        self.caches = pipeline.allocate(batch, prompt + steps + 1)
        self.geometry = BatchGeometry((0,) * batch, prompt)
        self.next = ids[:, :1]

    def prefill(self) -> None:
        self.next = self.pipeline.forward(self.ids, self.caches, self.geometry)[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        self.geometry = self.geometry.advance()
        logits = self.pipeline.forward(self.next, self.caches, self.geometry)
        self.next = logits[:, -1].argmax(-1, keepdim=True)


class HFRunner:
    """transformers' own forward with its DynamicCache on the same microbatch."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.model, self.ids = model, ids
        self.cache = DynamicCache(config=model.config)
        self.next = ids[:, :1]

    @torch.inference_mode()
    def prefill(self) -> None:
        out = self.model(self.ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step(self) -> None:
        logits = self.model(self.next, past_key_values=self.cache, use_cache=True).logits
        self.next = logits[:, -1].argmax(-1, keepdim=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_pair(ours: OursRunner, hf: HFRunner, steps: int) -> dict[str, dict[str, float]]:
    """Prefill each, then decode steps interleaved (ours, HF, ours, ...), so that both see the same
    machine load; medians and minima per token are reported."""
    prefill = {"ours": timed(ours.prefill), "hf": timed(hf.prefill)}
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(steps):
        times["ours"].append(timed(ours.step))
        times["hf"].append(timed(hf.step))
    return {
        name: {
            "prefill_s": prefill[name],
            "decode_s_per_token": statistics.median(times[name]),
            "decode_s_per_token_min": min(times[name]),
        }
        for name in ("ours", "hf")
    }


def decode_bytes(pipeline: Pipeline, batch: int, cached: int) -> int:
    """Bytes a decode step must read: every weight once plus the K and V of ``cached`` positions."""
    spec = pipeline.spec
    weights = sum(stage.param_bytes for stage in pipeline.stages)
    kv = 2 * spec.num_layers * batch * spec.num_kv_heads * cached * spec.head_dim * 4
    return weights + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    threads = configure_torch_threads(args.threads)
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    folder = ensure_default_model(Settings())
    from transformers import AutoModelForCausalLM

    pipeline = Pipeline(folder, 1)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    bandwidth = memcpy_bandwidth()
    warm_ids = torch.randint(100, pipeline.spec.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    bench_pair(OursRunner(pipeline, warm_ids, 2), HFRunner(hf_model, warm_ids), 2)  # first-call costs, both
    rows = []
    for batch in args.batches:
        ids = torch.randint(
            100, pipeline.spec.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch)
        )
        pair = bench_pair(OursRunner(pipeline, ids, args.steps), HFRunner(hf_model, ids), args.steps)
        ours, hf = pair["ours"], pair["hf"]
        bytes_step = decode_bytes(pipeline, batch, args.prompt_len + args.steps // 2)
        rows.append(
            {
                "batch": batch,
                "prompt_len": args.prompt_len,
                "ours": ours,
                "hf": hf,
                "decode_bytes_per_step": bytes_step,
                "decode_bound_s": bytes_step / bandwidth,
            }
        )
    result = {
        "model": folder.name,
        "dtype": "float32",
        "threads": threads,
        "decode_steps": args.steps,
        "memcpy_bytes_per_s": bandwidth,
        "host": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "rows": rows,
    }
    print(
        f"memcpy traffic {bandwidth / 1e9:.1f} GB/s, {threads} torch threads, prompt {args.prompt_len}, "
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"{'batch':>5} | {'prefill ours':>12} {'prefill HF':>10} | {'decode/token ours':>17} "
        f"{'HF':>8} {'bound':>8} | {'ours/HF':>7} | {'min ours':>8} {'min HF':>8}"
    )
    for r in rows:
        o, h = r["ours"], r["hf"]
        print(
            f"{r['batch']:>5} | {o['prefill_s']:>11.2f}s {h['prefill_s']:>9.2f}s | "
            f"{o['decode_s_per_token'] * 1e3:>15.1f}ms {h['decode_s_per_token'] * 1e3:>6.1f}ms "
            f"{r['decode_bound_s'] * 1e3:>6.1f}ms | {o['decode_s_per_token'] / h['decode_s_per_token']:>7.2f} | "
            f"{o['decode_s_per_token_min'] * 1e3:>6.1f}ms {h['decode_s_per_token_min'] * 1e3:>6.1f}ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
