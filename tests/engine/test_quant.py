"""Weight-only quantized weights: the native int8 kernel against the float math of the dequantized weights,
and a quantized checkpoint of every family against the same checkpoint with those weights dequantized to float.

Tolerance of a GEMM against its float64 reference: a float32 dot product of ``K`` terms, each product and
each partial sum rounded once, is within ``gamma_K * sum_k |x_k w_k|`` of the exact one (``gamma_K = K u / (1
- K u)``, ``u = 2^-24``: Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1), whatever the summation
order. The kernel distributes the scales and offsets (``scale * (x . q)`` a row or a group, ``offset * sum(x)``
a group): a few more roundings a term (the scaling, the group's sum into the row's), and the terms are
``|x| (|scale q| + |offset|)``, not ``|x w|``. So each output is held to ``(K + 2) u * (|x| @ T^T)`` with ``T =
|scale q| + |offset|`` (plus float32's smallest normal for outputs that are 0), a bound that an error in a
single weight, scale, offset, group or row would exceed by orders of magnitude.

Packed 4-bit weights are held to more: the kernels unpack each value and form the same products in the same order
as for the weight widened to int8, so their results are the widened weight's bit for bit (``torch.equal``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from safetensors import safe_open
from safetensors.torch import save_file

from dejavu_engine import gemm, native, quant
from dejavu_engine.checkpoint import CheckpointError, quantize_checkpoint
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.quant import QuantizedWeight
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from engine.tiny_models import FAMILIES

U = 2.0**-24


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if native.load() is None:
        pytest.skip("native kernels cannot be built here")


def _random_weight(n: int, k: int, groups: int, offsets: bool, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-4
    offset = (torch.rand(n, groups, generator=gen) - 0.5) * 0.1 if offsets else None
    return QuantizedWeight(q, scale, offset, kind="test")


def _random_packed(n: int, k: int, offsets: bool, seed: int) -> QuantizedWeight:
    """A 4-bit weight of blocks of 32 with every byte random: Q4_1's form (zero 0, offsets) or Q4_0's (zero 8)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // quant.BLOCK, generator=gen) * 0.02 + 1e-4
    offset = (torch.rand(n, k // quant.BLOCK, generator=gen) - 0.5) * 0.1 if offsets else None
    return QuantizedWeight(q, scale, offset, kind="Q4_1" if offsets else "Q4_0", zero=0 if offsets else 8)


def _terms(w: QuantizedWeight) -> torch.Tensor:
    """``|scale * q| + |offset|`` a weight: the magnitudes of the terms the kernel adds for it (the product and
    the offset are added apart, so a weight that cancels to ~0 still carries their rounding)."""
    offset = w.offset.abs() if w.offset is not None else None
    return quant._dequantize_rows(w.widen().q.abs(), w.scale.abs(), offset)


def _assert_within_bound(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, terms: torch.Tensor | None = None
) -> None:
    exact = x.double() @ w.double().t()
    magnitude = x.double().abs() @ (w.abs() if terms is None else terms).double().t()
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    k = x.shape[-1]
    bound = (k + 2) * U * magnitude + torch.finfo(torch.float32).tiny
    excess = (y.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"error beyond the float32 bound by {excess.max().item()}"


@pytest.mark.parametrize(
    ("k", "groups", "offsets"), [(37, 1, False), (576, 1, False), (577, 1, False), (1536, 48, True), (64, 2, False)]
)
def test_kernel_is_the_float_math_of_the_dequantized_weight(k: int, groups: int, offsets: bool) -> None:
    w = _random_weight(96, k, groups, offsets, seed=k)
    dense = w.dequantize()
    bias = torch.randn(96)
    for rows in [*range(1, 17), 17, 40]:  # past 16 rows, blocks go through dequantized tiles and torch's GEMM
        x = torch.randn(rows, k)
        _assert_within_bound(quant.linear(x, w, None), x, dense, None, _terms(w))
        _assert_within_bound(quant.linear(x, w, bias), x, dense, bias, _terms(w))


# Odd shapes: rows of 1, 3 and 19 blocks, output rows that leave a part of the kernel's block of weight rows.
PACKED_SHAPES = [(1, 32), (7, 96), (37, 608), (97, 1536)]


@pytest.mark.parametrize("offsets", [False, True], ids=["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("n", "k"), PACKED_SHAPES)
def test_a_packed_weight_computes_its_widened_weight_bit_for_bit(n: int, k: int, offsets: bool) -> None:
    w = _random_packed(n, k, offsets, seed=n + k)
    wide = w.widen()
    assert wide.q.dtype == torch.int8 and wide.q.shape == (n, k) and wide.shape == w.shape == (n, k)
    assert wide.q.min() >= -w.zero and wide.q.max() <= 15 - w.zero
    bias = torch.randn(n)
    for rows in (1, 2, 5, 16, 40):  # 40: past DECODE_ROWS, dequantized tiles and torch's GEMM
        x = torch.randn(rows, k)
        for b in (None, bias):
            y = quant.linear(x, w, b)
            assert torch.equal(y, quant.linear(x, wide, b)), (rows, b is not None)
            _assert_within_bound(y, x, wide.dequantize(), b, _terms(w))


def test_packed_nibbles_are_in_ggufs_order() -> None:
    """Byte i of a block holds the block's value i in its low nibble and value i + 16 in its high one."""
    q = torch.zeros(1, 32, dtype=torch.uint8)
    q[0, :16] = torch.arange(16, dtype=torch.uint8) | (15 - torch.arange(16, dtype=torch.uint8)) << 4
    q[0, 16:] = 0x5A
    w = QuantizedWeight(q, torch.ones(1, 2), None, kind="Q4_0", zero=8)
    expected = torch.cat([torch.arange(16), 15 - torch.arange(16), torch.full((16,), 10), torch.full((16,), 5)]) - 8
    assert torch.equal(w.widen().q[0], expected.to(torch.int8))
    assert torch.equal(w.dequantize()[0], expected.float())
    x = torch.zeros(1, 64)
    x[0, 17] = 1.0  # picks value 17: byte 1's high nibble
    assert quant.linear(x, w).item() == 14 - 8


def test_packed_dequantization_is_the_widened_weights_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    for offsets in (False, True):
        w = _random_packed(70, 576, offsets, seed=int(offsets))
        reference = w.widen().dequantize()
        assert torch.equal(w.dequantize(), reference)
        assert torch.equal(w.dequantize((10, 33)), reference[10:33])
        assert torch.equal(w.dense(), reference) and torch.equal(w.t().dense(), reference.t())
        with monkeypatch.context() as patch:  # without the kernels: torch's unpacking, the same values
            patch.setattr(quant, "_ops", lambda: None)
            assert torch.equal(w.dequantize((3, 70)), reference[3:])
            x = torch.randn(3, 576)
            assert torch.equal(quant.linear(x, w), quant.linear(x, w.widen()))


def test_a_packed_weight_stands_where_a_dense_one_does() -> None:
    q_proj, k_proj = _random_packed(64, 96, True, seed=21), _random_packed(33, 96, True, seed=22)
    fused = torch.cat([q_proj, k_proj])  # a fused projection stays packed
    assert fused.packed and fused.shape == (97, 96) and fused.zero == 0
    wide = torch.cat([q_proj.widen(), k_proj.widen()])
    assert torch.equal(fused.widen().q, wide.q)
    x = torch.randn(5, 96)
    assert torch.equal(F.linear(x, fused), F.linear(x, wide))
    first, second = fused.split([64, 33])
    assert first.packed and torch.equal(first.q, q_proj.q) and torch.equal(second.dequantize(), k_proj.dequantize())
    assert torch.equal(gemm.linear(x, second, None), gemm.linear(x, k_proj.widen(), None))
    r = torch.randn(5, 33)
    assert torch.equal(gemm.residual_linear(r, x, second, None), gemm.residual_linear(r, x, k_proj.widen(), None))
    conv = q_proj.t()  # GPT-2's Conv1D [in, out]
    assert conv.shape == (96, 64)
    bias = torch.randn(64)
    assert torch.equal(torch.addmm(bias, x, conv), torch.addmm(bias, x, q_proj.widen().t()))
    assert torch.equal(torch.matmul(x, conv), torch.matmul(x, q_proj.widen().t()))
    ids = torch.tensor([[3, 0, 63], [17, 3, 40]])
    embedded = F.embedding(ids, q_proj)
    assert embedded.shape == (2, 3, 96)
    assert torch.equal(embedded, q_proj.dense()[ids]) and torch.equal(embedded, F.embedding(ids, q_proj.widen()))
    mixed = torch.cat([q_proj, k_proj.widen()])  # packed and int8 values: no common layout, the dense tensor
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([q_proj.dense(), k_proj.dense()]))


def test_a_packed_weight_holds_half_the_bytes_of_its_values() -> None:
    w = _random_packed(48, 320, True, seed=5)
    assert w.numel() == 48 * 320 and w.nbytes == 48 * 160 + 2 * 48 * 10 * 4
    assert w.numel() * w.element_size() == w.nbytes and w.widen().nbytes == w.nbytes + 48 * 160
    assert w.group == 32 and "packed" in repr(w)


def test_bad_packed_weights_are_refused() -> None:
    q = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantizedWeight(q, torch.ones(2, 1))
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantizedWeight(torch.zeros(2, 24, dtype=torch.uint8), torch.ones(2, 1))
    with pytest.raises(ValueError, match="nibble"):
        QuantizedWeight(q, torch.ones(2, 2), zero=16)
    with pytest.raises(ValueError, match="no zero"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), zero=8)
    w = QuantizedWeight(q, torch.ones(2, 2), zero=8)
    with pytest.raises(ValueError, match="features"):
        quant.linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="int8 per-channel"):
        w.to_stored()
    op = quant._ops()
    with pytest.raises(RuntimeError, match="scale a block of 32"):
        op.quant_linear4(torch.randn(1, 64), q, torch.ones(2, 3), None, None, 8)
    with pytest.raises(RuntimeError, match="columns"):
        op.quant_linear4(torch.randn(1, 32), q, torch.ones(2, 2), None, None, 8)
    with pytest.raises(RuntimeError, match="zero"):
        op.quant_dequantize4(q, torch.ones(2, 2), None, 20, 0, 2)
    with pytest.raises(RuntimeError, match="rows"):
        op.quant_dequantize4(q, torch.ones(2, 2), None, 8, 1, 3)


def test_many_rows_of_a_tall_weight_of_blocks_go_through_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _random_weight(quant.TILE_ROWS * 2 + 37, 64, 2, True, seed=9)  # two whole tiles and a part
    calls: list[tuple[int, int] | None] = []
    dequantize = QuantizedWeight.dequantize

    def counted(self: QuantizedWeight, rows: tuple[int, int] | None = None) -> torch.Tensor:
        calls.append(rows)
        return dequantize(self, rows)

    x = torch.randn(quant.DECODE_ROWS + 3, 64)
    reference = w.dequantize()
    monkeypatch.setattr(QuantizedWeight, "dequantize", counted)
    _assert_within_bound(quant.linear(x, w), x, reference, None, _terms(w))
    tile = quant.TILE_ROWS
    assert calls == [(0, tile), (tile, 2 * tile), (2 * tile, 2 * tile + 37)]


def test_subnormal_inputs_count_as_zero() -> None:
    """The kernel flushes subnormals (each would stall an FMA ~100 cycles): the result is that of x with them 0."""
    w = _random_weight(64, 96, 3, True, seed=11)
    x = torch.randn(2, 96)
    x[:, ::3] = 1e-40  # subnormal in float32
    flushed = torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(x), x)
    _assert_within_bound(quant.linear(x, w), flushed, w.dequantize(), None, _terms(w))


def test_kernel_reads_strided_rows_and_keeps_leading_dimensions() -> None:
    w = _random_weight(40, 64, 2, True, seed=1)
    x = torch.randn(3, 5, 128)[..., :64]  # rows 128 apart
    y = quant.linear(x, w)
    assert y.shape == (3, 5, 40)
    _assert_within_bound(y.reshape(15, 40), x.reshape(15, 64), w.dequantize(), None, _terms(w))


def test_native_dequantization_is_torchs_bit_for_bit() -> None:
    for groups, offsets in [(1, False), (18, True), (18, False)]:
        w = _random_weight(70, 576, groups, offsets, seed=groups)
        reference = quant._dequantize_rows(w.q, w.scale, w.offset)
        assert torch.equal(w.dequantize(), reference)
        assert torch.equal(w.dequantize((10, 33)), reference[10:33])


def test_per_channel_quantization_is_symmetric_and_round_to_nearest() -> None:
    weight = torch.randn(33, 19)
    weight[5] = 0
    w = quant.quantize(weight)
    assert w.q.abs().max() == 127 and torch.equal(w.q[5], torch.zeros(19, dtype=torch.int8))
    assert torch.allclose(w.scale[:, 0], torch.where(weight.abs().amax(1) > 0, weight.abs().amax(1) / 127, 1.0))
    assert (w.dense() - weight).abs().le(w.scale * (0.5 + 1e-4)).all()  # half a step (and the rounding of scale * q)
    stored = quant.quantize(weight.t().contiguous(), transposed=True)  # [in, out]: channels are columns
    assert torch.equal(stored.q, w.q) and torch.equal(QuantizedWeight.from_stored(*stored.to_stored()).q, w.q)


def test_a_quantized_weight_stands_where_a_dense_one_does() -> None:
    w = _random_weight(48, 32, 1, False, seed=3)
    dense = w.dequantize()
    x = torch.randn(2, 32)
    torch.testing.assert_close(F.linear(x, w), x @ dense.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm.linear(x, w, None), x @ dense.t(), rtol=1e-5, atol=1e-5)
    r = torch.randn(2, 48)
    torch.testing.assert_close(gemm.residual_linear(r, x, w, None), r + x @ dense.t(), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(F.embedding(ids, w), dense[ids])
    fused = torch.cat([w, w.split([16, 32])[1]])
    assert fused.shape == (80, 32) and torch.equal(fused.dequantize(), torch.cat([dense, dense[16:]]))
    conv = w.t()  # GPT-2's Conv1D [in, out]
    torch.testing.assert_close(torch.addmm(torch.ones(48), x, conv), 1 + x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert gemm.pack(w) is w and w.numel() * w.element_size() == w.nbytes


def test_the_families_torch_calls_never_dequantize_a_whole_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _random_weight(48, 32, 1, False, seed=5)
    x = torch.randn(3, 32)

    def whole(self: QuantizedWeight) -> torch.Tensor:
        raise AssertionError("dequantized whole")

    monkeypatch.setattr(QuantizedWeight, "dense", whole)
    F.embedding(torch.tensor([[1, 2]]), w)
    F.linear(x, w, torch.zeros(48))
    torch.addmm(torch.zeros(48), x, w.t())
    torch.cat([w, w])
    with pytest.raises(AssertionError, match="dequantized whole"):
        torch.add(w, 1)  # any other function: the dense tensor


def test_bad_shapes_are_refused() -> None:
    w = _random_weight(8, 32, 1, False, seed=4)
    with pytest.raises(ValueError, match="features"):
        quant.linear(torch.randn(2, 31), w)
    with pytest.raises(ValueError, match="int8"):
        QuantizedWeight(torch.zeros(2, 4), torch.ones(2, 1))
    with pytest.raises(ValueError, match="groups"):
        QuantizedWeight(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="rows"):
        quant._ops().quant_dequantize(w.q, w.scale, None, 3, 9)


def _dequantized_copy(source: Path, target: Path) -> Path:
    """``source`` (an int8 checkpoint) with every quantized weight dequantized to float32: the same model in float."""
    target.mkdir()
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization_config")
    (target / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        for name in names - {n for n in names if n.endswith("_scale") and n.removesuffix("_scale") in names}:
            tensor = handle.get_tensor(name)
            if tensor.dtype == torch.int8:
                tensor = QuantizedWeight.from_stored(tensor, handle.get_tensor(f"{name}_scale")).dense().contiguous()
            tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"))
    return target


def _greedy(stage: Stage, ids: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    cache = stage.allocate_cache(ids.shape[0], ids.shape[1] + steps + 1)
    geometry = BatchGeometry.for_prompts([ids.shape[1]] * ids.shape[0])
    out = stage.prefill(StageIO(input_ids=ids), cache, geometry)
    logits, tokens = [out.logits[:, -1]], []
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token[0]))
        geometry = geometry.advance()
        out = stage.decode(StageIO(input_ids=token), cache, geometry)
        logits.append(out.logits[:, -1])
    return logits, tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_an_int8_checkpoint_computes_its_dequantized_float_model(
    family: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    int8 = tmp_path / "int8"
    quantize_checkpoint(tiny_checkpoints[family], int8)
    stage = Stage(int8, (0, 3))
    quantized = [w for w in stage.weights.values() if isinstance(w, QuantizedWeight)]
    assert quantized and all(w.kind == "int8" and w.group == w.q.shape[1] for w in quantized)
    float_stage = Stage(_dequantized_copy(int8, tmp_path / "float"), (0, 3))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(7))
    logits, tokens = _greedy(stage, ids, 6)
    float_logits, float_tokens = _greedy(float_stage, ids, 6)
    assert tokens == float_tokens
    for a, b in zip(logits, float_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_quantized_checkpoint_refuses_bfloat16(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    quantize_checkpoint(tiny_checkpoints["llama"], tmp_path / "int8")
    with pytest.raises(CheckpointError, match=r"compute in float32 on CPU, not torch\.bfloat16"):
        Stage(tmp_path / "int8", (0, 3), dtype="bfloat16")
