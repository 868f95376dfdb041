"""Weight-only quantized weights, kept quantized in memory: int8, 4-bit or 5-bit values with float32 scales per group.

A :class:`QuantizedWeight` is a 2-D weight ``W [N, K]`` held as values ``v [N, K]``, float32 scales ``scale [N,
G]`` and optional float32 offsets ``offset [N, G]``: ``W[n, k] = scale[n, g] * v[n, k] (+ offset[n, g])`` with
``g = k // (K // G)``. ``N`` is the output dimension (``F.linear``'s ``[out, in]``). The values ``q`` are held
one of three ways:

* **int8**, one a byte: ``q`` int8 ``[N, K]``, ``v = q``.
* **4-bit, packed** two a byte in blocks of :data:`BLOCK` values, a scale (and offset) a block: ``q`` uint8
  ``[N, K / 2]``, 16 bytes a block, byte ``i`` of a block holding the block's value ``i`` in its low nibble and
  value ``i + 16`` in its high nibble (GGUF's own order for Q4_0 and Q4_1: the file's bytes as they are), and
  ``v = nibble - zero`` (:attr:`~QuantizedWeight.zero`: 8 for Q4_0, 0 for Q4_1). A block's low nibbles are its
  first 16 values, so the kernel unpacks whole registers of consecutive values with a mask or a shift.
* **5-bit, packed** as GGUF packs Q5_0 and Q5_1: each value's low 4 bits as the 4-bit layout's nibbles (``q``
  uint8 ``[N, K / 2]``) and its fifth bit in a 32-bit mask a block, ``high`` int32 ``[N, K / 32]`` (bit ``i`` of
  a block's mask: its value ``i``'s fifth bit; the file's little-endian word as it is), ``v = (nibble | bit << 4)
  - zero`` (16 for Q5_0, 0 for Q5_1). Bits 0-15 of a mask go with the block's low nibbles and bits 16-31 with its
  high ones, so a register of consecutive values takes its fifth bits from one shift of the mask.

Formats that use it:

* **int8 per output channel** (``G = 1``, no offset): symmetric, ``scale = max|W[n]| / 127`` (:func:`quantize`);
  a prepared ``int8`` checkpoint stores it (``<name>`` int8 and ``<name>_scale``: :mod:`dejavu_engine.weights`).
* **GGUF blocks** of 32 (:mod:`dejavu_engine.gguf_file`): Q8_0, Q4_0, Q5_0 (symmetric) and Q4_1, Q5_1 (a
  per-block minimum as offset), their float16 scales widened to float32. Q4_0, Q4_1, Q5_0 and Q5_1 stay packed
  (0.625, 0.75, 0.75 and 0.875 bytes a weight held with the float32 scales and minimums, against 0.5625, 0.625,
  0.6875 and 0.75 in the file; widened to int8 they would hold 1.125, 1.25, 1.125, 1.25); Q8_0 is int8 as
  published. All lossless: the weights are the published file's exactly.

:func:`linear` multiplies rows by it in one of three ways (:func:`_path`):

* the **in-register kernel** (``csrc/quant.cpp``), which widens (and unpacks) each weight to float32 in registers
  and reads each byte once: always for per-channel int8, and for a weight of blocks below :data:`INT8_ROWS` rows
  (a decode step of a few rows). Its arithmetic is that of ``x @ dequantize(W).T`` in float32 (the scales and
  offsets distributed; another summation order than a float GEMM's).
* the **int8 GEMM** (``csrc/quant_gemm.cpp``, built for AVX512BW hosts) for a weight of blocks of 32 from
  :data:`INT8_ROWS` rows on (wider decode batches, prefills, prompt chunks: compute-bound). ``x`` is rounded per
  row per block to 15 bits in two int8 parts, ``x ~ dx * (high + low / 128)`` with ``dx = max|x| / 127`` (``high``
  is llama.cpp's q8_0 of x; ``low``, in [-64, 64], the rest), and each block's ``xq . v`` (``xq = 128 high + low``)
  is an exact int32 sum of int8 dot products (AVX512-VNNI), scaled once: ``y = sum_blocks d * dx / 128 * (xq . v)
  + m * sum(x)``. The weight stays as it is held (packed nibbles, with their fifth bits, or int8), unpacked a panel
  of output rows at a time into a cache-resident scratch. Against the float product its only extra error is x's
  rounding, ``|xq * dx / 128 - x| <= dx / 256`` an element (tests/engine/test_quant.py holds it to that): q8_0
  alone (``dx / 2``) moved the default model's logits by up to 3.3 and 7% of its greedy tokens (read after
  float32's); the low part, which doubles the dot products, keeps them float32's (``dejavu bench quant``).
* **dequantized tiles** where the int8 GEMM is not built (AVX2 and scalar hosts) past :data:`DECODE_ROWS` rows:
  float32 tiles of :data:`TILE_ROWS` output rows, each multiplied by torch's GEMM.

Without the kernels every call dequantizes first. An activation of another dtype is multiplied in float32 and
rounded back. A packed weight computes exactly what the same weight widened to int8 (:meth:`QuantizedWeight.widen`)
computes, bit for bit, on every path: the kernels form the same products (the int8 GEMM the same integer sums) in
the same order.

A QuantizedWeight stands where a family has a dense weight: :mod:`dejavu_engine.gemm` routes ``linear`` /
``residual_linear`` here, and it implements torch's ``__torch_function__`` protocol so the families' direct
``F.linear``, ``torch.addmm`` (GPT-2's Conv1D, on a :attr:`transposed` weight), ``F.embedding`` (rows
dequantized on lookup) and ``torch.cat`` (fusing projections: per-row scales concatenate) take it unchanged;
any other torch function gets the dequantized tensor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine import native

log = logging.getLogger("dejavu.engine.quant")

# Rows up to which a weight of blocks (GGUF) goes through the in-register kernel where the int8 GEMM is not built;
# more dequantize tiles for torch's GEMM (measured, 1 thread: even at 32 rows, Q4_1 3072 x 576 kernel 1.55 ms, tiles
# 1.47 ms). Per-channel int8 always takes the kernel (16 to 256 rows: 0.35 / 0.82, 1.45 / 2.59, 6.39 / 9.58 ms).
DECODE_ROWS = 16
# Rows from which a weight of blocks goes through the int8 GEMM (csrc/quant_gemm.cpp) where it is built, by its dot
# product. Measured as a decode step meets them, weights out of cache: 60 of SmolLM2's Q4_1 projections in turn (3072
# x 576 and 576 x 1536, 40 MB, over the 32 MB L3), 1 thread, Zen 5, float kernel / int8 GEMM, ms: with AVX512-VNNI
# 1 row 4.2 / 7.5, 3 rows 5.9 / 8.0, 4 rows 7.6 / 9.1, 5 rows 10.6 / 9.7, 8 rows 17.1 / 10.7, 16 rows 31 / 14; built
# without VNNI (vpmaddubsw + vpmaddwd) 5 rows 11.3 / 12.7, 6 rows 13.7 / 13.8, 8 rows 19.5 / 15.2. (With the weights
# in cache the int8 GEMM is ahead from 3 rows; unpacking a panel costs about what the float kernel's whole pass of a
# row does, which a few rows do not repay.) Fewer rows keep the float kernel, and x is not rounded.
INT8_ROWS = 5
INT8_ROWS_WITHOUT_VNNI = 8
TILE_ROWS = 256  # output rows of a weight dequantized at a time for many rows (a few hundred KiB: cache-resident)
INT8_MAX = 127
BLOCK = 32  # values of a block of packed 4-bit or 5-bit values (GGUF's block), their nibbles two a byte
_HALF = BLOCK // 2  # bytes a packed block: value i in byte i's low nibble, value i + 16 in its high one


class QuantizedWeight:
    """A 2-D weight kept as int8 or packed 4-bit or 5-bit values and float32 scales (and offsets) per group of each
    output row (the layouts: the module's docstring).

    ``transposed``: the logical tensor is ``[K, N]`` (HF's Conv1D stores ``[in, out]``); ``q`` stays ``[N, K]``
    (``[N, K / 2]`` packed). ``kind`` names the format (``"int8"``, ``"Q4_1"``, ...); ``zero`` is what a packed
    value is less (0 for int8 values); ``high``, for 5-bit values, their fifth bits (int32 ``[N, K / 32]``, a mask
    a block). Immutable; :meth:`t` and :meth:`split` share ``q``'s memory.
    """

    _base = None  # no dense tensor underneath (what stages check of packed weights' views)
    is_mkldnn = False

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor | None = None,
        transposed: bool = False,
        kind: str = "int8",
        zero: int = 0,
        high: torch.Tensor | None = None,
    ) -> None:
        if q.dtype not in (torch.int8, torch.uint8) or q.dim() != 2:
            raise ValueError(
                f"quantized values must be a 2-D int8 (or packed 4-bit uint8) tensor, got {q.dtype} {tuple(q.shape)}"
            )
        if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != q.shape[0]:
            raise ValueError(f"scales must be float32 [{q.shape[0]}, groups], got {scale.dtype} {tuple(scale.shape)}")
        if q.dtype == torch.uint8:
            if q.shape[1] % _HALF or scale.shape[1] * _HALF != q.shape[1]:
                raise ValueError(
                    f"packed 4-bit values come in blocks of {BLOCK} with a scale each: {q.shape[1]} bytes a row "
                    f"need {q.shape[1] // _HALF} scales, got {scale.shape[1]}"
                )
            if high is not None and (high.dtype != torch.int32 or high.shape != scale.shape):
                raise ValueError(
                    f"5-bit values' fifth bits are an int32 mask a block [{q.shape[0]}, {scale.shape[1]}], "
                    f"got {high.dtype} {tuple(high.shape)}"
                )
            if high is not None and not 0 <= zero <= 31:
                raise ValueError(f"a packed 5-bit value's zero is within 0 to 31, got {zero}")
            if high is None and not 0 <= zero <= 15:
                raise ValueError(f"a packed value's zero is a nibble (0 to 15), got {zero}")
        elif zero != 0 or high is not None:
            raise ValueError(f"int8 values take no zero nor fifth bits, got zero {zero}")
        if scale.shape[1] < 1 or q.shape[1] % scale.shape[1]:
            raise ValueError(f"{scale.shape[1]} groups do not divide a row of {q.shape[1]} values")
        if offset is not None and (offset.dtype != torch.float32 or offset.shape != scale.shape):
            raise ValueError("offsets must be float32 and shaped like the scales")
        self.q = q.contiguous()
        self.scale = scale.contiguous()
        self.offset = offset.contiguous() if offset is not None else None
        self.transposed = transposed
        self.kind = kind
        self.zero = zero
        self.high = high.contiguous() if high is not None else None

    @classmethod
    def from_stored(cls, q: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
        """An int8 per-channel weight as a checkpoint stores it: ``q`` in the weight's own layout and ``scale``
        ``[out, 1]`` (``[out, in]`` weight) or ``[1, out]`` (``[in, out]``, transposed), ``W = q * scale``."""
        scale = scale.to(torch.float32)
        if q.dim() == 2 and scale.shape == (q.shape[0], 1):
            return cls(q, scale)
        if q.dim() == 2 and scale.shape == (1, q.shape[1]):
            return cls(q.t().contiguous(), scale.t().contiguous(), transposed=True)
        raise ValueError(
            f"an int8 weight {tuple(q.shape)} needs a scale [out, 1] or [1, out], got {tuple(scale.shape)}"
        )

    def to_stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scale)`` as :meth:`from_stored` reads them (int8 per channel only)."""
        if self.offset is not None or self.scale.shape[1] != 1 or self.packed:
            raise ValueError(f"only int8 per-channel weights are stored this way, not {self.kind}")
        if self.transposed:
            return self.q.t().contiguous(), self.scale.t().contiguous()
        return self.q, self.scale

    # --- the tensor facts stages and planners read ---------------------------------------------------------
    @property
    def packed(self) -> bool:
        """Whether the values are packed, 4-bit or 5-bit (else int8)."""
        return self.q.dtype == torch.uint8

    @property
    def bits(self) -> int:
        """Bits a value: 8 (int8), 4 or 5 (packed)."""
        return 8 if not self.packed else 5 if self.high is not None else 4

    @property
    def columns(self) -> int:
        """``K``: values a row (an ``[out, in]`` weight's ``in``)."""
        return self.q.shape[1] * 2 if self.packed else self.q.shape[1]

    @property
    def shape(self) -> torch.Size:
        n, k = self.q.shape[0], self.columns
        return torch.Size((k, n) if self.transposed else (n, k))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in (float32)."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        """Bytes held: values (and fifth bits), scales and offsets."""
        extra = self.offset.nbytes if self.offset is not None else 0
        fifth = self.high.nbytes if self.high is not None else 0
        return self.q.nbytes + fifth + self.scale.nbytes + extra

    @property
    def group(self) -> int:
        """Values per scale along a row (``K`` for per-channel int8)."""
        return self.columns // self.scale.shape[1]

    def numel(self) -> int:
        return self.q.shape[0] * self.columns

    def element_size(self) -> float:
        """Bytes per weight, scales included, so ``numel() * element_size()`` is :attr:`nbytes`."""
        return self.nbytes / max(self.numel(), 1)

    def dim(self) -> int:
        return 2

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def contiguous(self) -> QuantizedWeight:
        return self

    def t(self) -> QuantizedWeight:
        return QuantizedWeight(self.q, self.scale, self.offset, not self.transposed, self.kind, self.zero, self.high)

    @property
    def T(self) -> QuantizedWeight:  # noqa: N802 (torch's name)
        return self.t()

    def split(self, sizes: Sequence[int], dim: int = 0) -> tuple[QuantizedWeight, ...]:
        """Output rows in parts (views of the same memory), as ``Tensor.split`` on a fused ``[out, in]`` weight."""
        if self.transposed or dim != 0:
            raise ValueError("a quantized weight splits along its output rows only")
        parts = zip(self.q.split(list(sizes)), self.scale.split(list(sizes)), strict=True)
        offsets = self.offset.split(list(sizes)) if self.offset is not None else [None] * len(sizes)
        highs = self.high.split(list(sizes)) if self.high is not None else [None] * len(sizes)
        return tuple(
            QuantizedWeight(q, s, o, False, self.kind, self.zero, h)
            for (q, s), o, h in zip(parts, offsets, highs, strict=True)
        )

    def widen(self) -> QuantizedWeight:
        """The same weight with its values as int8, one a byte (itself where they are): what a packed weight's
        kernels compute is what this one's compute, bit for bit."""
        if not self.packed:
            return self
        values = _values(self.q, self.zero, self.high)
        return QuantizedWeight(values, self.scale, self.offset, self.transposed, self.kind)

    def __repr__(self) -> str:
        packed = f", packed {self.bits}-bit" if self.packed else ""
        return f"QuantizedWeight({self.kind}, shape={tuple(self.shape)}, group={self.group}{packed})"

    # --- the math ------------------------------------------------------------------------------------------
    def dequantize(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 weight ``[N, K]`` (not transposed), or its output rows ``[a, b)``: each value ``scale * q``
        rounded, then ``+ offset`` (numpy's and gguf's order: their values bit for bit)."""
        first, last = rows if rows is not None else (0, self.q.shape[0])
        op = _ops()
        if op is not None and self.device.type == "cpu":
            if self.packed:
                return op.quant_dequantize4(self.q, self.scale, self.offset, self.zero, first, last, self.high)
            return op.quant_dequantize(self.q, self.scale, self.offset, first, last)
        values = _values(self.q[first:last], self.zero, _rows(self.high, first, last))
        return _dequantize_rows(values, self.scale[first:last], _rows(self.offset, first, last))

    def dense(self) -> torch.Tensor:
        """The logical float32 tensor (``[K, N]`` when :attr:`transposed`)."""
        w = self.dequantize()
        return w.t() if self.transposed else w

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (an embedding lookup), dequantized: the dense matrix's rows bit for bit."""
        if self.transposed:
            raise ValueError("an embedding is looked up by its rows; this quantized weight is transposed")
        flat = ids.reshape(-1)
        offset = self.offset[flat] if self.offset is not None else None
        high = self.high[flat] if self.high is not None else None
        rows = _dequantize_rows(_values(self.q[flat], self.zero, high), self.scale[flat], offset)
        return rows.view(*ids.shape, self.columns)

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*_dense_args(args), **_dense_args(kwargs))


def quantize(weight: torch.Tensor, transposed: bool = False) -> QuantizedWeight:
    """Symmetric int8 per output channel of a float weight ``[out, in]`` (``[in, out]`` when ``transposed``):
    ``scale = max|row| / 127`` (1 for an all-zero row), ``q = round(W / scale)``."""
    w = (weight.t() if transposed else weight).to(torch.float32)
    if w.dim() != 2:
        raise ValueError(f"only 2-D weights quantize, got {tuple(weight.shape)}")
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scale.contiguous(), None, transposed, "int8")


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` over the last dimension of ``x`` for a (not transposed) quantized ``[out, in]`` weight;
    in float32, rounded to ``x``'s dtype. The native in-register kernel (per channel, or few rows), the int8 GEMM
    (a weight of blocks, :data:`INT8_ROWS` rows or more, where it is built), else dequantized tiles and torch's
    GEMM."""
    if weight.transposed:
        raise ValueError("linear takes an [out, in] weight; this quantized weight is transposed")
    n, k = weight.q.shape[0], weight.columns
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    b = bias.float() if bias is not None and bias.dtype != torch.float32 else bias
    op: Any = _ops() if x2.device.type == "cpu" else None
    path = _path(weight, x2.shape[0], op)
    if path == "tiles":
        y = _dequantized_linear(x2, weight)
        if b is not None:
            y += b
    else:
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        if path == "int8":
            y = op.quant_gemm(x2, weight.q, weight.scale, weight.offset, b, weight.zero, weight.high)
        elif weight.packed:
            y = op.quant_linear4(x2, weight.q, weight.scale, weight.offset, b, weight.zero, weight.high)
        else:
            y = op.quant_linear(x2, weight.q, weight.scale, weight.offset, b)
    return y.to(x.dtype).view(*x.shape[:-1], n)


def _path(weight: QuantizedWeight, rows: int, op: Any) -> str:
    """Which kernel multiplies ``rows`` rows by ``weight``: ``"kernel"`` (the float in-register kernel), ``"int8"``
    (the int8 GEMM, for weights of blocks of :data:`BLOCK`) or ``"tiles"`` (dequantized tiles, torch's GEMM)."""
    if op is None:
        return "tiles"
    if weight.scale.shape[1] == 1 and weight.offset is None:  # per channel
        return "kernel"
    int8_rows = _int8_rows()
    if int8_rows is not None and rows >= int8_rows and weight.group == BLOCK:
        return "int8"
    return "kernel" if rows <= DECODE_ROWS else "tiles"


@functools.cache
def _int8_rows() -> int | None:
    """Rows from which the int8 GEMM runs here (:data:`INT8_ROWS` with AVX512-VNNI, :data:`INT8_ROWS_WITHOUT_VNNI`
    on AVX512BW alone); None where the extension is not built with it."""
    op = _ops()
    dot = int(op.quant_int8_dot()) if op is not None else 0
    return {2: INT8_ROWS, 1: INT8_ROWS_WITHOUT_VNNI}.get(dot)


def _dequantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ W.T`` for many rows: :data:`TILE_ROWS` output rows of ``W`` dequantized at a time into a scratch
    that stays in cache, each multiplied by torch's GEMM into its columns of the result."""
    n = weight.q.shape[0]
    if n <= TILE_ROWS:
        return torch.mm(x, weight.dequantize().t())
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for first in range(0, n, TILE_ROWS):
        last = min(n, first + TILE_ROWS)
        torch.mm(x, weight.dequantize((first, last)).t(), out=y[:, first:last])
    return y


def residual_linear(
    residual: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``residual + x @ W.T (+ bias)``."""
    return residual + linear(x, weight, bias)


@functools.cache
def _ops() -> Any:
    """The extension's quantized operators (``torch.ops.<extension>``), registered on first use; None where the
    extension is not built or they do not register (the reason is logged)."""
    module = native.load()
    if module is None:
        return None
    library = ctypes.CDLL(module.__file__)  # the library Python loaded (dlopen of one path shares its handle)
    error = ctypes.create_string_buffer(512)
    if library.dejavu_quant_register(module.__name__.encode(), error, ctypes.c_int64(len(error))) != 0:
        log.warning("quantized kernels unavailable, quantized weights are dequantized a call: %s", error.value)
        return None
    return getattr(torch.ops, module.__name__)


def _rows(t: torch.Tensor | None, first: int, last: int) -> torch.Tensor | None:
    return t[first:last] if t is not None else None


def _values(q: torch.Tensor, zero: int, high: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 values ``[rows, K]`` of rows of values ``q``: themselves if int8, else unpacked from their nibbles
    (each block's low nibbles, then its high ones), with bit ``i`` of a block's ``high`` mask as value ``i``'s fifth
    bit where given, less ``zero``."""
    if q.dtype == torch.int8:
        return q
    rows, width = q.shape
    blocks = q.view(rows, width // _HALF, _HALF)
    values = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.int8)  # [rows, blocks, 32]
    if high is not None:
        fifth = (high.unsqueeze(-1) >> torch.arange(BLOCK, dtype=torch.int32)) & 1  # an arithmetic shift: bit 31 too
        values |= (fifth << 4).to(torch.int8)
    return values.view(rows, width * 2) - zero


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Torch's dequantization of rows (the kernel's arithmetic): ``scale * q``, rounded, then ``+ offset``."""
    rows, k = q.shape
    groups = scale.shape[1]
    w = q.view(rows, groups, k // groups).to(torch.float32) * scale.unsqueeze(-1)
    if offset is not None:
        w = w + offset.unsqueeze(-1)
    return w.view(rows, k)


def _dense_args(value: Any) -> Any:
    if isinstance(value, QuantizedWeight):
        return value.dense()
    if isinstance(value, (list, tuple)):
        return type(value)(_dense_args(v) for v in value)
    if isinstance(value, dict):
        return {key: _dense_args(v) for key, v in value.items()}
    return value


def _f_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> Any:
    if isinstance(weight, QuantizedWeight) and not weight.transposed and isinstance(x, torch.Tensor):
        return linear(x, weight, bias)
    return NotImplemented


def _addmm(bias: torch.Tensor, x: torch.Tensor, weight: Any, *, beta: float = 1, alpha: float = 1) -> Any:
    """``bias + x @ W`` with ``W`` a transposed quantized weight (Conv1D's ``[in, out]``)."""
    plain = beta == 1 and alpha == 1 and bias.dim() == 1 and x.dim() == 2
    if isinstance(weight, QuantizedWeight) and weight.transposed and plain:
        return linear(x, weight.t(), bias)
    return NotImplemented


def _mm(x: torch.Tensor, weight: Any) -> Any:
    if isinstance(weight, QuantizedWeight) and weight.transposed and isinstance(x, torch.Tensor):
        return linear(x, weight.t(), None)
    return NotImplemented


def _embedding(ids: torch.Tensor, weight: Any, padding_idx: Any = None, max_norm: Any = None, **_: Any) -> Any:
    """A lookup (``padding_idx`` and the rest concern training; ``max_norm`` would renormalise rows in place)."""
    if isinstance(weight, QuantizedWeight) and max_norm is None:
        return weight.embedding(ids)
    return NotImplemented


def _cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    """Output rows of quantized weights of one format stacked (a fused projection)."""
    parts = list(tensors)
    if dim != 0 or not all(isinstance(t, QuantizedWeight) and not t.transposed for t in parts):
        return NotImplemented
    first = parts[0]
    if any(t.kind != first.kind or t.scale.shape[1] != first.scale.shape[1] for t in parts):
        return NotImplemented
    if any(
        t.q.dtype != first.q.dtype or t.zero != first.zero or (t.high is None) != (first.high is None) for t in parts
    ):
        return NotImplemented
    if any((t.offset is None) != (first.offset is None) for t in parts):
        return NotImplemented
    offset = torch.cat([t.offset for t in parts]) if first.offset is not None else None  # type: ignore[misc]
    high = torch.cat([t.high for t in parts if t.high is not None]) if first.high is not None else None
    q, scale = torch.cat([t.q for t in parts]), torch.cat([t.scale for t in parts])
    return QuantizedWeight(q, scale, offset, False, first.kind, first.zero, high)


_HANDLERS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.linear: _f_linear,
    torch._C._nn.linear: _f_linear,
    torch.addmm: _addmm,
    torch.mm: _mm,
    torch.matmul: _mm,
    F.embedding: _embedding,
    torch.cat: _cat,
}
