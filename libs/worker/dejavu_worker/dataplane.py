"""The serving protocol between stages, over a DejaVuLib endpoint.

Three kinds of traffic, each on its own channel so different threads can wait on each:

- stage messages (ACTIVATION): a pass moving down a pipeline — PREFILL / DECODE carry hidden states,
  RELEASE frees a microbatch's caches. A token pipeline's pass is a *cohort step*: it batches several
  microbatches (``members``: each one's id and step, in row order), iteration-level batching;
- token returns (TOKENS): the last token stage hands stage 0 a cohort step's tokens, per member;
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
    """One pass down a pipeline. In the token pipeline ``members`` lists (microbatch, step, rows) of
    each group of rows of ``tensor``, in row order — ``rows`` being the microbatch's rows the pass
    computes (its unfinished ones) — and ``mb_id`` is stage 0's cohort slot; a prompt pipeline's pass
    and RELEASE name one microbatch (or prompt task) in ``mb_id``."""

    kind: Kind
    mb_id: int
    step: int
    tensor: torch.Tensor | None = None
    meta: dict[str, Any] | None = None
    members: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    def encode(self) -> bytes:
        meta = {"kind": self.kind.value, "mb": self.mb_id, "step": self.step, "x": self.meta or {}}
        if self.members:
            meta["members"] = [[mb, step, list(rows)] for mb, step, rows in self.members]
        return frame(meta, self.tensor)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> StageMessage:
        meta, tensor = unframe(payload)
        members = tuple((int(mb), int(step), tuple(int(r) for r in rows)) for mb, step, rows in meta.get("members", ()))
        return cls(Kind(meta["kind"]), int(meta["mb"]), int(meta["step"]), tensor, meta.get("x") or {}, members)


@dataclass(frozen=True)
class Returned:
    """One microbatch's part of a token return: its step, the tokens to feed at its next step (one per
    row), whether it is done (every row finished, or the microbatch failed), and the rows still running
    (``live``: what its next step computes; None: unchanged)."""

    mb_id: int
    step: int
    tokens: tuple[int, ...]
    done: bool
    live: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TokenReturn:
    """What stage 0 learns at the end of cohort ``cohort``'s step: one :class:`Returned` per member.
    ``cohort == -1``: members a later stage failed on their own, outside any step's completion."""

    cohort: int
    members: tuple[Returned, ...]

    def encode(self) -> bytes:
        members = [
            [m.mb_id, m.step, list(m.tokens), m.done, None if m.live is None else list(m.live)] for m in self.members
        ]
        return frame({"cohort": self.cohort, "members": members}, None)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> TokenReturn:
        meta, _ = unframe(payload)
        members = tuple(
            Returned(
                int(mb),
                int(step),
                tuple(int(t) for t in tokens),
                bool(done),
                None if live is None else tuple(int(r) for r in live),
            )
            for mb, step, tokens, done, live in meta["members"]
        )
        return cls(int(meta["cohort"]), members)


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


def encode_chunks(chunks: list[KVChunk]) -> bytes:
    """Several KV chunks as one message (one buffered copy): a pass's replication of every member."""
    metas, parts = [], []
    for c in chunks:
        both = torch.stack((c.k, c.v))
        metas.append(
            {
                "mb": c.mb_id,
                "layers": list(c.layers),
                "rows": list(c.rows),
                "positions": list(c.positions),
                "step": c.step,
                "shape": list(both.shape),
            }
        )
        parts.append(both.reshape(-1))
    return frame({"chunks": metas}, torch.cat(parts))


def decode_chunks(payload: memoryview | bytes) -> list[KVChunk]:
    """Inverse of :func:`encode_chunks`; a single :class:`KVChunk` message decodes as a list of one."""
    meta, flat = unframe(payload)
    if "chunks" not in meta:
        return [KVChunk.decode(payload)]
    if flat is None or flat.dim() != 1:
        raise ValueError("a chunk batch carries one flat tensor")
    out, offset = [], 0
    for m in meta["chunks"]:
        shape = [int(d) for d in m["shape"]]
        n = int(np.prod(shape))
        if len(shape) != 6 or shape[0] != 2 or offset + n > flat.numel():
            raise ValueError(f"chunk shape {shape} does not fit the batch")
        both = flat[offset : offset + n].view(shape)
        offset += n
        out.append(
            KVChunk(
                int(m["mb"]),
                tuple(m["layers"]),
                tuple(m["rows"]),
                tuple(m["positions"]),
                both[0],
                both[1],
                int(m["step"]),
            )
        )
    if offset != flat.numel():
        raise ValueError("bytes left over after the last chunk")
    return out
