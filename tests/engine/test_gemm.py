"""oneDNN-packed GEMM weights (dejavu_engine.gemm): the same numbers as the dense GEMM up to the last
bits, the same greedy tokens as transformers, the dense memory released, and packing only where it can
run (CPU float32, and bfloat16 where oneDNN has bfloat16 kernels for the host) and where the settings
ask for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dejavu_common.settings import EngineSettings
from dejavu_engine import gemm
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO

pytestmark = pytest.mark.skipif(not gemm.can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN here")


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_a_packed_weight_multiplies_like_the_dense_one(rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x, residual = torch.randn(2, rows, 64), torch.randn(2, rows, 96)
    packed = gemm.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape and packed.numel() == weight.numel()
    for b in (None, bias):
        torch.testing.assert_close(gemm.linear(x, packed, b), torch.nn.functional.linear(x, weight, b))
        torch.testing.assert_close(
            gemm.residual_linear(residual, x, packed, b), residual + torch.nn.functional.linear(x, weight, b)
        )


@pytest.mark.skipif(not gemm.can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bfloat16 here")
@pytest.mark.parametrize("rows", [1, 16])
def test_a_packed_bfloat16_weight_multiplies_like_torchs_bfloat16_gemm(rows: int) -> None:
    """Both accumulate in float32 and round the output once: equal up to one bfloat16 rounding."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(2, rows, 64).bfloat16()
    packed = gemm.pack(weight)
    assert packed.is_mkldnn and packed.dtype == torch.bfloat16 and packed.shape == weight.shape
    for b in (None, bias):
        out = gemm.linear(x, packed, b)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), atol=0.0625, rtol=2**-7)


def test_a_packed_stage_matches_the_dense_one_and_holds_no_dense_copy(tiny_checkpoints: dict[str, Path]) -> None:
    folder = tiny_checkpoints["llama"]
    dense, packed = Stage(folder, (0, 3), pack_gemms=False), Stage(folder, (0, 3))
    assert packed.packed_gemms and not dense.packed_gemms
    assert packed.param_bytes == dense.param_bytes  # accounted as before
    assert set(packed.weights) == set(dense.weights)
    q = next(name for name in packed.weights if name.endswith("q_proj.weight"))
    o = next(name for name in packed.weights if name.endswith("o_proj.weight"))
    assert packed.weights[q].is_meta and packed.weights[q].shape == dense.weights[q].shape  # a fused part
    assert packed.weights[o].is_mkldnn
    ids = torch.randint(0, dense.spec.vocab_size, (2, 7))
    geometry = BatchGeometry.for_prompts([7, 5])
    outs = [
        stage.prefill(StageIO(input_ids=ids), stage.allocate_cache(2, 8), geometry).logits for stage in (dense, packed)
    ]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_packing_only_where_it_runs_and_where_the_settings_ask() -> None:
    assert gemm.can_pack(torch.device("cpu"), torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not gemm.can_pack(torch.device("cpu"), torch.float16)
    assert not gemm.can_pack(torch.device("cuda"), torch.float32)
    auto, on, off = (EngineSettings(packed_gemm=v) for v in ("auto", "on", "off"))
    assert auto.packs_gemms(decodes=True) and not auto.packs_gemms(decodes=False)
    assert on.packs_gemms(decodes=False) and not off.packs_gemms(decodes=True)


def test_smollm2_packed_greedy_tokens_equal_transformers(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dejavu_common.messages import SamplingSpec
    from dejavu_engine.generate import Request, generate_batch

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    pipeline = Pipeline(smollm2, 2)
    assert all(stage.packed_gemms for stage in pipeline.stages)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            expected = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        request = Request(tuple(ids[0].tolist()), SamplingSpec(max_tokens=24, temperature=0))
        (completion,), _ = generate_batch(pipeline, [request])
        assert list(completion.token_ids) == expected[: len(completion.token_ids)]
        assert len(completion.token_ids) == 24
