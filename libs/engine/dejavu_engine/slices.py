"""Attention of a pass of per-request slices over a paged pool (:class:`~dejavu_engine.geometry.Slice`).

A pass packs the new tokens of every slice back to back in one row, no padding: slice ``i`` is tokens ``[offset_i,
offset_i + length_i)`` of the row, at positions ``[start_i, end_i)`` of its own request. Each layer writes those
tokens' K/V into the request's blocks of the pool, then each token attends causally over its request's positions
``[0, its own]``, read through the request's block table. :func:`context` builds what every layer shares, once per
pass; :func:`attend` is one layer's attention, on either path:

- **native** (CPU, the kernels built, causal families without biases): one :func:`~dejavu_engine.native.paged_write`
  of the chunks' K/V and one :func:`~dejavu_engine.native.paged_prefill_attention` for every slice of more than one
  token, and one :func:`~dejavu_engine.native.paged_decode_attention` (which writes its row's K/V itself) for every
  one-token slice;
- **torch** (the device-generic path, what CUDA runs): one indexed write of every token's K/V per slab, then per
  slice its blocks gathered in order and torch's SDPA with the slice's own mask (its causal offset, ALiBi biases).

A slice whose table leads with freed blocks (:attr:`~dejavu_engine.geometry.Slice.freed`: a stage whose every layer
has a sliding window, the blocks before its first query's window given back) is read from its first block that is
not freed on, its window mask cut to the same positions; only the torch path runs such stages (the native kernels
take no window and refuse a freed entry).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dejavu_engine import native
from dejavu_engine.family import ForwardContext, cat_local_rope
from dejavu_engine.geometry import BatchGeometry, Slice
from dejavu_engine.sdpa import layer_mask, sdpa


@dataclass(frozen=True)
class NativePlan:
    """The native kernels' arguments of a pass (int64, on the CPU). ``decodes`` are the token offsets of the one-token
    slices, with their block tables and spans ``(0, end)`` (:func:`~dejavu_engine.native.paged_decode_attention`);
    ``chunk_tables`` and ``chunk_places`` (offset, start, end) the other slices' for
    :func:`~dejavu_engine.native.paged_write`, ``chunk_segments`` (offset, length, start) theirs for
    :func:`~dejavu_engine.native.paged_prefill_attention`. Empty parts are None."""

    decodes: torch.Tensor | None
    decode_tables: torch.Tensor | None
    decode_spans: torch.Tensor | None
    chunk_tables: torch.Tensor | None
    chunk_places: torch.Tensor | None
    chunk_segments: torch.Tensor | None


@dataclass(frozen=True)
class TorchPlan:
    """The indices of the torch path (on the pool's device). ``writes`` holds, per slab that receives tokens,
    ``(slab, rows, blocks, offsets)``: the row's tokens ``rows`` go to positions ``offsets`` of the slab's blocks
    ``blocks``. ``reads[i]`` is slice ``i``'s blocks in logical order as ``(slab, picks, blocks)`` parts (``picks``:
    which of its blocks, None for all of them), how many blocks it reads, and the position of the first (past its
    freed blocks; 0 where none are)."""

    writes: tuple[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor], ...]
    reads: tuple[tuple[tuple[tuple[int, torch.Tensor | None, torch.Tensor], ...], int, int], ...]


@dataclass(frozen=True)
class SliceContext(ForwardContext):
    """The :class:`ForwardContext` of a pass of slices: ``positions`` and ``rope`` cover every token of the one
    row, in order; ``geometry`` is that row (``cur_len`` = the pass's tokens). ``parts[i] = (offset, length, start,
    ctx_i)``: slice ``i``'s tokens, first position and own context (as if its request were alone with ``end_i``
    positions: its mask or biases over ``[0, end_i)``, what the torch path attends with). The layer's caches are
    the pool's slabs of that layer. Exactly one of ``native_plan`` and ``torch_plan`` is set."""

    parts: tuple[tuple[int, int, int, ForwardContext], ...] = ()
    native_plan: NativePlan | None = None
    torch_plan: TorchPlan | None = None


