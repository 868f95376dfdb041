"""The serving protocol between stages, over a DejaVuLib endpoint.

Three kinds of traffic, each on its own channel so different threads can wait on each:

- stage messages (ACTIVATION): a pass of microbatch ``mb_id`` at ``step`` moving down a pipeline —
  PREFILL / DECODE carry hidden states, RELEASE frees the microbatch's caches;
- token returns (TOKENS): the last token stage hands stage 0 the step's tokens;
- prompt KV (KV_PROMPT): a region of a prompt stage's cache, addressed to rows and positions of a
  token microbatch, moved as one buffered transfer.

A message is a small JSON ``meta`` plus at most one tensor, framed as
``[u32 meta length][meta JSON][tensor bytes]``; dtype and shape ride in ``meta``. No pickle.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_LEN = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


class Kind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    RELEASE = "release"


def frame(meta: dict[str, Any], tensor: torch.Tensor | None) -> bytes:
    """``meta`` and ``tensor`` as one contiguous payload (the tensor is copied once)."""
    meta = dict(meta)
    body = b""
    if tensor is not None:
        t = tensor.detach().to("cpu").contiguous()
        meta["dtype"], meta["shape"] = _NAMES[t.dtype], list(t.shape)
        body = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    head = json.dumps(meta, separators=(",", ":")).encode()
    return _LEN.pack(len(head)) + head + body


def unframe(payload: memoryview | bytes) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Inverse of :func:`frame`; raises ValueError on a malformed payload."""
    buf = memoryview(payload)
    if len(buf) < _LEN.size:
        raise ValueError("payload shorter than its length prefix")
    (n,) = _LEN.unpack_from(buf, 0)
    if _LEN.size + n > len(buf):
        raise ValueError("meta length beyond the payload")
    meta = json.loads(bytes(buf[_LEN.size : _LEN.size + n]))
    if not isinstance(meta, dict):
        raise ValueError("meta is not an object")
    if "dtype" not in meta:
        return meta, None
    dtype = _DTYPES[meta["dtype"]]
    shape = [int(d) for d in meta["shape"]]
    raw = np.frombuffer(buf[_LEN.size + n :], dtype=np.int16 if dtype == torch.bfloat16 else _np(dtype)).copy()
    t = torch.from_numpy(raw)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    if t.numel() != int(np.prod(shape)):
        raise ValueError(f"tensor bytes do not match shape {shape}")
    return meta, t.reshape(shape)


def _np(dtype: torch.dtype) -> Any:
    return {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}[dtype]


@dataclass(frozen=True)
class StageMessage:
    kind: Kind
    mb_id: int
    step: int
    tensor: torch.Tensor | None = None
    meta: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return frame({"kind": self.kind.value, "mb": self.mb_id, "step": self.step, "x": self.meta or {}}, self.tensor)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> StageMessage:
        meta, tensor = unframe(payload)
        return cls(Kind(meta["kind"]), int(meta["mb"]), int(meta["step"]), tensor, meta.get("x") or {})


@dataclass(frozen=True)
class TokenReturn:
    mb_id: int
    step: int
    tokens: tuple[int, ...]
    done: bool

    def encode(self) -> bytes:
        return frame({"mb": self.mb_id, "step": self.step, "tokens": list(self.tokens), "done": self.done}, None)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> TokenReturn:
        meta, _ = unframe(payload)
        return cls(int(meta["mb"]), int(meta["step"]), tuple(int(t) for t in meta["tokens"]), bool(meta["done"]))


@dataclass(frozen=True)
class KVChunk:
    """K and V of global layers [layers), destination rows [rows) and positions [positions) of ``mb_id``.

    ``k``/``v`` have shape ``[layers, rows, kv_heads, positions, head_dim]``.
    """

    mb_id: int
    layers: tuple[int, int]
    rows: tuple[int, int]
    positions: tuple[int, int]
    k: torch.Tensor
    v: torch.Tensor
    step: int = 0  # replication and restores: the step the chunk brings the cache up to
    role: str = ""  # restores: "primary" (the receiver's own cache) or "replica" (its predecessor's)

    def encode(self) -> bytes:
        both = torch.stack((self.k, self.v))  # one buffered transfer for K and V
        meta = {
            "mb": self.mb_id,
            "layers": list(self.layers),
            "rows": list(self.rows),
            "positions": list(self.positions),
            "step": self.step,
            "role": self.role,
        }
        return frame(meta, both)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> KVChunk:
        meta, both = unframe(payload)
        if both is None or both.shape[0] != 2:
            raise ValueError("a KV chunk carries stacked K and V")
        return cls(
            int(meta["mb"]),
            tuple(meta["layers"]),
            tuple(meta["rows"]),
            tuple(meta["positions"]),
            both[0],
            both[1],
            int(meta.get("step", 0)),
            str(meta.get("role", "")),
        )
