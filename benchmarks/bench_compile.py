"""Does ``torch.compile`` pay on our decode step? (issue 13: keep it only behind a setting if it does.)

Two measurements, in one process with the workers' environment (preloaded allocator and OpenMP):

1. **The whole step** of our engine on the default model, one stage, prompt ``--prompt-len``: as served
   (oneDNN-packed weights, the native attention kernel) and with dense weights, eager and with the family's
   layer function compiled (``torch.compile(dynamic=True)``). Packed oneDNN weights are opaque tensors, which
   Inductor cannot read (it fails with "Cannot access storage of OpaqueTensorImpl"), so the compiled step runs
   on dense weights; the native kernel is not a torch op, so the graph breaks at attention in every layer.
2. **An upper bound without those limits**: the 30 MLP blocks of the model's shape (RMSNorm, fused
   gate/up, SiLU-and-multiply, down, residual), as our packed eager code runs them, against
   ``torch.compile`` with Inductor's *freezing* (weights as module constants, which Inductor packs for
   oneDNN itself and fuses the elementwise ops around) — the most compilation could give these layers.

Compile time counts: it is paid by every worker start for every new shape class.
Writes ``benchmarks/results/compile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from bench_engine import OursRunner, random_ids, run_as_worker

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_engine.families.llama import rms_norm
from dejavu_engine.gemm import can_pack, linear, pack, residual_linear
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.process import describe_runtime
from dejavu_engine.threads import configure_torch_threads
from dejavu_engine.weights import load_config

RESULTS = Path(__file__).resolve().parent / "results" / "compile.json"


def median_ms(fn: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def whole_step(folder: Path, variant: str, batches: list[int], prompt_len: int, steps: int) -> dict[str, object]:
    """Decode step medians of one engine variant: ``packed`` (as served), ``dense``, ``dense+compile``."""
    pipeline = Pipeline(folder, 1, pack_gemms=variant == "packed")
    family = pipeline.stages[0].family
    if variant.endswith("compile"):
        family.layer = torch.compile(family.layer, dynamic=True)  # type: ignore[method-assign]
    out: dict[str, object] = {"variant": variant}
    with torch.inference_mode():
        for batch in batches:
            runner = OursRunner(pipeline, random_ids(batch, prompt_len, pipeline.spec.vocab_size), steps + 4)
            runner.prefill()
            start = time.perf_counter()
            runner.step()  # a compiled variant compiles here (and again for a new shape class)
            runner.step()
            first = time.perf_counter() - start
            out[f"batch_{batch}"] = {"step_ms": median_ms(runner.step, steps), "first_two_steps_s": first}
            print(f"  whole step, {variant}, batch {batch}: {out[f'batch_{batch}']}", flush=True)
    return out


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.rand(hidden), requires_grad=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(rms_norm(h, self.norm, 1e-5)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class _Blocks(torch.nn.Module):
    def __init__(self, hidden: int, inner: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MLP(hidden, inner) for _ in range(layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


def mlp_bound(hidden: int, inner: int, layers: int, batches: list[int], steps: int) -> dict[str, object]:
    """Our packed eager MLP blocks against Inductor with freezing, same weights."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    blocks = _Blocks(hidden, inner, layers).eval()
    packed = [
        (b.norm, pack(b.gate_up.weight.detach()), pack(b.down.weight.detach())) if can_pack(torch.device("cpu"),
         torch.float32) else (b.norm, b.gate_up.weight.detach(), b.down.weight.detach())
        for b in blocks.blocks
    ]  # fmt: skip

    def eager(h: torch.Tensor) -> torch.Tensor:
        for norm, gate_up, down in packed:
            gate, up = linear(rms_norm(h, norm, 1e-5), gate_up, None).chunk(2, dim=-1)
            h = residual_linear(h, F.silu(gate).mul_(up), down, None)
        return h

    out: dict[str, object] = {"hidden": hidden, "inner": inner, "layers": layers}
    inductor_config.freezing = True  # this process only: the blocks' weights become constants Inductor packs
    with torch.no_grad():  # freezing needs version counters, which inference tensors lack
        compiled = torch.compile(blocks, dynamic=True)
        start = time.perf_counter()
        for batch in batches:
            compiled(torch.randn(batch, 1, hidden))
        out["compile_s"] = time.perf_counter() - start
        for batch in batches:
            h = torch.randn(batch, 1, hidden)
            for fn in (eager, compiled):
                fn(h)  # warm
            row = {
                "ours_packed_eager_ms": median_ms(lambda h=h: eager(h), steps),
                "compiled_freezing_ms": median_ms(lambda h=h: compiled(h), steps),
            }
            out[f"batch_{batch}"] = row
            print(f"  MLP blocks, batch {batch}: {row}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    run_as_worker()
    threads = configure_torch_threads(args.threads)
    folder = ensure_default_model(Settings())
    load_before = os.getloadavg()[0]
    steps = [
        whole_step(folder, v, args.batches, args.prompt_len, args.steps) for v in ("packed", "dense", "dense+compile")
    ]
    config = load_config(folder)
    shape = (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"])
    bound = mlp_bound(*shape, args.batches, 2 * args.steps)
    result = {
        "model": folder.name,
        "threads": threads,
        "torch": torch.__version__,
        "runtime": describe_runtime(),
        "prompt_len": args.prompt_len,
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "whole_step": steps,
        "mlp_blocks": bound,
    }
    print(f"\ndecode step (ms), prompt {args.prompt_len}, {threads} threads, runtime: {result['runtime']}")
    print(f"{'variant':>16} " + " ".join(f"{'batch ' + str(b):>10}" for b in args.batches) + "  first two steps (s)")
    for row in steps:
        cells = [row[f"batch_{b}"] for b in args.batches]  # type: ignore[index]
        print(f"{row['variant']:>16} " + " ".join(f"{c['step_ms']:10.1f}" for c in cells)
              + "  " + ", ".join(f"{c['first_two_steps_s']:.1f}" for c in cells))  # fmt: skip
    print(f"MLP blocks (ms), compile {bound['compile_s']:.1f} s:")
    for b in args.batches:
        row = bound[f"batch_{b}"]  # type: ignore[index]
        print(f"  batch {b}: ours packed eager {row['ours_packed_eager_ms']:.2f}, "
              f"Inductor with freezing {row['compiled_freezing_ms']:.2f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