def context(
    slices: Sequence[Slice],
    contexts: Sequence[ForwardContext],
    block_size: int,
    slab_blocks: int,
    native_kernels: bool,
    device: torch.device,
) -> SliceContext:
    """One context for a pass of ``slices``, ``contexts[i]`` being slice ``i``'s own (the family's context of
    ``length_i`` new tokens of one unpadded row of ``end_i`` positions), for blocks of ``block_size`` positions in
    slabs of ``slab_blocks``; on the native kernels' path where ``native_kernels``."""
    parts, offset = [], 0
    for piece, ctx in zip(slices, contexts, strict=True):
        parts.append((offset, piece.length, piece.start, ctx))
        offset += piece.length
    rope = None
    if contexts[0].rope is not None:
        rope = tuple(torch.cat([c.rope[i] for c in contexts], dim=1) for i in range(2))  # type: ignore[index]
    positions = torch.cat([c.positions for c in contexts], dim=1)
    plan = _native_plan(slices, block_size) if native_kernels else None
    torch_plan = None if native_kernels else _torch_plan(slices, block_size, slab_blocks, device)
    return SliceContext(
        BatchGeometry((0,), offset),
        0,
        positions,
        None,
        False,
        rope,  # type: ignore[arg-type]
        local_rope=cat_local_rope(contexts, dim=1),
        parts=tuple(parts),
        native_plan=plan,
        torch_plan=torch_plan,
    )


def _tables(slices: Sequence[Slice], block_size: int) -> torch.Tensor:
    """The slices' block tables as int64 ``[slices, max_blocks]``, each cut to the blocks of ``[0, end)``, -1 past
    them."""
    rows = [piece.table[: math.ceil(piece.end / block_size)] for piece in slices]
    table = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return table


def _native_plan(slices: Sequence[Slice], block_size: int) -> NativePlan:
    if any(piece.freed for piece in slices):
        raise ValueError("the native kernels attend over every position of a slice: its table may free no block")
    offsets = [0]
    for piece in slices[:-1]:
        offsets.append(offsets[-1] + piece.length)
    decodes = [i for i, piece in enumerate(slices) if piece.length == 1]
    chunks = [i for i, piece in enumerate(slices) if piece.length > 1]
    decode_tables = decode_spans = decode_rows = None
    if decodes:
        decode_rows = torch.tensor([offsets[i] for i in decodes], dtype=torch.long)
        decode_tables = _tables([slices[i] for i in decodes], block_size)
        decode_spans = torch.tensor([(0, slices[i].end) for i in decodes], dtype=torch.long)
    chunk_tables = chunk_places = chunk_segments = None
    if chunks:
        chunk_tables = _tables([slices[i] for i in chunks], block_size)
        chunk_places = torch.tensor([(offsets[i], slices[i].start, slices[i].end) for i in chunks], dtype=torch.long)
        chunk_segments = torch.tensor(
            [(offsets[i], slices[i].length, slices[i].start) for i in chunks], dtype=torch.long
        )
    return NativePlan(decode_rows, decode_tables, decode_spans, chunk_tables, chunk_places, chunk_segments)


