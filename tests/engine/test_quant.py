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

Packed 4-bit and 5-bit weights are held to more: the kernels unpack each value and form the same products in the
same order as for the weight widened to int8, so their results are the widened weight's bit for bit
(``torch.equal``), on every path (the float kernel's AVX-512, AVX2 and scalar builds, the int8 GEMM with and without
VNNI, dequantized tiles).

The int8 GEMM (a weight of blocks of 32, from ``quant._int8_rows()`` rows) rounds x first, per row per block, to
two int8 parts (``u = x / dx``, ``dx = max|x| / 127``, ``high = round(u)``, ``low = round(128 (u - high))``, ``xq = 128
high + low``), and is held to two bounds (:func:`_assert_int8_gemm`):

* its product with the same ``xq`` (reproduced here with torch's float32 ops, the kernel's), ``sum_g s_g dx_g / 128
  (xq . v)_g + o_g sum_g(x)``, made in float64: the int32 sums are exact, and the kernel rounds each sum to float32,
  ``s_g * dx_g / 128`` and each of ``2G`` fused multiply-adds once, sums each block of x in 31 float additions and
  adds the bias once, so each output is within ``(2G + 35) u`` of the sum of its terms' magnitudes: a wrong value,
  scale, offset, block, part or row is off by orders of magnitude more;
