"""Quantized weights benchmark: accuracy and decode speed of the default model in each weight format.

Usage: dejavu bench quant [--formats float32 int8 gguf-widened gguf-tiles gguf q5_0 q5_0-widened q5_1 q5_1-widened]
                          [--tokens 64] [--steps 24]
                          [--rounds 3] [--batches 1 4] [--rows 16 64 256] [--threads 1]

Formats (``model.weights``; each folder prepared once, :func:`dejavu_engine.checkpoint.ensure_default_model`):
``float32`` the GGUF file dequantized by transformers (the reference), ``gguf`` the file as published (Q4_1
layers, a Q8_0 embedding / tied head), kept quantized in memory with its 4-bit values packed two a byte,
``gguf-widened`` the same file with its 4-bit values widened to int8 at load (the packed kernels' baseline: the
same arithmetic from twice the bytes of values), ``gguf-tiles`` the same packed weights with the int8 GEMM left out
(passes of many rows dequantize tiles for torch's GEMM, x is not rounded: the int8 GEMM's baseline), ``int8`` the
float32 weights quantized to int8 per output channel; ``bfloat16`` is the float32 folder computed in bfloat16.
``q5_0`` and ``q5_1``: the GGUF file with its Q4_1 layers converted to Q5_0 / Q5_1 (gguf's own quantizer, from
their dequantized values; the Q8_0 embedding as it is; written once beside the gguf folder,
:func:`q5_folder`), kept packed (nibbles and a word of fifth bits a block), and ``q5_0-widened`` / ``q5_1-widened``
the same files widened to int8 at load (the packed 5-bit kernels' baseline).

Accuracy, per format against float32:
* perplexity of a fixed text (:data:`TEXT`, one prefill with every position's logits);
* greedy agreement: float32 generates ``--tokens`` greedy tokens after each of :data:`PROMPTS`; the format reads
  the same tokens (teacher forcing, one prefill) and the share of positions where its own argmax is float32's
  token is reported, with the length of its own free greedy run before it first departs from float32's.

Speed: ms per decode step (a token for each row) at each of ``--batches`` rows after a 64-token prompt, and ms per
prefill pass of one prompt of each of ``--rows`` tokens (the many-row GEMMs, plus the prompt's attention, the same
for every format), every format timed in turn within each size, ``--rounds`` rounds (the median of each round, then
the median over rounds), with the bytes each holds; and each format's time against float32's, gguf's against
gguf-widened's and gguf-tiles', each q5 format's against its widened form's, a ratio per round (formats timed side
by side), then their median. Prints a table and writes benchmarks/results/quant.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine import gguf_file, quant
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.threads import configure_torch_threads

os.environ["HF_HUB_OFFLINE"] = "1"
RESULTS = Path(__file__).resolve().parent / "results" / "quant.json"
FORMATS = (
    "float32", "bfloat16", "int8", "gguf-widened", "gguf-tiles", "gguf", "q5_0", "q5_0-widened", "q5_1", "q5_1-widened"
)  # fmt: skip
Q5_KINDS = {"q5_0": "Q5_0", "q5_1": "Q5_1"}

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels, "
    "then by punching cards, and later by writing instructions in assembly language. Each step moved the "
    "programmer further from the hardware and closer to the problem. High-level languages such as Fortran "
    "and Lisp appeared in the late 1950s, and with them the idea that a program could be written once and "
    "run on many different machines. Operating systems took over the management of memory, files and "
    "devices, so that several programs could share one computer safely. Networks then connected computers "
    "to each other, and the problems of distributed systems appeared: messages are lost, machines fail, and "
    "clocks disagree. Engineers answered with replication, consensus protocols and careful timeouts, so that "
    "a service can keep running while some of its parts are broken."
)
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what is it known for?",
)


def folders(formats: list[str]) -> dict[str, tuple[Path, str]]:
    """format -> (checkpoint folder, stage dtype)."""
    settings = Settings()
    out = {}
    for fmt in formats:
        kind = Q5_KINDS.get(fmt.removesuffix("-widened"))
        if kind is not None:
            out[fmt] = (q5_folder(ensure_default_model(settings, weights="gguf"), kind), "float32")
            continue
        weights = {"float32": "float", "bfloat16": "float", "gguf-widened": "gguf", "gguf-tiles": "gguf"}.get(fmt, fmt)
        out[fmt] = (ensure_default_model(settings, weights=weights), "bfloat16" if fmt == "bfloat16" else "float32")
    return out


def q5_folder(gguf: Path, kind: str) -> Path:
    """The default model's GGUF folder with its 4-bit layers converted to ``kind`` (Q5_0 or Q5_1), beside it:
    each Q4_1 tensor dequantized by gguf and quantized again by gguf's quantizer, the other tensors (the Q8_0
    embedding, the float norms) as they are, and the fields the reader needs (the architecture, the head counts).
    Written once (a finished folder has its model.gguf)."""
    folder = gguf.with_name(f"{gguf.name}-{kind.lower()}")
    if (folder / "model.gguf").exists():
        return folder
    folder.mkdir(exist_ok=True)
    for item in gguf.iterdir():
        if item.suffix != ".gguf":
            (folder / item.name).write_bytes(item.read_bytes())
    reader = GGUFReader(str(gguf / "model.gguf"))
    partial = folder / "model.gguf.partial"
    writer = GGUFWriter(str(partial), "llama")
    writer.add_head_count(int(reader.fields["llama.attention.head_count"].contents()))
    writer.add_head_count_kv(int(reader.fields["llama.attention.head_count_kv"].contents()))
    target = GGMLQuantizationType[kind]
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.tensor_type.name == "Q4_1":
            values = quants.dequantize(data, tensor.tensor_type)
            writer.add_tensor(tensor.name, quants.quantize(values, target), raw_dtype=target)
        elif tensor.tensor_type.name in ("F32", "F16"):
            writer.add_tensor(tensor.name, data.copy())
        else:
            writer.add_tensor(tensor.name, data.copy(), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(folder / "model.gguf")
    return folder


def load_stage(fmt: str, folder: Path, dtype: str) -> Stage:
    """The whole model in format ``fmt``; ``gguf-widened`` (``q5_*-widened``) reads the GGUF file with no block
    type kept packed."""
    if fmt.endswith("-widened"):
        with mock.patch.object(gguf_file, "PACKED_TYPES", frozenset()):
            return Stage(folder, (0, 30), dtype=dtype)
    return Stage(folder, (0, 30), dtype=dtype)


def paths(fmt: str) -> contextlib.AbstractContextManager[Any]:
    """Where ``fmt`` runs: ``gguf-tiles`` without the int8 GEMM (many rows through dequantized tiles)."""
    if fmt == "gguf-tiles":
        return mock.patch.object(quant, "_int8_rows", lambda: None)
    return contextlib.nullcontext()


def forced_logits(stage: Stage, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill of ``ids`` (float32 ``[len, vocab]``)."""
    cache = stage.allocate_cache(1, len(ids))
    out = stage.prefill(
        StageIO(input_ids=torch.tensor([ids])), cache, BatchGeometry.for_prompts([len(ids)]), all_logits=True
    )
    return out.logits[0].float()


