"""The engine benchmark's decode-step profile: op categories and a real profile of a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.bench_engine import OursRunner, category, profile_steps, random_ids
from dejavu_engine.pipeline import Pipeline


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("aten::addmm", "gemm"),
        ("aten::mm", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::copy_", "copies"),
        ("aten::cat", "copies"),
        ("aten::empty", "allocation"),
        ("aten::transpose", "views"),
        ("aten::t", "views"),
        ("aten::silu", "other_ops"),
        ("aten::rms_norm", "other_ops"),
    ],
)
def test_op_categories(op: str, expected: str) -> None:
    assert category(op) == expected


def test_profile_of_a_decode_step_accounts_for_its_ops(tiny_checkpoints: dict[str, Path]) -> None:
    pipeline = Pipeline(tiny_checkpoints["llama"], 2)
    runner = OursRunner(pipeline, random_ids(2, 8, pipeline.spec.vocab_size), 16)
    runner.prefill()
    prof = profile_steps(runner, 3)
    cats = prof["categories_s"]
    assert cats["gemm"] > 0 and cats["attention"] > 0
    assert sum(cats.values()) == pytest.approx(prof["ops_s"])
    assert prof["python_and_dispatch_s"] >= 0 and prof["ops_per_step"] > 0 and prof["step_cpu_s"] > 0
    assert prof["top_ops"] and all(op["calls_per_step"] >= 1 for op in prof["top_ops"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # untied and tied heads
def test_a_random_checkpoint_has_the_shapes_and_names_of_the_one_it_copies(
    family: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """What the GPU check times in place of the real checkpoint: the same tensors (names, shapes, dtypes) and
    so the same stage, with other values."""
    from safetensors import safe_open

    from benchmarks.random_checkpoint import build

    source = tiny_checkpoints[family]
    copy = build(source, tmp_path / "random", seed=1)

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)

    original, random = tensors(source), tensors(copy)
    assert {n: (t.shape, t.dtype) for n, t in random.items()} == {n: (t.shape, t.dtype) for n, t in original.items()}
    assert sum(not random[name].equal(t) for name, t in original.items()) > len(original) // 2  # norms may be ones
    stages = [Pipeline(folder, 2).stages for folder in (source, copy)]
    assert [s.param_bytes for s in stages[1]] == [s.param_bytes for s in stages[0]]
