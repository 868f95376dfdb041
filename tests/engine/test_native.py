"""The native decode-attention kernel computes what torch's attention computes, row by row, and a
stage using it decodes what a stage without it decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dejavu_engine import native
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from engine.tiny_models import FAMILIES


def reference(q, k_new, v_new, k_caches, v_caches, rows, scale):
    """Torch's attention of each row alone, after writing its new K/V (on copies of the caches)."""
    k_caches = [k.clone() for k in k_caches]
    v_caches = [v.clone() for v in v_caches]
    outs = []
    for r, (g, i, start, end) in enumerate(rows.tolist()):
        k_caches[g][i, :, end - 1] = k_new[r]
        v_caches[g][i, :, end - 1] = v_new[r]
        k = k_caches[g][i : i + 1, :, start:end]
        v = v_caches[g][i : i + 1, :, start:end]
        out = F.scaled_dot_product_attention(q[r : r + 1].unsqueeze(2), k, v, scale=scale, enable_gqa=True)
        outs.append(out[0, :, 0])
    return torch.stack(outs), k_caches, v_caches


# head_dim 64 and 128 take the vectorised path on AVX2 hosts, 24 the generic one.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 24), (8, 2, 128)])
def test_rows_of_many_caches_attend_as_each_alone(heads: int, kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(heads * head_dim)
    sizes, max_len = [1, 3, 2], 40
    k_caches = [torch.randn(b, kv_heads, max_len, head_dim, generator=generator) for b in sizes]
    v_caches = [torch.randn(b, kv_heads, max_len, head_dim, generator=generator) for b in sizes]
    spans = [(0, 0, 0, 1), (1, 0, 3, 17), (1, 1, 0, 17), (1, 2, 16, 17), (2, 0, 5, 40), (2, 1, 0, 33)]
    rows = torch.tensor(spans, dtype=torch.long)
    q = torch.randn(len(spans), heads, head_dim, generator=generator) * 4  # peaked softmaxes too
    k_new = torch.randn(len(spans), kv_heads, head_dim, generator=generator)
    v_new = torch.randn(len(spans), kv_heads, head_dim, generator=generator)
    expected, k_after, v_after = reference(q, k_new, v_new, k_caches, v_caches, rows, 0.1)
    out = native.decode_attention(q, k_new, v_new, k_caches, v_caches, rows, 0.1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    for mine, theirs in zip(k_caches + v_caches, k_after + v_after, strict=True):
        assert torch.equal(mine, theirs)  # the new K/V landed where each row's span ends, nothing else moved


@pytest.mark.parametrize(
    ("span", "message"),
    [((0, 0, 0, 41), "bad span"), ((0, 0, 5, 5), "bad span"), ((1, 0, 0, 4), "no group"), ((0, 2, 0, 4), "no row")],
)
def test_a_span_outside_the_caches_is_refused_before_anything_is_read(span: tuple[int, ...], message: str) -> None:
    k = torch.zeros(2, 1, 40, 8)
    v = torch.zeros(2, 1, 40, 8)
    rows = torch.tensor([span], dtype=torch.long)
    with pytest.raises(RuntimeError, match=message):
        native.decode_attention(torch.zeros(1, 1, 8), torch.ones(1, 1, 8), torch.ones(1, 1, 8), [k], [v], rows, 1.0)
    assert not k.any() and not v.any()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bloom"])  # ALiBi biases stay on torch's path
def test_a_stage_decodes_the_same_with_and_without_the_kernel(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    folder = tiny_checkpoints[family]
    fast, plain = Stage(folder, (0, 2)), Stage(folder, (0, 2), native_attention=False)
    assert fast.native_attention and not plain.native_attention
    lengths = [[9, 4], [3], [6, 6, 2]]
    outputs = []
    for stage in (fast, plain):
        groups, tokens = [], []
        for prompt_lens in lengths:
            geometry = BatchGeometry.for_prompts(prompt_lens)
            cache = stage.allocate_cache(len(prompt_lens), geometry.cur_len + 3)
            seeded = torch.Generator().manual_seed(3)
            ids = torch.randint(3, 300, (len(prompt_lens), geometry.cur_len), generator=seeded)
            stage.prefill(StageIO(input_ids=ids), cache, geometry)
            groups.append((cache, geometry))
            tokens += [[7 + len(prompt_lens)]] * len(prompt_lens)
        steps = []
        for _ in range(3):
            groups = [(cache, geometry.advance()) for cache, geometry in groups]
            out = stage.decode_groups(StageIO(input_ids=torch.tensor(tokens)), groups)
            steps.append(out.hidden)
        outputs.append(steps)
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_host_that_cannot_build_the_kernel_decodes_with_torch(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoints: dict[str, Path]
) -> None:
    def no_compiler() -> None:
        raise OSError("g++: not found")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_build", no_compiler)
    stage = Stage(tiny_checkpoints["llama"], (0, 2))
    assert not stage.native_attention
    geometry = BatchGeometry.for_prompts([4])
    cache = stage.allocate_cache(1, 6)
    stage.prefill(StageIO(input_ids=torch.tensor([[5, 6, 7, 8]])), cache, geometry)
    out = stage.decode(StageIO(input_ids=torch.tensor([[9]])), cache, geometry.advance())
    assert out.hidden is not None and torch.isfinite(out.hidden).all()
