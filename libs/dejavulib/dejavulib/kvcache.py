"""One stage's KV cache for one microbatch as torch tensors, and region copies in and out of it.

The one ``KVCache`` of the system: the engine computes in it (writing positions in place), the
workers grow it as tokens are written, and every KV movement (prompt KV, replication, restores,
swapping) packs a region of it on one side and unpacks it on the other.

``pack`` and ``unpack`` are the paper's scatter/gather level, as its *buffered copy*: ``pack`` gathers a
non-contiguous region (layers x rows x heads x positions x head_dim, of K and/or V) into one contiguous
buffer with one strided copy per tensor, instead of one copy per contiguous chunk (the baseline
``dejavu bench streaming`` compares it with, ``benchmarks/per_chunk.py``); ``unpack`` is its inverse at the
destination. The packed order is ``[which][layer][row][head][position][head_dim]``: K before V.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dejavulib.layout import KVLayout, Region, Which

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name used in settings and layouts."""
    return TORCH_DTYPES[name]


@dataclass(frozen=True)
class KVCache:
    """K and V tensors of shape ``layout.shape`` (``[layers, batch, kv_heads, max_len, head_dim]``) on one
    device. Index ``i`` of the first dimension is global layer ``layout.first_layer + i``."""

    layout: KVLayout
    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        for name, t in (("k", self.k), ("v", self.v)):
            if tuple(t.shape) != self.layout.shape or t.dtype != TORCH_DTYPES[self.layout.dtype]:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, layout wants {self.layout.shape}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")

    @classmethod
    def allocate(cls, layout: KVLayout, device: str | torch.device = "cpu") -> KVCache:
        dtype = TORCH_DTYPES[layout.dtype]
        return cls(
            layout,
            torch.zeros(layout.shape, dtype=dtype, device=device),
            torch.zeros(layout.shape, dtype=dtype, device=device),
        )

    def grown(self, max_len: int) -> KVCache:
        """A cache of ``max_len`` positions holding this one's positions (``max_len`` >= this one's)."""
        old = self.layout.max_len
        if max_len < old:
            raise ValueError(f"a cache grows: {max_len} < {old} positions")
        bigger = KVCache.allocate(replace(self.layout, max_len=max_len), self.k.device)
        bigger.k[:, :, :, :old].copy_(self.k)
        bigger.v[:, :, :, :old].copy_(self.v)
        return bigger

    def holding(self, positions: int, span: int) -> KVCache:
        """This cache if it holds ``positions`` positions, else one grown as :meth:`KVLayout.holding` says."""
        layout = self.layout.holding(positions, span)
        return self if layout is self.layout else self.grown(layout.max_len)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return self.k.nbytes + self.v.nbytes

    def local(self, global_layer: int) -> int:
        """Index along the first dimension of a global layer index."""
        return self.layout.local(global_layer)

    def whole(self, microbatch: int = 0) -> Region:
        """The region of every layer, row and position of this cache."""
        return self.layout.region(microbatch=microbatch)

    def tensor(self, which: Which) -> torch.Tensor:
        return self.k if which == Which.K else self.v

    def view(self, region: Region, which: Which, position_offset: int = 0) -> torch.Tensor:
        """The (strided) view of ``region`` in the ``which`` tensor, positions shifted by ``position_offset``."""
        region.check_within(self.layout)
        l0 = region.layers[0] - self.layout.first_layer
        l1 = region.layers[1] - self.layout.first_layer
        p0, p1 = region.positions[0] + position_offset, region.positions[1] + position_offset
        if p0 < 0 or p1 > self.layout.max_len:
            raise ValueError(f"positions {(p0, p1)} outside max_len {self.layout.max_len}")
        return self.tensor(which)[l0:l1, region.rows[0] : region.rows[1], :, p0:p1, :]

    def packed_shape(self, region: Region) -> tuple[int, ...]:
        return self.layout.packed_shape(region)

    def pack(self, region: Region, out: torch.Tensor) -> torch.Tensor:
        """Gather ``region`` into the front of contiguous ``out`` (any dtype/shape with enough bytes); return the
        packed tensor (a view of ``out`` with this cache's dtype and ``packed_shape``)."""
        packed = typed_prefix(out, self.packed_shape(region), self.k.dtype)
        for i, which in enumerate(region.tensors):
            packed[i].copy_(self.view(region, which))
        return packed

    def unpack(self, region: Region, data: torch.Tensor, position_offset: int = 0) -> None:
        """Scatter packed ``data`` (as produced by ``pack``) into ``region`` shifted by ``position_offset``."""
        packed = typed_prefix(data, self.packed_shape(region), self.k.dtype)
        for i, which in enumerate(region.tensors):
            self.view(region, which, position_offset).copy_(packed[i])


def typed_prefix(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    flat = buf.reshape(-1).view(torch.uint8)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if flat.numel() < nbytes:
        raise ValueError(f"buffer of {flat.numel()} bytes cannot hold {nbytes}")
    return flat[:nbytes].view(dtype).view(shape)


class StagingBuffer:
    """A reusable contiguous host/device buffer that grows to the largest request (the paper's temporary buffer).

    Not thread-safe: one owner at a time (e.g. the ``Streamer`` thread).
    """

    def __init__(self, device: str | torch.device = "cpu", pin: bool = False) -> None:
        self.device, self.pin = torch.device(device), pin
        self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)

    def get(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` of uint8; the contents of earlier calls are not preserved."""
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        return self._buf[:nbytes]
