"""Weight GEMMs: torch's default, or oneDNN with each weight packed once at load (the CPU seam).

A decode step multiplies a few rows by every weight of the model, so on a CPU it is bound by how
fast the weights stream from memory. torch's default (MKL) GEMM reads a row-major weight as it is;
oneDNN's ``mkldnn._linear_pointwise`` reads a copy reordered once, at load, into its own blocked
layout (what vLLM-CPU and Inductor's CPU backend run). Measured on this repository's 2-core AVX2 host,
SmolLM2-135M's 30 layers and head alone at 2 threads: 1 row 38.5 -> 22.7 ms, 4 rows 76 -> 29 ms,
16 rows 78 -> 50 ms, 64 rows 155 -> 131 ms per step (``dejavu bench engine`` measures whole steps).
The results differ from MKL's in the last bits only (another summation order), as between any two
GEMM libraries.

Packing applies on a CPU with oneDNN (``torch.backends.mkldnn``) to float32 weights, and to bfloat16
weights where oneDNN has bfloat16 kernels for the host (AVX-512 BF16 or AMX: ``torch.ops.mkldnn.
_is_mkldnn_bf16_supported``). There a bfloat16 GEMM reads half the bytes of a float32 one and accumulates
in float32, rounding its output once, as torch's own bfloat16 GEMM does (measured on an AVX-512 BF16
host, the model's GEMMs at 2 threads: 1 row 8.1 -> 4.8 ms, 16 rows 15.2 -> 8.6 ms, 64 rows 39.9 -> 21.1 ms
per step against float32 packed). Elsewhere (CUDA; bfloat16 on AVX2 hosts, where oneDNN would emulate
it) :func:`can_pack` is False and weights stay dense.
A packed weight is a ``torch.Tensor`` of layout ``torch._mkldnn`` (its ``numel``, ``element_size``,
``shape`` and ``dtype`` are the dense weight's), so stages account for it as for any other.

A :class:`~dejavu_engine.quant.QuantizedWeight` (int8 values and float32 scales, from a quantized checkpoint)
takes the place of a dense weight too: :func:`linear` and :func:`residual_linear` run it in
:mod:`dejavu_engine.quant`, and :func:`pack` keeps it as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine import quant

BATCH_HINT = 16  # rows oneDNN's packed layout is tuned for; any row count runs (1 to 64 measured above)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be packed for oneDNN here."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed copy of a dense ``[out, in]`` weight (CPU, a dtype :func:`can_pack` accepts); a quantized
    weight stays as it is."""
    if isinstance(weight, quant.QuantizedWeight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` over the last dimension, for a dense or a packed weight.

    Dense without a bias: the one GEMM ``F.linear`` would run, called directly (a decode step makes
    hundreds of these calls, and the wrappers' dispatch costs more than the small GEMMs' difference).
    """
    if isinstance(weight, quant.QuantizedWeight):
        return quant.linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if bias is not None:
        return F.linear(x, weight, bias)
    return torch.mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])


def residual_linear(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)``. Dense float32 without a bias: one fused GEMM (addmm);
    otherwise (and below float32, where the fused sum would round once instead of HF's twice) a GEMM
    and an add."""
    if isinstance(weight, quant.QuantizedWeight):
        return quant.residual_linear(residual, x, weight, bias)
    if weight.is_mkldnn or bias is not None or residual.dtype != torch.float32:
        return residual + linear(x, weight, bias)
    out = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(residual.shape)