def _torch_plan(slices: Sequence[Slice], block_size: int, slab_blocks: int, device: torch.device) -> TorchPlan:
    # Each slice's blocks it reads: from its first one not freed to the one of its end.
    firsts = [piece.freed for piece in slices]
    tables = [
        torch.tensor(piece.table[first : math.ceil(piece.end / block_size)], dtype=torch.long)
        for piece, first in zip(slices, firsts, strict=True)
    ]
    positions = torch.cat([torch.arange(piece.start, piece.end) for piece in slices])  # the row's tokens in order
    block_t = torch.cat(
        [
            table[torch.arange(piece.start, piece.end) // block_size - first]
            for piece, table, first in zip(slices, tables, firsts, strict=True)
        ]
    )
    offset_t = positions % block_size
    writes = []
    for slab in (block_t // slab_blocks).unique().tolist():
        pick = (block_t // slab_blocks == slab).nonzero().squeeze(1)
        writes.append((slab, pick.to(device), (block_t[pick] % slab_blocks).to(device), offset_t[pick].to(device)))
    reads = []
    for table, first in zip(tables, firsts, strict=True):
        slabs = table // slab_blocks
        parts = []
        for slab in sorted(set(slabs.tolist())):
            picks = (slabs == slab).nonzero().squeeze(1)
            every = picks.numel() == table.numel()
            parts.append((slab, None if every else picks.to(device), (table[picks] % slab_blocks).to(device)))
        reads.append((tuple(parts), table.numel(), first * block_size))
    return TorchPlan(tuple(writes), tuple(reads))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slabs: Sequence[torch.Tensor],
    v_slabs: Sequence[torch.Tensor],
    ctx: SliceContext,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's attention of a pass of slices: ``q`` ``[1, heads, tokens, head_dim]``, ``k``/``v`` ``[1,
    kv_heads, tokens, head_dim]`` (the row's tokens), ``k_slabs``/``v_slabs`` the pool's slabs of the layer
    (``[slab_blocks, kv_heads, block_size, head_dim]`` each). Writes every token's K/V into its request's block,
    then returns each token's attention over its request's positions up to its own, ``[1, tokens, heads *
    head_dim]``. A sliding-window layer (``ctx.local``) masks each slice with its own context's ``window_mask``;
    ``softcap`` soft-caps the logits (:func:`~dejavu_engine.attention.sdpa`): the torch path only."""
    head_dim = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    if ctx.native_plan is not None:
        assert not ctx.local and softcap is None, "native attention with a window or a soft cap"
        return _attend_native(q, k, v, list(k_slabs), list(v_slabs), ctx.native_plan, scale)
    assert ctx.torch_plan is not None
    return _attend_torch(q, k, v, k_slabs, v_slabs, ctx, scale, softcap)


def _attend_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slabs: list[torch.Tensor],
    v_slabs: list[torch.Tensor],
    plan: NativePlan,
    scale: float,
) -> torch.Tensor:
    _, heads, tokens, head_dim = q.shape
    kv_heads = k.shape[1]
    q_rows = q.transpose(1, 2).reshape(tokens, heads, head_dim)  # views of a fused projection, not copies
    k_rows = k.transpose(1, 2).reshape(tokens, kv_heads, head_dim)
    v_rows = v.transpose(1, 2).reshape(tokens, kv_heads, head_dim)
    if plan.chunk_segments is None:  # every token is a one-token slice, in order: no gather, no scatter
        assert plan.decode_tables is not None and plan.decode_spans is not None
        q_rows, k_rows, v_rows = q_rows.contiguous(), k_rows.contiguous(), v_rows.contiguous()
        out = native.paged_decode_attention(
            q_rows, k_rows, v_rows, k_slabs, v_slabs, plan.decode_tables, plan.decode_spans, scale
        )
        return out.view(1, tokens, heads * head_dim)
    assert plan.chunk_tables is not None and plan.chunk_places is not None
    native.paged_write(k_rows, v_rows, k_slabs, v_slabs, plan.chunk_tables, plan.chunk_places, clear_before=False)
    out = native.paged_prefill_attention(q_rows, k_slabs, v_slabs, plan.chunk_tables, plan.chunk_segments, scale)
    if plan.decodes is not None:
        assert plan.decode_tables is not None and plan.decode_spans is not None
        rows = plan.decodes
        out[rows] = native.paged_decode_attention(
            q_rows[rows], k_rows[rows], v_rows[rows], k_slabs, v_slabs, plan.decode_tables, plan.decode_spans, scale
        )
    return out.view(1, tokens, heads * head_dim)


def _attend_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slabs: Sequence[torch.Tensor],
    v_slabs: Sequence[torch.Tensor],
    ctx: SliceContext,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    assert ctx.torch_plan is not None
    k_tokens, v_tokens = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
    for slab, rows, blocks, offsets in ctx.torch_plan.writes:
        k_slabs[slab][blocks, :, offsets, :] = k_tokens[rows]
        v_slabs[slab][blocks, :, offsets, :] = v_tokens[rows]
    outs = []
    for (offset, length, start, own), (parts, n_blocks, first) in zip(ctx.parts, ctx.torch_plan.reads, strict=True):
        end = start + length
        keys, values = _gather(k_slabs, parts, n_blocks, end - first), _gather(v_slabs, parts, n_blocks, end - first)
        mask, causal = layer_mask(own, ctx.local)
        if first:  # keys from position ``first`` on: the window's mask over them (Stage.check_slices: it needs no more)
            assert ctx.local and mask is not None, "freed blocks in a layer without a sliding window"
            mask = mask[..., first:]
        outs.append(sdpa(q[:, :, offset : offset + length], keys, values, mask, causal, scale, softcap))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    _, heads, tokens, head_dim = out.shape
    return out.transpose(1, 2).reshape(1, tokens, heads * head_dim)


def _gather(
    slabs: Sequence[torch.Tensor],
    parts: tuple[tuple[int, torch.Tensor | None, torch.Tensor], ...],
    n_blocks: int,
    end: int,
) -> torch.Tensor:
    """The first ``end`` positions of a slice's blocks it reads, of one layer's K or V, ``[1, kv_heads, end,
    head_dim]``, gathered block by block from ``slabs`` in logical order."""
    if len(parts) == 1 and parts[0][1] is None:  # every block in one slab: one indexed copy
        slab, _, blocks = parts[0]
        picked = slabs[slab][blocks]
    else:
        first = slabs[0]
        picked = torch.empty((n_blocks, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for slab, picks, blocks in parts:
            picked[picks if picks is not None else slice(None)] = slabs[slab][blocks]
    kv_heads, block_size, head_dim = picked.shape[1:]
    return picked.transpose(0, 1).reshape(1, kv_heads, n_blocks * block_size, head_dim)[:, :, :end]
