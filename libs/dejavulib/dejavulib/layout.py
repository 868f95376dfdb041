"""The KV-cache layout: one named, tested type shared by the engine and the streaming library.

A stage preallocates, per microbatch, one K and one V tensor, each of shape

    [layers_of_stage, batch, kv_heads, max_len, head_dim]        (dimension order ``LBHSD``)

as FasterTransformer does (the paper's Figure 6). Prefill writes positions [0, P); every decode
step writes one position for every layer, batch row and head: ``layers * batch * kv_heads``
chunks of ``head_dim`` elements each, per tensor. That non-contiguous update is what the
buffered copies of DejaVuLib gather into one transfer.

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

DIM_ORDER = ("layer", "batch", "head", "position", "head_dim")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class Which(enum.IntFlag):
    """Which of the two cache tensors a region covers."""

    K = 1
    V = 2
    KV = 3


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one stage's KV cache for one microbatch.

    ``first_layer`` is the model-global index of the stage's first layer, so a layout also says
    which global layers [first_layer, first_layer + layers) the cache holds.
    """

    layers: int
    batch: int
    kv_heads: int
    max_len: int
    head_dim: int
    dtype: str = "float32"
    first_layer: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "batch", "kv_heads", "max_len", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.first_layer < 0:
            raise ValueError("KVLayout.first_layer must be >= 0")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(_DTYPE_BYTES)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.batch, self.kv_heads, self.max_len, self.head_dim)

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def layer_range(self) -> tuple[int, int]:
        """Global layers [a, b) held by this cache."""
        return (self.first_layer, self.first_layer + self.layers)

    @property
    def bytes_per_tensor(self) -> int:
        """Bytes of K (or of V) for the whole microbatch."""
        return self.layers * self.batch * self.kv_heads * self.max_len * self.head_dim * self.itemsize

    @property
    def bytes_total(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.bytes_per_tensor

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one position of one sequence occupies across the stage's layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.itemsize

    def local(self, global_layer: int) -> int:
        """Index along a cache's first dimension of a global layer index."""
        a, b = self.layer_range
        if not a <= global_layer < b:
            raise IndexError(f"layer {global_layer} not in this cache's layers [{a}, {b})")
        return global_layer - a

    def packed_shape(self, region: Region) -> tuple[int, ...]:
        """Shape of ``region`` packed (``[which][layer][row][head][position][head_dim]``)."""
        return (len(region.tensors), region.n_layers, region.n_rows, self.kv_heads, region.n_positions, self.head_dim)

    def holding(self, positions: int, span: int) -> KVLayout:
        """This layout if it holds ``positions`` positions, else one grown to hold them: doubled (at
        least), never past ``span`` (``ValueError`` beyond it). Growth by doubling keeps the copies'
        cost amortised constant per token."""
        if positions <= self.max_len:
            return self
        if positions > span:
            raise ValueError(f"{positions} positions exceed the span of {span}")
        return replace(self, max_len=min(span, max(positions, 2 * self.max_len)))

    def region(
        self,
        layers: tuple[int, int] | None = None,
        rows: tuple[int, int] | None = None,
        positions: tuple[int, int] | None = None,
        which: Which = Which.KV,
        microbatch: int = 0,
    ) -> Region:
        """A region of this cache; ``layers`` are global indices, default: everything."""
        region = Region(
            microbatch=microbatch,
            layers=layers if layers is not None else self.layer_range,
            rows=rows if rows is not None else (0, self.batch),
            positions=positions if positions is not None else (0, self.max_len),
            which=which,
        )
        region.check_within(self)
        return region


@dataclass(frozen=True)
class Region:
    """A rectangular part of a microbatch's cache: global layers [a, b), batch rows [r0, r1),
    positions [p0, p1), of K and/or V. All heads and the whole head dimension are included.
    """

    microbatch: int
    layers: tuple[int, int]
    rows: tuple[int, int]
    positions: tuple[int, int]
    which: Which = Which.KV

    def __post_init__(self) -> None:
        for name in ("layers", "rows", "positions"):
            lo, hi = getattr(self, name)
            if not 0 <= lo < hi:
                raise ValueError(f"Region.{name} must be a non-empty range [lo, hi) with lo >= 0, got {(lo, hi)}")

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def n_positions(self) -> int:
        return self.positions[1] - self.positions[0]

    @property
    def tensors(self) -> tuple[Which, ...]:
        return tuple(w for w in (Which.K, Which.V) if w & self.which)

    def check_within(self, layout: KVLayout) -> None:
        """Raise ``ValueError`` unless the region lies inside ``layout``."""
        a, b = layout.layer_range
        if not (a <= self.layers[0] and self.layers[1] <= b):
            raise ValueError(f"region layers {self.layers} outside the cache's layers {(a, b)}")
        if self.rows[1] > layout.batch:
            raise ValueError(f"region rows {self.rows} outside batch {layout.batch}")
        if self.positions[1] > layout.max_len:
            raise ValueError(f"region positions {self.positions} outside max_len {layout.max_len}")

    def nbytes(self, layout: KVLayout) -> int:
        """Bytes the region holds in ``layout``'s dtype and head geometry."""
        per = self.n_layers * self.n_rows * layout.kv_heads * self.n_positions * layout.head_dim * layout.itemsize
        return per * len(self.tensors)