* the float64 product of x and the dequantized weight, within x's rounding, ``|xq dx / 128 - x| <= dx / 256`` an
  element (and ``x / dx``'s float32 rounding, under ``2^-16`` of ``dx / 128`` here): ``(1/256 + 2^-23) sum_g dx_g
  sum_k |s_g v_k|``, plus the float bound above.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
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


def _random_packed5(n: int, k: int, offsets: bool, seed: int) -> QuantizedWeight:
    """A 5-bit weight of blocks of 32 with every byte and fifth bit random: Q5_1's form (zero 0, offsets) or Q5_0's
    (zero 16)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    high = torch.randint(-(2**31), 2**31, (n, k // quant.BLOCK), generator=gen, dtype=torch.int64).to(torch.int32)
    scale = torch.rand(n, k // quant.BLOCK, generator=gen) * 0.02 + 1e-4
    offset = (torch.rand(n, k // quant.BLOCK, generator=gen) - 0.5) * 0.1 if offsets else None
    return QuantizedWeight(q, scale, offset, kind="Q5_1" if offsets else "Q5_0", zero=0 if offsets else 16, high=high)


# Every packed format: (kind, its random weight of n output rows and k values a row).
PACKED_KINDS = {
    "Q4_0": lambda n, k, seed: _random_packed(n, k, False, seed),
    "Q4_1": lambda n, k, seed: _random_packed(n, k, True, seed),
    "Q5_0": lambda n, k, seed: _random_packed5(n, k, False, seed),
    "Q5_1": lambda n, k, seed: _random_packed5(n, k, True, seed),
}


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


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x rounded per block of 32 as the int8 GEMM does, in float32 as it computes: (``xq = 128 high + low``
    ``[M, G, 32]``, integers, and its unit ``dx / 128`` ``[M, G]``)."""
    m, k = x.shape
    blocks = x.reshape(m, k // quant.BLOCK, quant.BLOCK)
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    u = blocks * inverse.unsqueeze(-1)
    high = torch.round(u)  # to nearest even, as vcvtps2dq
    low = torch.round((u - high) * 128)
    assert high.abs().max() <= 127 and low.abs().max() <= 64
    return high * 128 + low, dx / 128


def _assert_int8_gemm(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """``y`` is the int8 GEMM's ``x @ W.T (+ bias)``: the product with x's rounding ``xq`` to float32 rounding, and
    the float64 product of x and the dequantized weight to x's rounding (the bounds: the module's docstring)."""
    n, k = w.q.shape[0], w.columns
    groups = k // quant.BLOCK
    xq, unit = _int8_rows(x)
    v = w.widen().q.double().view(n, groups, quant.BLOCK)
    sums = torch.einsum("mgk,ngk->mng", xq.double(), v)  # the exact int32 sums
    terms = w.scale.double() * unit.double().unsqueeze(1) * sums  # [M, N, G]
    magnitude = terms.abs().sum(-1)
    exact_xq = terms.sum(-1)
    if w.offset is not None:
        xsum = x.double().view(-1, groups, quant.BLOCK)
        exact_xq += xsum.sum(-1) @ w.offset.double().t()
        magnitude += xsum.abs().sum(-1) @ w.offset.double().abs().t()
    if bias is not None:
        exact_xq += bias.double()
        magnitude += bias.double().abs()
    rounding = (2 * groups + 35) * U * magnitude + torch.finfo(torch.float32).tiny
    excess = (y.double() - exact_xq).abs() - rounding
    assert excess.max().item() <= 0, f"off the product with xq beyond float32 rounding by {excess.max().item()}"
    exact = x.double() @ w.dequantize().double().t() + (bias.double() if bias is not None else 0)
    steps = 128 * unit.double() @ (w.scale.double().abs().unsqueeze(-1) * v.abs()).sum(-1).t()  # sum dx sum |s v|
    excess = (y.double() - exact).abs() - ((1 / 256 + 2.0**-23) * steps + rounding)
    assert excess.max().item() <= 0, f"off the float product beyond x's rounding by {excess.max().item()}"


def _assert_linear(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """``y = quant.linear(x, w, bias)`` within the bound of the path that made it."""
    if quant._path(w, x.shape[0], quant._ops()) == "int8":
        _assert_int8_gemm(y, x, w, bias)
    else:
        _assert_within_bound(y, x, w.dequantize(), bias, _terms(w))


@pytest.mark.parametrize(
    ("k", "groups", "offsets"), [(37, 1, False), (576, 1, False), (577, 1, False), (1536, 48, True), (64, 2, False)]
)
def test_kernel_is_the_float_math_of_the_dequantized_weight(k: int, groups: int, offsets: bool) -> None:
    w = _random_weight(96, k, groups, offsets, seed=k)
    bias = torch.randn(96)
    for rows in [*range(1, 17), 17, 40]:  # blocks: the int8 GEMM from INT8_ROWS rows (tiles past 16 without it)
        x = torch.randn(rows, k)
        _assert_linear(quant.linear(x, w, None), x, w, None)
        _assert_linear(quant.linear(x, w, bias), x, w, bias)


def _int8_gemm_here() -> int:
    """Rows from which the int8 GEMM runs here (skips where it is not built)."""
    rows = quant._int8_rows()
    if rows is None:
        pytest.skip("the int8 GEMM is built for AVX512BW hosts only")
    return rows


# Output rows that fill 1, some and no whole panel of 48; rows of 2, 3, 18, 48 blocks (one block and no offset is
# a weight per channel: the float kernel).
INT8_SHAPES = [(1, 64), (47, 96), (97, 576), (50, 1536)]


@pytest.mark.parametrize("kind", [*PACKED_KINDS, "int8 blocks", "int8 blocks, offsets"])
@pytest.mark.parametrize(("n", "k"), INT8_SHAPES)
def test_many_rows_of_a_weight_of_blocks_are_its_product_with_rounded_rows(n: int, k: int, kind: str) -> None:
    first = _int8_gemm_here()
    if kind in PACKED_KINDS:
        w = PACKED_KINDS[kind](n, k, n * k)
    else:
        w = _random_weight(n, k, k // quant.BLOCK, kind.endswith("offsets"), seed=n * k)
    bias = torch.randn(n)
    for rows in (first, first + 1, first + 2, 16, 19, 70):  # passes of 4 rows of x and 1, 2, 3 rows left over
        x = torch.randn(rows, k) * torch.rand(rows, 1) * 10  # rows of other magnitudes
        for b in (None, bias):
            y = quant.linear(x, w, b)
            _assert_int8_gemm(y, x, w, b)
            assert torch.equal(y, quant.linear(x, w.widen(), b)), rows  # packed: its widened weight's results
            assert torch.equal(y[1:2], quant.linear(x[1:2].repeat(rows, 1), w, b)[:1])  # each row on its own


def test_the_int8_gemm_keeps_zero_rows_outliers_and_strided_rows() -> None:
    _int8_gemm_here()
    w = _random_packed(49, 128, True, seed=3)
    bias = torch.randn(49)
    x = torch.randn(6, 256)[:, ::2]  # rows 256 apart, not contiguous
    x[0] = 0  # dx = 0: the row is the bias alone
    x[1, 40] = 1e6  # an outlier: its block's other values round to 0, the other blocks keep their own units
    x[2, :32] = 1e-3
    y = quant.linear(x, w, bias)
    assert torch.equal(y[0], bias)
    _assert_int8_gemm(y, x.contiguous(), w, bias)


def test_a_row_with_inf_or_nan_gives_nan_outputs_and_leaves_the_others() -> None:
    """x is rounded by its block's largest value: a block that is not finite makes its row's outputs NaN (a float
    product's would be inf or NaN), never finite numbers made from saturated bytes."""
    first = _int8_gemm_here()
    w = _random_packed(50, 96, True, seed=6)
    x = torch.randn(first + 2, 96)
    x[1, 5], x[2, 70] = float("inf"), float("nan")
    y = quant.linear(x, w)
    assert y[1].isnan().all() and y[2].isnan().all()
    rest = torch.tensor([r for r in range(x.shape[0]) if r not in (1, 2)])
    assert torch.equal(y[rest], quant.linear(x[rest], w))  # the same rows without them
    _assert_int8_gemm(y[rest], x[rest], w, None)


def _build_folder(name: str, key: str) -> Path:
    """Where a test's build of the quantized kernels for another instruction set goes: beside the kernels' own
    builds, under the key of its sources and flags, so a later run with the same sources compiles nothing."""
    folder = native.cache_dir() / "tests" / f"{name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.slow
def test_the_int8_gemm_built_without_vnni_forms_the_same_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built for AVX512BW without VNNI (x86-64-v4: vpmaddubsw and vpmaddwd for vpdpbusd, int8 values as their two
    nibbles), the int8 GEMM forms the same int32 sums, so its results are the VNNI build's bit for bit."""
    if quant._ops() is None or quant._ops().quant_int8_dot() != 2:
        pytest.skip("needs a host with AVX512-VNNI to compare against")
    from torch.utils import cpp_extension

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # ninja
    name = "dejavu_quant_without_vnni"
    folder = _build_folder(name, native.build_key())
    cpp_extension.load(
        name=name,
        sources=[str(native.QUANT_SOURCE), str(native.QUANT_GEMM_SOURCE)],
        extra_cflags=[*native.compile_flags(), "-mno-avx512vnni"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    error = ctypes.create_string_buffer(512)
    library = ctypes.CDLL(str(folder / f"{name}.so"))
    assert library.dejavu_quant_register(name.encode(), error, ctypes.c_int64(len(error))) == 0, error.value
    emulated, vnni = getattr(torch.ops, name), quant._ops()
    assert emulated.quant_int8_dot() == 1
    full_range = QuantizedWeight(
        torch.randint(-128, 128, (50, 96), dtype=torch.int8), torch.rand(50, 3), torch.randn(50, 3), kind="test"
    )
    packed = [make(50, 96, seed) for seed, make in enumerate(PACKED_KINDS.values())]
    for w in (*packed, full_range):
        x, bias = torch.randn(37, 96), torch.randn(50)
        assert torch.equal(
            emulated.quant_gemm(x, w.q, w.scale, w.offset, bias, w.zero, w.high),
            vnni.quant_gemm(x, w.q, w.scale, w.offset, bias, w.zero, w.high),
        )


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_the_float_kernels_avx2_and_scalar_builds_unpack_packed_values_bit_for_bit(
    march: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built for AVX2 (8 lanes, the fifth bits by a shift a lane) and for no SIMD at all (a value at a time), the
    float kernel and the dequantization compute each packed weight as they compute it widened to int8, bit for
    bit, at every row count a decode step takes."""
    if "avx2" not in native._cpu_flag_set():
        pytest.skip("needs an AVX2 host")
    from torch.utils import cpp_extension

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # ninja
    name = f"dejavu_quant_{march.replace('-', '_')}"
    folder = _build_folder(name, native.build_key(march))
    cpp_extension.load(
        name=name,
        sources=[str(native.QUANT_SOURCE), str(native.QUANT_GEMM_SOURCE)],
        extra_cflags=list(native.compile_flags(march)),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    error = ctypes.create_string_buffer(512)
    library = ctypes.CDLL(str(folder / f"{name}.so"))
    assert library.dejavu_quant_register(name.encode(), error, ctypes.c_int64(len(error))) == 0, error.value
    op = getattr(torch.ops, name)
    assert op.quant_lanes() == (8 if march == "x86-64-v3" else 1)
    for kind, make in PACKED_KINDS.items():
        for n, k in PACKED_SHAPES:
            w = make(n, k, n + k)
            wide = w.widen()
            bias = torch.randn(n)
            dense = op.quant_dequantize4(w.q, w.scale, w.offset, w.zero, 0, n, w.high)
            assert torch.equal(dense, op.quant_dequantize(wide.q, w.scale, w.offset, 0, n)), kind
            assert torch.equal(dense, quant._dequantize_rows(wide.q, w.scale, w.offset)), kind
            for rows in (1, 2, 5, 16):
                x = torch.randn(rows, k)
                y = op.quant_linear4(x, w.q, w.scale, w.offset, bias, w.zero, w.high)
                assert torch.equal(y, op.quant_linear(x, wide.q, w.scale, w.offset, bias)), (kind, n, k, rows)
                _assert_within_bound(y, x, dense, bias, _terms(w))


def test_many_rows_of_a_weight_of_blocks_never_dequantize_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight stays as it is held: no float32 copy, not even a tile, whatever the number of rows."""
    first = _int8_gemm_here()
    weights = [
        _random_packed(quant.TILE_ROWS + 40, 64, True, seed=8),
        _random_packed5(quant.TILE_ROWS + 40, 64, False, seed=8),
        _random_weight(300, 64, 2, False, seed=8),
    ]

    def refused(self: QuantizedWeight, rows: tuple[int, int] | None = None) -> torch.Tensor:
        raise AssertionError("dequantized")

    monkeypatch.setattr(QuantizedWeight, "dequantize", refused)
    for w in weights:
        for rows in (first, 64, 300):
            assert quant.linear(torch.randn(rows, 64), w).shape == (rows, w.shape[0])


def test_a_few_rows_keep_the_float_kernel() -> None:
    """Below INT8_ROWS a decode step's rows are not rounded: the float kernel's bound, far tighter than x's rounding."""
    w = _random_packed(64, 96, True, seed=4)
    for rows in range(1, quant._int8_rows() or quant.DECODE_ROWS):
        assert quant._path(w, rows, quant._ops()) == "kernel"
        x = torch.randn(rows, 96)
        _assert_within_bound(quant.linear(x, w), x, w.dequantize(), None, _terms(w))


# Odd shapes: rows of 1, 3 and 19 blocks, output rows that leave a part of the kernel's block of weight rows.
PACKED_SHAPES = [(1, 32), (7, 96), (37, 608), (97, 1536)]


@pytest.mark.parametrize("kind", list(PACKED_KINDS))
@pytest.mark.parametrize(("n", "k"), PACKED_SHAPES)
def test_a_packed_weight_computes_its_widened_weight_bit_for_bit(n: int, k: int, kind: str) -> None:
    w = PACKED_KINDS[kind](n, k, n + k)
    wide = w.widen()
    assert wide.q.dtype == torch.int8 and wide.q.shape == (n, k) and wide.shape == w.shape == (n, k)
    assert wide.q.min() >= -w.zero and wide.q.max() <= 2**w.bits - 1 - w.zero
    bias = torch.randn(n)
    for rows in (1, 2, 5, 16, 40):  # the float kernel, the int8 GEMM (dequantized tiles past 16 without it)
        x = torch.randn(rows, k)
        for b in (None, bias):
            y = quant.linear(x, w, b)
            assert torch.equal(y, quant.linear(x, wide, b)), (rows, b is not None)
            _assert_linear(y, x, w, b)


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


def test_packed_fifth_bits_are_in_ggufs_order() -> None:
    """Bit i of a block's 32-bit mask is the fifth bit of the block's value i (bits 0-15: its low nibbles' values,
    16-31: its high nibbles'), bit 31 included (the mask held as int32 is then negative)."""
    q = torch.zeros(1, 32, dtype=torch.uint8)
    q[0, :16] = torch.arange(16, dtype=torch.uint8) | (15 - torch.arange(16, dtype=torch.uint8)) << 4
    q[0, 16:] = 0x5A
    first = torch.tensor([0, 3, 15, 16, 17, 31])  # bits of block 0
    mask = sum(1 << int(i) for i in first)
    high = torch.tensor([[mask - 2**32, 0x0000FFFF]], dtype=torch.int32)  # block 1: its low nibbles' bits
    w = QuantizedWeight(q, torch.ones(1, 2), None, kind="Q5_0", zero=16, high=high)
    nibbles = torch.cat([torch.arange(16), 15 - torch.arange(16), torch.full((16,), 10), torch.full((16,), 5)])
    fifth = torch.zeros(64, dtype=torch.int64)
    fifth[first] = 16
    fifth[32:48] = 16
    expected = nibbles + fifth - 16
    assert torch.equal(w.widen().q[0], expected.to(torch.int8))
    assert torch.equal(w.dequantize()[0], expected.float())
    for value in (0, 1, 17, 18, 31, 40, 50):
        x = torch.zeros(1, 64)
        x[0, value] = 1.0
        assert quant.linear(x, w).item() == expected[value].item(), value
    assert torch.equal(F.embedding(torch.tensor([0]), w)[0], expected.float())


def test_packed_dequantization_is_the_widened_weights_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    for seed, make in enumerate(PACKED_KINDS.values()):
        w = make(70, 576, seed)
        reference = w.widen().dequantize()
        assert torch.equal(w.dequantize(), reference)
        assert torch.equal(w.dequantize((10, 33)), reference[10:33])
        assert torch.equal(w.dense(), reference) and torch.equal(w.t().dense(), reference.t())
        with monkeypatch.context() as patch:  # without the kernels: torch's unpacking, the same values
            patch.setattr(quant, "_ops", lambda: None)
            assert torch.equal(w.dequantize((3, 70)), reference[3:])
            x = torch.randn(3, 576)
            assert torch.equal(quant.linear(x, w), quant.linear(x, w.widen()))


@pytest.mark.parametrize("kind", list(PACKED_KINDS))
def test_a_packed_weight_stands_where_a_dense_one_does(kind: str) -> None:
    q_proj, k_proj = PACKED_KINDS[kind](64, 96, 21), PACKED_KINDS[kind](33, 96, 22)
    fused = torch.cat([q_proj, k_proj])  # a fused projection stays packed
    assert fused.packed and fused.shape == (97, 96) and fused.zero == q_proj.zero and fused.bits == q_proj.bits
    wide = torch.cat([q_proj.widen(), k_proj.widen()])
    assert torch.equal(fused.widen().q, wide.q)
    x = torch.randn(5, 96)
    assert torch.equal(F.linear(x, fused), F.linear(x, wide))
    many = torch.randn(40, 96)  # the int8 GEMM (dequantized tiles without it)
    assert torch.equal(F.linear(many, fused), F.linear(many, wide))
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
    other = "Q4_1" if kind.startswith("Q5") else "Q5_1"  # 4-bit and 5-bit values: the dense tensor too
    mixed = torch.cat([q_proj, PACKED_KINDS[other](33, 96, 23)])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (97, 96)


def test_a_packed_weight_holds_half_the_bytes_of_its_values() -> None:
    w = _random_packed(48, 320, True, seed=5)
    assert w.numel() == 48 * 320 and w.nbytes == 48 * 160 + 2 * 48 * 10 * 4
    assert w.numel() * w.element_size() == w.nbytes and w.widen().nbytes == w.nbytes + 48 * 160
    assert w.group == 32 and "packed 4-bit" in repr(w)


def test_a_packed_5_bit_weight_holds_its_nibbles_and_a_word_of_fifth_bits_a_block() -> None:
    for offsets in (False, True):
        w = _random_packed5(48, 320, offsets, seed=5)
        scales = (2 if offsets else 1) * 48 * 10 * 4
        assert w.numel() == 48 * 320 and w.nbytes == 48 * 160 + 48 * 10 * 4 + scales  # 0.75 / 0.875 bytes a value
        assert w.numel() * w.element_size() == w.nbytes and w.widen().nbytes == 48 * 320 + scales
        assert w.bits == 5 and w.widen().bits == 8 and "packed 5-bit" in repr(w)


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
    high = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="fifth bits"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), high=high[:, :1])
    with pytest.raises(ValueError, match="int32 mask a block"):
        QuantizedWeight(q, torch.ones(2, 2), zero=16, high=high.to(torch.int64))
    with pytest.raises(ValueError, match="int32 mask a block"):
        QuantizedWeight(q, torch.ones(2, 2), zero=16, high=high[:, :1])
    with pytest.raises(ValueError, match="0 to 31"):
        QuantizedWeight(q, torch.ones(2, 2), zero=32, high=high)
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
    with pytest.raises(RuntimeError, match="fifth bits"):
        op.quant_linear4(torch.randn(1, 64), q, torch.ones(2, 2), None, None, 16, high[:, :1])
    with pytest.raises(RuntimeError, match="fifth bits"):
        op.quant_dequantize4(q, torch.ones(2, 2), None, 16, 0, 2, high.to(torch.int64))
    with pytest.raises(RuntimeError, match="within \\[0, 31\\]"):
        op.quant_linear4(torch.randn(1, 64), q, torch.ones(2, 2), None, None, 32, high)
    if quant._int8_rows() is not None:
        with pytest.raises(RuntimeError, match="scale a block of 32"):
            op.quant_gemm(torch.randn(3, 64), q, torch.ones(2, 1), None, None, 8)
        with pytest.raises(RuntimeError, match="columns"):
            op.quant_gemm(torch.randn(3, 32), q, torch.ones(2, 2), None, None, 8)
        with pytest.raises(RuntimeError, match="int8 values take none"):
            op.quant_gemm(torch.randn(3, 32), torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), None, None, 8)
        with pytest.raises(RuntimeError, match="multiple of 32"):
            op.quant_gemm(torch.randn(3, 24), torch.zeros(2, 24, dtype=torch.int8), torch.ones(2, 1), None, None, 0)
        with pytest.raises(RuntimeError, match="fifth-bit mask"):
            op.quant_gemm(torch.randn(3, 64), q, torch.ones(2, 2), None, None, 16, high[:, :1])
        with pytest.raises(RuntimeError, match="fifth-bit mask"):  # int8 values take no fifth bits
            op.quant_gemm(torch.randn(3, 32), torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), None, None, 0,
                          high[:, :1])  # fmt: skip
        with pytest.raises(RuntimeError, match="within \\[0, 31\\]"):
            op.quant_gemm(torch.randn(3, 64), q, torch.ones(2, 2), None, None, 40, high)


def test_without_the_int8_gemm_many_rows_of_a_tall_weight_of_blocks_go_through_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quant, "_int8_rows", lambda: None)  # an AVX2 or scalar build
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
    _assert_linear(y.reshape(15, 40), x.reshape(15, 64), w, None)


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