def perplexity(stage: Stage, ids: list[int]) -> float:
    logits = forced_logits(stage, ids)
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(loss.item())


def greedy(stage: Stage, ids: list[int], steps: int) -> list[int]:
    cache = stage.allocate_cache(1, len(ids) + steps)
    geometry = BatchGeometry.for_prompts([len(ids)])
    out = stage.prefill(StageIO(input_ids=torch.tensor([ids])), cache, geometry)
    tokens = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        geometry = geometry.advance()
        out = stage.decode(StageIO(input_ids=torch.tensor([[tokens[-1]]])), cache, geometry)
    return tokens


def agreement(stage: Stage, prompt: list[int], reference: list[int]) -> tuple[int, int]:
    """(positions whose argmax is the reference token, positions) under teacher forcing on the reference."""
    logits = forced_logits(stage, prompt + reference)
    picks = logits[len(prompt) - 1 : len(prompt) - 1 + len(reference)].argmax(-1).tolist()
    return sum(p == r for p, r in zip(picks, reference, strict=True)), len(reference)


def common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def decode_ms(stage: Stage, ids: list[int], steps: int, batch: int) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` rows after a prefill of ``ids`` in each row."""
    cache = stage.allocate_cache(batch, len(ids) + steps + 1)
    geometry = BatchGeometry.for_prompts([len(ids)] * batch)
    stage.prefill(StageIO(input_ids=torch.tensor([ids] * batch)), cache, geometry)
    times = []
    for _ in range(steps):
        geometry = geometry.advance()
        start = time.perf_counter()
        stage.decode(StageIO(input_ids=torch.full((batch, 1), 17)), cache, geometry)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def prefill_ms(stage: Stage, ids: list[int], passes: int) -> float:
    """Median ms of ``passes`` prefill passes of one prompt ``ids`` (each into a fresh cache)."""
    times = []
    for _ in range(passes):
        cache = stage.allocate_cache(1, len(ids))
        geometry = BatchGeometry.for_prompts([len(ids)])
        start = time.perf_counter()
        stage.prefill(StageIO(input_ids=torch.tensor([ids])), cache, geometry)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ratios(rows: dict[str, dict[str, Any]], key: str, sizes: list[int]) -> dict[str, dict[str, float]]:
    """Per size, the median over rounds of each round's time (``rows[fmt][key]``) of a format over its baseline's:
    every format over float32, gguf over gguf-widened (the packed kernels against the widened ones) and over
    gguf-tiles (the int8 GEMM against dequantized tiles), each q5 format over its widened form."""
    pairs = [(fmt, "float32") for fmt in rows if fmt != "float32"]
    pairs += [("gguf", base) for base in ("gguf-widened", "gguf-tiles") if "gguf" in rows and base in rows]
    pairs += [(fmt, f"{fmt}-widened") for fmt in Q5_KINDS if fmt in rows and f"{fmt}-widened" in rows]
    out = {}
    for fmt, base in pairs:
        out[f"{fmt} / {base}"] = {
            str(b): round(
                statistics.median(t / u for t, u in zip(rows[fmt][key][str(b)], rows[base][key][str(b)], strict=True)),
                3,
            )
            for b in sizes
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--formats", nargs="+", choices=FORMATS, default=["float32", "int8", "gguf-widened", "gguf-tiles", "gguf"]
    )
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt for the agreement")
    parser.add_argument("--steps", type=int, default=24, help="decode steps a round (and prefill passes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4], help="rows of a decode step")
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64, 256], help="tokens of a prefill pass")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = parser.parse_args()
    configure_torch_threads(args.threads)
    formats = list(dict.fromkeys(["float32", *args.formats]))
    where = folders(formats)
    tokenizer = Tokenizer.from_pretrained(where["float32"][0])
    stages = {fmt: load_stage(fmt, folder, dtype) for fmt, (folder, dtype) in where.items()}
    text = tokenizer.encode(TEXT)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    long_text = (text * (max(args.rows) // len(text) + 1))[: max(args.rows)]
    with torch.inference_mode():
        reference = [greedy(stages["float32"], p, args.tokens) for p in prompts]
        rows: dict[str, dict[str, Any]] = {}
        for fmt, stage in stages.items():
            with paths(fmt):
                hits = [agreement(stage, p, r) for p, r in zip(prompts, reference, strict=True)]
                runs = [
                    common_prefix(greedy(stage, p, args.tokens), r) for p, r in zip(prompts, reference, strict=True)
                ]
                rows[fmt] = {
                    "weights_mb": round(stage.param_bytes / 1e6, 1),
                    "perplexity": round(perplexity(stage, text), 4),
                    "greedy_agreement": round(sum(h for h, _ in hits) / sum(n for _, n in hits), 4),
                    "free_run_same_tokens": runs,
                    "decode_ms": {str(b): [] for b in args.batches},
                    "prefill_ms": {str(n): [] for n in args.rows},
                }
        warm = tokenizer.encode(TEXT)[:64]
        for _ in range(args.rounds):
            for batch in args.batches:
                for fmt, stage in stages.items():
                    with paths(fmt):
                        ms = decode_ms(stage, warm, args.steps, batch)
                    rows[fmt]["decode_ms"][str(batch)].append(round(ms, 2))
            for n in args.rows:
                for fmt, stage in stages.items():
                    with paths(fmt):
                        ms = prefill_ms(stage, long_text[:n], max(3, args.steps // 4))
                    rows[fmt]["prefill_ms"][str(n)].append(round(ms, 2))
    times = "".join(f" {f'ms b{b}':>8}" for b in args.batches) + "".join(f" {f'ms p{n}':>8}" for n in args.rows)
    print(f"{'format':13} {'MB':>7} {'ppl':>9} {'agree':>7}{times}  free run (tokens equal to float32)")
    for fmt, row in rows.items():
        row["decode_ms_median"] = {b: statistics.median(ms) for b, ms in row["decode_ms"].items()}
        row["prefill_ms_median"] = {n: statistics.median(ms) for n, ms in row["prefill_ms"].items()}
        times = "".join(f" {row['decode_ms_median'][str(b)]:8.2f}" for b in args.batches)
        times += "".join(f" {row['prefill_ms_median'][str(n)]:8.2f}" for n in args.rows)
        print(
            f"{fmt:13} {row['weights_mb']:7.1f} {row['perplexity']:9.4f} {row['greedy_agreement']:7.2%}{times}  "
            f"{row['free_run_same_tokens']} of {args.tokens}"
        )
    relative = {"decode": ratios(rows, "decode_ms", args.batches), "prefill": ratios(rows, "prefill_ms", args.rows)}
    for pair, by_batch in relative["decode"].items():
        by_rows = relative["prefill"][pair]
        print(
            f"{pair:26} "
            + "  ".join(f"b{b} {r:.3f}" for b, r in by_batch.items())
            + "  "
            + "  ".join(f"p{n} {r:.3f}" for n, r in by_rows.items())
        )
    result = {
        "host": platform.node(),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "text_tokens": len(text),
        "tokens": args.tokens,
        "steps": args.steps,
        "rounds": args.rounds,
        "formats": rows,
        "time_ratios": relative,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
