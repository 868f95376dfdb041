"""Engine benchmark: prefill and per-token decode time of our stage engine vs transformers' forward
with its own DynamicCache, on SmolLM2-135M-Instruct, in each dtype asked for (the peer runs in the
same dtype), beside the memory-bandwidth bound of a decode step, all measured in one run.

Usage: dejavu bench engine [--prompt-len 256 1000] [--batches 1 16] [--dtypes float32 bfloat16]
                           [--steps 16] [--threads 0] [--no-hf] [--profile] [--no-preload]
                           [--device cpu|cuda] [--model FOLDER]
``--device cuda`` runs both engines on the GPU (the device-generic path: dense weights, torch's attention) and
takes the bound from a device-to-device copy; ``--model`` times another checkpoint folder (such as one made by
``benchmarks/random_checkpoint.py``) instead of the prepared default model.
The script re-runs itself with the libraries the launcher preloads into workers (tcmalloc, Intel
OpenMP, where installed; ``--no-preload``: as started). Rows of batch > 1 also time a prefill of
prompts of mixed lengths, ragged against padded. Prints a table and writes
benchmarks/results/engine.json. ``--profile`` adds, per row, where one decode step of ours spends its
time (GEMMs, attention, copies, other ops, and the rest: Python and
dispatch), from torch.profiler's per-op self times against the unprofiled step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.process import describe_runtime, worker_environment
from dejavu_engine.threads import configure_torch_threads
from dejavulib.kvcache import torch_dtype

os.environ["HF_HUB_OFFLINE"] = "1"
RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"
CPU = torch.device("cpu")

# torch.profiler op names -> the category a decode step's time is reported under (first match wins).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm", ("mm", "addmm", "bmm", "matmul", "linear", "mkldnn", "onednn", "baddbmm")),
    ("attention", ("attention", "sdpa", "flash")),
    ("copies", ("copy_", "cat", "clone", "contiguous", "to", "_to_copy", "index", "embedding", "stack")),
    ("allocation", ("empty", "zeros", "ones", "full", "arange", "empty_strided", "resize_")),
    (
        "views",
        (
            "view",
            "transpose",
            "slice",
            "select",
            "unsqueeze",
            "as_strided",
            "expand",
            "reshape",
            "split",
            "chunk",
            "narrow",
            "t",
            "alias",
            "detach",
            "squeeze",
            "unbind",
            "permute",
            "_unsafe_view",
        ),
    ),
)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU, whose ops return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memcpy_bandwidth(device: torch.device, size_bytes: int = 256 << 20, repeats: int = 8) -> float:
    """Best observed memory traffic of a contiguous copy on ``device``, bytes/s (read + write)."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
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

        self.model, self.ids = model, ids.to(model.device)
        self.cache = DynamicCache(config=model.config)
        self.next = self.ids[:, :1]

    @torch.inference_mode()
    def prefill(self) -> None:
        out = self.model(self.ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step(self) -> None:
        logits = self.model(self.next, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        self.next = logits[:, -1].argmax(-1, keepdim=True)


def timed(fn: Callable[[], object], device: torch.device = CPU) -> float:
    """Wall time of ``fn()``, the work it queued on ``device`` included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def bench_pair(
    runners: dict[str, OursRunner | HFRunner], steps: int, device: torch.device = CPU
) -> dict[str, dict[str, float]]:
    """Prefill each, then decode steps interleaved (ours, HF, ours, ...), so that all see the same
    machine load; medians and minima per token are reported."""
    prefill = {name: timed(runner.prefill, device) for name, runner in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            times[name].append(timed(runner.step, device))
    return {
        name: {
            "prefill_s": prefill[name],
            "decode_s_per_token": statistics.median(times[name]),
            "decode_s_per_token_min": min(times[name]),
        }
        for name in runners
    }


def category(op: str) -> str:
    """The report category of one profiler op name (``aten::addmm`` -> ``gemm``)."""
    name = op.removeprefix("aten::").removeprefix("mkldnn::").lower()
    for label, keys in CATEGORIES:
        if any(name == k or name.startswith(k + "_") or (len(k) > 3 and k in name) for k in keys):
            return label
    return "other_ops"


def profile_steps(runner: OursRunner, steps: int) -> dict[str, object]:
    """Where ``steps`` decode steps of ``runner`` spend their time, per step, in seconds.

    ``step_s`` is the median unprofiled step (``step_cpu_s`` its CPU time, all threads); op categories
    come from torch.profiler's self times (each op's own time, children excluded, so nothing counts
    twice); ``python_and_dispatch_s`` is
    the step time no op accounts for (interpreter, dispatcher, profiler-free estimate, clamped at 0).
    """
    from torch.profiler import ProfilerActivity, profile

    plain = statistics.median(timed(runner.step) for _ in range(steps))
    cpu = []  # CPU time of all this process's threads: steadier than wall time on a shared host
    for _ in range(steps):
        start = time.process_time()
        runner.step()
        cpu.append(time.process_time() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step()
    per_cat: dict[str, float] = {}
    top: list[tuple[str, float, int]] = []
    for event in prof.key_averages():
        self_s = event.self_cpu_time_total / 1e6 / steps
        per_cat[category(event.key)] = per_cat.get(category(event.key), 0.0) + self_s
        top.append((event.key, self_s, event.count // steps))
    ops_s = sum(per_cat.values())
    top.sort(key=lambda t: -t[1])
    return {
        "step_s": plain,
        "step_cpu_s": statistics.median(cpu),
        "ops_s": ops_s,
        "categories_s": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
        "python_and_dispatch_s": max(0.0, plain - ops_s),
        "ops_per_step": sum(count for _, _, count in top),
        "top_ops": [{"op": op, "self_s": s, "calls_per_step": c} for op, s, c in top[:12]],
    }


def decode_bytes(pipeline: Pipeline, batch: int, cached: int) -> int:
    """Bytes a decode step must read: every weight once plus the K and V of ``cached`` positions."""
    spec = pipeline.spec
    weights = sum(stage.param_bytes for stage in pipeline.stages)
    item = torch.empty((), dtype=torch_dtype(pipeline.stages[0].dtype)).element_size()
    kv = 2 * spec.num_layers * batch * spec.num_kv_heads * cached * spec.head_dim * item
    return weights + kv


def random_ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(100, vocab, (batch, length), generator=torch.Generator().manual_seed(batch * 7919 + length))


def print_table(result: dict[str, object]) -> None:
    print(
        f"{'dtype':>8} {'prompt':>6} {'batch':>5} | {'prefill ours':>12} {'HF':>8} | "
        f"{'decode ours':>11} {'HF':>8} {'bound':>7} | {'ours/HF':>7} {'ours/bound':>10}"
    )
    for r in result["rows"]:  # type: ignore[attr-defined]
        o, h = r["ours"], r.get("hf")
        hf_prefill = f"{h['prefill_s']:>7.2f}s" if h else f"{'-':>8}"
        hf_decode = f"{h['decode_s_per_token'] * 1e3:>6.1f}ms" if h else f"{'-':>8}"
        ratio = f"{o['decode_s_per_token'] / h['decode_s_per_token']:>7.2f}" if h else f"{'-':>7}"
        print(
            f"{r['dtype']:>8} {r['prompt_len']:>6} {r['batch']:>5} | {o['prefill_s']:>11.2f}s {hf_prefill} | "
            f"{o['decode_s_per_token'] * 1e3:>9.1f}ms {hf_decode} {r['decode_bound_s'] * 1e3:>5.1f}ms | "
            f"{ratio} {o['decode_s_per_token'] / r['decode_bound_s']:>10.2f}"
        )
        prof = r.get("profile")
        if prof:
            cats = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in prof["categories_s"].items())
            print(
                f"{'':>22}profile (ms/step): step {prof['step_s'] * 1e3:.1f} "
                f"(CPU {prof['step_cpu_s'] * 1e3:.1f}) = {cats}, "
                f"python+dispatch {prof['python_and_dispatch_s'] * 1e3:.1f} ({prof['ops_per_step']} ops)"
            )
        mixed = r.get("mixed_prefill")
        if mixed:
            print(
                f"{'':>22}prefill of mixed lengths {mixed['lengths'][0]}..{mixed['lengths'][-1]} "
                f"({mixed['tokens']} tokens): ragged {mixed['ragged_s']:.2f}s, padded {mixed['padded_s']:.2f}s "
                f"({mixed['padded_s'] / mixed['ragged_s']:.2f}x)"
            )


def bench_dtype(folder: Path, dtype: str, args: argparse.Namespace, bandwidth: float) -> list[dict[str, object]]:
    """All (prompt length, batch) rows of one dtype: ours and (unless ``--no-hf``) transformers."""
    device = torch.device(args.device)
    pipeline = Pipeline(
        folder, 1, args.device, dtype=dtype, pack_gemms=not args.no_pack, native_attention=not args.no_native
    )
    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype)).to(device).eval()

    def runners(ids: torch.Tensor, steps: int) -> dict[str, OursRunner | HFRunner]:
        found: dict[str, OursRunner | HFRunner] = {"ours": OursRunner(pipeline, ids, steps)}
        if hf_model is not None:
            found["hf"] = HFRunner(hf_model, ids)
        return found

    bench_pair(runners(random_ids(1, 32, pipeline.spec.vocab_size), 2), 2, device)  # first-call costs, all
    rows = []
    for prompt_len in args.prompt_len:
        for batch in args.batches:
            ids = random_ids(batch, prompt_len, pipeline.spec.vocab_size)
            found = runners(ids, args.steps * (4 if args.profile else 1))  # profiling runs 3 x steps more
            row: dict[str, object] = {"dtype": dtype, "batch": batch, "prompt_len": prompt_len}
            row |= bench_pair(found, args.steps, device)
            bytes_step = decode_bytes(pipeline, batch, prompt_len + args.steps // 2)
            row |= {"decode_bytes_per_step": bytes_step, "decode_bound_s": bytes_step / bandwidth}
            if args.profile:
                row["profile"] = profile_steps(found["ours"], args.steps)  # type: ignore[arg-type]
            if batch > 1:
                row["mixed_prefill"] = mixed_prefill(pipeline, prompt_len, batch, device)
            rows.append(row)
            print(f"done: {dtype} prompt {prompt_len} batch {batch}", flush=True)
    return rows


def mixed_prefill(
    pipeline: Pipeline, prompt_len: int, batch: int, device: torch.device = CPU, reps: int = 3
) -> dict[str, object]:
    """Prefill of ``batch`` prompts of mixed lengths (evenly spread from ``prompt_len // 8`` to
    ``prompt_len``, left padded to the longest): ragged (the prompts' tokens only, back to back) against
    padded (every row computed to the longest), medians of ``reps`` interleaved runs."""
    low = max(1, prompt_len // 8)
    lengths = [round(low + (prompt_len - low) * i / max(1, batch - 1)) for i in range(batch)]
    geometry = BatchGeometry.for_prompts(lengths)
    ids = random_ids(batch, prompt_len, pipeline.spec.vocab_size)
    caches = pipeline.allocate(batch, prompt_len)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for ragged in (True, False):
            for stage in pipeline.stages:
                stage.ragged_prefill = ragged
            times[ragged].append(timed(lambda: pipeline.forward(ids, caches, geometry), device))
    for stage in pipeline.stages:
        stage.ragged_prefill = True
    ragged_s, padded_s = statistics.median(times[True]), statistics.median(times[False])
    return {"lengths": lengths, "tokens": sum(lengths), "ragged_s": ragged_s, "padded_s": padded_s}


def run_as_worker() -> None:
    """Replace this process by itself with the environment the launcher gives a worker (returns if
    that changes nothing, or if this process already is the re-run one)."""
    extra = worker_environment(Settings().engine, os.environ)
    if extra and os.environ.get("DEJAVU_BENCH_AS_WORKER") != "1":
        env = {**os.environ, **extra, "DEJAVU_BENCH_AS_WORKER": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[256, 1000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers (ours and the bound only)")
    parser.add_argument("--profile", action="store_true", help="profile our decode step in every row")
    parser.add_argument("--no-preload", action="store_true", help="run without the workers' preloaded libraries")
    parser.add_argument(
        "--no-pack", action="store_true", help="dense weights, torch's default GEMM (no oneDNN packing)"
    )
    parser.add_argument(
        "--no-native", action="store_true", help="torch's attention per microbatch (not the native decode kernel)"
    )
    parser.add_argument("--device", default="cpu", help="where both engines run: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: the prepared default model)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cpu" and args.profile:
        parser.error("--profile breaks a step into CPU ops: CPU only")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    if not args.no_preload:
        run_as_worker()

    threads = configure_torch_threads(args.threads)
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    folder = args.model or ensure_default_model(Settings())
    bandwidth = memcpy_bandwidth(device)
    rows = [row for dtype in args.dtypes for row in bench_dtype(folder, dtype, args, bandwidth)]
    result = {
        "model": folder.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": threads,
        "decode_steps": args.steps,
        "memcpy_bytes_per_s": bandwidth,
        "host": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "runtime": describe_runtime(),
        "packed_gemms": not args.no_pack,
        "native_attention": not args.no_native,
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "rows": rows,
    }
    print(
        f"device {result['device']}, memcpy traffic {bandwidth / 1e9:.1f} GB/s, {threads} torch threads, "
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
        f"runtime: {result['runtime']}, packed GEMMs {result['packed_gemms']}"
    )
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
