"""One stage's preallocated KV cache for one microbatch, in the shared ``KVLayout``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dejavulib.layout import KVLayout

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name used in settings and layouts."""
    return _TORCH_DTYPES[name]


@dataclass(frozen=True)
class KVCache:
    """K and V tensors of shape ``layout.shape`` (``[layers, batch, kv_heads, max_len, head_dim]``).

    Index ``i`` of the first dimension is global layer ``layout.first_layer + i``. The engine writes
    positions in place; the streaming library reads and writes the same tensors.
    """

    layout: KVLayout
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, layout: KVLayout, device: torch.device | str = "cpu") -> KVCache:
        """Zero-filled cache for ``layout`` on ``device``."""
        dtype = torch_dtype(layout.dtype)
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
        """This cache if it holds ``positions`` positions, else one grown to hold them: doubled (at least),
        never past ``span``. Growth by doubling keeps the copies' cost amortised constant per token."""
        capacity = self.layout.max_len
        if positions <= capacity:
            return self
        return self.grown(min(span, max(positions, 2 * capacity)))

    @property
    def device(self) -> torch.device:
        return self.k.device

    def local(self, global_layer: int) -> int:
        """Index along the first dimension of a global layer index."""
        a, b = self.layout.layer_range
        if not a <= global_layer < b:
            raise IndexError(f"layer {global_layer} not in this cache's layers [{a}, {b})")
        return global_layer - a
